"""What a spawned two-rank test worker does first: join the gloo group and keep mixprec's log lines."""

import logging

import torch.distributed as dist


def join(rank: int, store_path: str, world: int) -> list[str]:
    """Join the gloo process group through a FileStore; returns the list mixprec's log messages go to."""
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("mixprec").addHandler(handler)
    logging.getLogger("mixprec").setLevel(logging.INFO)
    return messages
