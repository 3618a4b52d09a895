"""Drafter-training data without a dataset: user turns the target writes itself (Magpie,
arXiv 2406.08464), prompts derived from the standard library, and the target's greedy answers,
in resumable gzip shards (``adaflash drafter-data``)."""
