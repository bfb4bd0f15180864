"""Numerical stability: health checks each step, the locator of the first non-finite
value, diagnosis, recovery by rewinding, and fault-injection drills.

Names load on first use: the config table imports without torch.
"""

import importlib

_WHERE = {
    "StabilityConfig": "config", "Drill": "config", "parse_drill": "config",
    "StabilityGuard": "guard", "clone_state": "guard",
    "HealthMonitor": "health", "Locator": "locate", "Finding": "locate", "diagnose": "diagnose",
}
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"mixprec.stability.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'mixprec.stability' has no attribute {name!r}")
