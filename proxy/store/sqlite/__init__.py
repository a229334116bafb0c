"""SQLite's own: opening a database with sqlite-vec, its schema's migrations, the
full-text index's SQL, the search's SQL (FTS5 BM25, vec0 KNN), the lock file beside it, and
scrubbing after deletes."""
