"""Training drafters: distillation and its divergences."""
