"""Measuring precision: number formats, the audit of a real step, numerics experiments
and the memory / communication planner."""
