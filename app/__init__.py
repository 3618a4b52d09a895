"""Service processes around the engine: the trainer, hot swap, and (later) the API and UI."""
