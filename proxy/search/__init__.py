"""Finding memories: FTS5 query building, the embedder, both searches and their fusion (RRF)."""
