"""Lightning wrappers that train the AdaFlash drafter and length head."""
