"""FSDP2's all-gather of narrow weights in their own format: a Linear's (linear) and a stacked experts
weight's (experts)."""
