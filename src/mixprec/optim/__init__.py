"""Optimizers with narrower state than torch's."""

from mixprec.optim.adamw import AdamW

__all__ = ["AdamW"]
