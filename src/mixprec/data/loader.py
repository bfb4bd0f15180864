"""Batches of token windows in a deterministic, resumable order.

The training stream is cut into non-overlapping windows of seq_len + 1 tokens,
visited in a fresh permutation each epoch; the position (epoch, index) is all the
state, and it goes into the checkpoint. The stream is a tensor in memory or a
prepared folder's shards on disk (`shards.Tokens`): the same windows, the
same order. Under data parallelism every rank draws the same global batch and
reads only its own rows of it.
"""

from __future__ import annotations

import torch

from mixprec.errors import UserError


def _windows(tokens: torch.Tensor, seq_len: int, split: str) -> int:
    n = (len(tokens) - 1) // seq_len
    if n < 1:
        raise UserError(
            f"data: the {split} split has {len(tokens)} tokens, shorter than one sequence of "
            f"training.seq_len {seq_len} + 1; accepted: more text or a smaller training.seq_len"
        )
    return n


def to_device(rows: torch.Tensor, device) -> torch.Tensor:
    """rows on `device`. To a GPU from pinned memory without blocking: a copy from pageable
    memory makes the host wait for it (one synchronising call a step), and the step that
    follows is queued behind the copy on the same stream anyway. The pinned buffer comes from
    torch's caching host allocator, which does not hand it out again before the copy is done."""
    device = torch.device(device)
    if device.type != "cuda":
        return rows.to(device)
    return rows.pin_memory().to(device, non_blocking=True)


def _gather(tokens, starts: torch.Tensor, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(tokens, torch.Tensor):
        rows = tokens[starts[:, None] + torch.arange(seq_len + 1)]  # (B, T + 1)
    else:  # shards on disk
        rows = tokens.rows(starts, seq_len + 1)
    rows = to_device(rows, device)
    return rows[:, :-1], rows[:, 1:]  # inputs, next-token targets: (B, T) each


class TrainLoader:
    """`batch_size` windows a batch (the global micro-batch); `rows` picks the ones this rank reads."""

    def __init__(self, tokens, seq_len: int, batch_size: int, seed: int, device="cpu", rows: slice = slice(None)):
        self.tokens, self.seq_len, self.batch_size, self.seed, self.device = tokens, seq_len, batch_size, seed, device
        self.rows = rows
        self.n_windows = _windows(tokens, seq_len, "training")
        self.epoch, self.index = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> torch.Tensor:
        """This epoch's order of the windows; int32 where it fits, half the memory of int64 (a
        2 GB corpus has 7.6M windows of 256 tokens) with the same draws, so the same order."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        dtype = torch.int32 if self.n_windows < 2**31 else torch.int64
        return torch.randperm(self.n_windows, generator=gen, dtype=dtype)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        picked, count = [], 0
        while count < self.batch_size:
            if self.index == self.n_windows:
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = min(self.batch_size - count, self.n_windows - self.index)
            picked.append(self._order[self.index:self.index + take])
            self.index, count = self.index + take, count + take
        starts = torch.cat(picked)[self.rows].long() * self.seq_len
        return _gather(self.tokens, starts, self.seq_len, self.device)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "n_windows": self.n_windows, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        # an epoch's order is the seed's permutation: another seed would see some windows twice, others never
        if state.get("seed", self.seed) != self.seed:  # checkpoints before the seed was kept: not checked
            raise UserError(
                f"checkpoint: the data order was drawn with training.seed {state['seed']}, this run has "
                f"{self.seed}; accepted: training.seed {state['seed']} to resume (or a new job.dump_folder)"
            )
        if state["n_windows"] != self.n_windows:
            raise UserError(
                f"checkpoint: the data has {self.n_windows} windows, the checkpoint was made on "
                f"{state['n_windows']}; resume with the same data.source, tokenizer and seq_len"
            )
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._permutation(self.epoch)


def val_batches(tokens, seq_len: int, batch_size: int, n_batches: int, device="cpu", rows: slice = slice(None)):
    """The first n_batches * batch_size validation windows in order (fewer if the split is short),
    as (inputs, targets, real rows) per batch: `rows` of each batch of `batch_size` (a rank's
    share of the global batch). A rank whose share of a short last batch is empty gets the
    batch's first row as a stand-in with 0 real rows (its forward still runs: under FSDP every
    rank's does)."""
    n = min(_windows(tokens, seq_len, "validation"), n_batches * batch_size)
    starts = torch.arange(n) * seq_len
    batches = []
    for chunk in starts.split(batch_size):
        mine = chunk[rows]
        batches.append((*_gather(tokens, mine if len(mine) else chunk[:1], seq_len, device), len(mine)))
    return batches
