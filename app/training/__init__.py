"""Weights over time: the trainer service (buffer → training rounds → versions) and the version
watcher that hot-swaps the active version into the serving backend."""
