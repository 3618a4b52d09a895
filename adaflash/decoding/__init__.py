"""Pure decoding math: logits processing, acceptance rules, verify-length policies."""
