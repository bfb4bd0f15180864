from mixprec.distributed.fsdp import apply_fsdp

__all__ = ["apply_fsdp"]
