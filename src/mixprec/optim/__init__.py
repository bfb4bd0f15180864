"""Optimizers with narrower state than torch's, and narrower weights' updates."""

from mixprec.optim.adamw import AdamW
from mixprec.optim.updates import BF16Updates

__all__ = ["AdamW", "BF16Updates"]
