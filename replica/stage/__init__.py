"""Rewrites of a stage's graph: split backward, rebuilt activations, whole-batch batch-norm statistics."""
