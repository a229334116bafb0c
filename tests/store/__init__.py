"""The store and its schema, full-text queries, retrieval through the store, and the tool-result
slot store backends (Redis and embedded)."""
