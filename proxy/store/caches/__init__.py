"""The in-memory search indexes both backends share: users' full-text terms and
vectors held in memory (BM25 and exact KNN in numpy), the scope filters, word counts, and loading
them warm."""
