"""The trajectory buffer and the weight-version registry (SQLite by default, PostgreSQL by URL)."""
