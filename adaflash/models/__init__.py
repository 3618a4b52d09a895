"""Neural modules: the target runtime, the DFlash drafter and the adaptive length head."""
