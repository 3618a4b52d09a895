"""The serving engine: continuous batching around the speculative round."""
