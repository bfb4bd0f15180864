"""BFloat16 weights without FP32 master copies: compensated (Kahan) and stochastically
rounded updates around any torch optimizer.

A bfloat16 weight keeps 8 significant bits, so an update smaller than 2^-9 of the
weight rounds away (1 + 2^-9 == 1) and training in pure bfloat16 stalls. Two cures,
neither needing a 4-byte master copy:

- kahan: a bfloat16 compensation buffer per parameter carries what the last rounding
  dropped; the weight the optimizer steps is weight + compensation (16 significant
  bits), and after the step weight = bf16(w32), compensation = bf16(w32 - weight).
- stochastic: the stepped weight rounds up or down to a neighbouring bfloat16 value with
  probability proportional to its distance, so the rounding is unbiased on average and
  small updates survive in expectation. The random bits come from a counter-based hash
  (murmur3's finaliser over the element index) keyed by (seed, rank, step, tensor): a
  run is reproducible, resumes exactly, and eager and compiled kernels agree bit for bit.

How it wraps the optimizer: a step pre-hook swaps, in the optimizer's param groups, each
low-precision parameter for an FP32 working copy that carries the FP32 gradient and the
widened optimizer state; the optimizer's own foreach or fused kernel steps those; the
post-hook rounds each result into the parameter's own storage (FSDP2's shards keep their
views), narrows the state back and puts the parameter back. Between steps the optimizer
holds its parameters as always, so state_dict, DCP and FSDP2's sharded state dicts see
nothing unusual; the compensation is one more state entry, shaped, sharded and saved
like the parameter. The FP32 working copies exist only during the step: `BF16Updates.step`
(which Policy.step calls) steps the parameters in chunks of at most `chunk_numel`
elements, so they never take more than 16 bytes x chunk_numel with Adam; a plain
optimizer.step() widens all parameters at once.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

METHODS = ("kahan", "stochastic")
CHUNK_NUMEL = 2**26  # parameter elements widened at a time: 1 GiB of FP32 working copies with Adam
COMPENSATION = "kahan_compensation"  # the optimizer-state key of the Kahan buffer


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a plain tensor: itself)."""
    return t.to_local() if hasattr(t, "device_mesh") else t


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser, in int64 arithmetic masked to 32 bits (no signed overflow)."""
    mask = 0xFFFFFFFF
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & mask
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & mask
    return h ^ (h >> 16)


def stochastic_round_bf16(x: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """FP32 `x` rounded to bfloat16 up or down at random, P(up) = the dropped 16 bits / 2^16,
    with the random bits a hash of each element's index and `key` (a 0-dim int64 tensor, so
    a compiled kernel is not specialised on it). Non-finite values round to nearest."""
    flat = x.reshape(-1)
    bits = flat.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    index = torch.arange(flat.numel(), device=x.device, dtype=torch.int64)
    noise = _mix32((index + key) & 0xFFFFFFFF) & 0xFFFF
    rounded = ((bits + noise) & 0xFFFF0000).to(torch.int32).view(torch.float32)
    out = torch.where(torch.isfinite(flat), rounded, flat).to(torch.bfloat16)
    return out.view(x.shape)


def _key(seed: int, rank: int, step: int, tensor: int) -> int:
    """splitmix64 over the four counters: a different 32-bit key for each rounding."""
    z = 0
    for v in (seed, rank, step, tensor):
        z = (z + v + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        z ^= z >> 31
    return z & 0xFFFFFFFF


class BF16Updates:
    """Kahan-compensated or stochastically rounded updates of the optimizer's bfloat16
    (or, for kahan, any low-precision) parameters; FP32 parameters step as they are.

        optimizer = torch.optim.AdamW(model.parameters(), foreach=True)  # model in bfloat16
        updates = BF16Updates(optimizer, "kahan")
        ... loss.backward(); optimizer.step() ...

    The optimizer state of each wrapped parameter (its tensors shaped like the parameter)
    is kept in the parameter's dtype between steps and widened to FP32 for the step.
    `compile`: run the stochastic rounding as one Inductor kernel (None: when it compiles
    here; the eager kernel gives the same bits, several times slower on a CPU).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, method: str, *, seed: int = 0, compile: bool | None = None,
                 chunk_numel: int = CHUNK_NUMEL):
        if method not in METHODS:
            raise ValueError(f"method {method!r}: accepted {', '.join(METHODS)}")
        if method == "stochastic":
            odd = {p.dtype for g in optimizer.param_groups for p in g["params"]} - {torch.bfloat16, torch.float32}
            if odd:
                raise ValueError(f"stochastic rounding is to bfloat16; these parameters are {', '.join(map(str, odd))}")
        self.optimizer, self.method, self.seed, self.chunk_numel = optimizer, method, seed, chunk_numel
        self.steps = 0  # optimizer.step() calls: each chunk's is one
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.compile = compile
        self._kernels = {}  # device type -> the rounding kernel chosen there
        self._counted = True
        self._working: list[tuple[torch.Tensor, torch.Tensor, list, int]] = []
        self._hooks = [optimizer.register_step_pre_hook(self._widen), optimizer.register_step_post_hook(self._narrow)]

    def remove(self) -> None:
        """Detach from the optimizer (its later steps are plain low-precision steps)."""
        for h in self._hooks:
            h.remove()

    def step(self) -> None:
        """optimizer.step() over chunks of the parameters that have gradients, at most
        chunk_numel elements each (a larger parameter alone), so that the FP32 working copies
        stay within 16 bytes x chunk_numel with Adam. The optimizer's step hooks run once per
        chunk."""
        groups = self.optimizer.param_groups
        full = [g["params"] for g in groups]
        chunks, size = [[[] for _ in groups]], 0
        for gi, params in enumerate(full):
            for p in params:
                if p.grad is None:
                    continue
                n = _local(p).numel()
                if size and size + n > self.chunk_numel:
                    chunks.append([[] for _ in groups])
                    size = 0
                chunks[-1][gi].append(p)
                size += n
        if len(chunks) == 1:
            self.optimizer.step()
            return
        try:
            for chunk in chunks:
                for group, params in zip(groups, chunk):
                    group["params"] = params
                self.optimizer.step()
        finally:
            for group, params in zip(groups, full):
                group["params"] = params

    def state_dict(self) -> dict:
        return {"method": self.method, "seed": self.seed, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        if state["method"] != self.method:
            raise ValueError(f"state of {state['method']} updates loaded into {self.method} updates")
        self.seed, self.steps = int(state["seed"]), int(state["steps"])

    @torch.no_grad()
    def _widen(self, optimizer, args, kwargs) -> None:
        state = optimizer.state
        # DCP's state-dict helpers fill an empty optimizer state by a step with zero gradients
        # at lr 0 (before loading the saved state over it): not a step of the run, not counted
        self._counted = bool(state) or any(bool(_local(p.grad).any()) for g in optimizer.param_groups
                                           for p in g["params"] if p.grad is not None)
        for group in optimizer.param_groups:
            params = group["params"]
            for i, p in enumerate(params):
                if p.grad is None or p.dtype == torch.float32:
                    continue
                saved = state.pop(p, {})
                w = p.detach().float()
                if COMPENSATION in saved:
                    w.add_(saved[COMPENSATION])
                w.grad = p.grad.float()
                state[w] = {k: v.float() if self._shaped_like(k, v, p) else v for k, v in saved.items()}
                self._working.append((p, w, params, i))
                params[i] = w

    @torch.no_grad()
    def _narrow(self, optimizer, args, kwargs) -> None:
        state = optimizer.state
        for n, (p, w, params, i) in enumerate(self._working):
            params[i] = p
            moved = state.pop(w, {})
            if self.method == "kahan":
                p.copy_(w)  # round to nearest, into the parameter's own storage
                compensation = w.sub_(p)  # exact in FP32: what the rounding dropped
                if COMPENSATION in moved:
                    moved[COMPENSATION].copy_(compensation)
                else:
                    moved[COMPENSATION] = compensation.to(p.dtype)
            else:
                key = torch.tensor(_key(self.seed, self.rank, self.steps, n), dtype=torch.int64)  # a host scalar
                _local(p).copy_(self._round(_local(w), key))
            state[p] = {k: v.to(p.dtype) if self._shaped_like(k, v, p) else v for k, v in moved.items()}
        self._working.clear()
        self.steps += self._counted

    def _round(self, x: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """stochastic_round_bf16, compiled into one kernel on x's device where that works."""
        kernel = self._kernels.get(x.device.type)
        if kernel is None:
            kernel = stochastic_round_bf16
            if self.compile is not False:
                try:
                    compiled = torch.compile(stochastic_round_bf16, dynamic=True)
                    compiled(x, key)  # compiles here, on this device
                    kernel = compiled
                except Exception as e:  # no C++ compiler or Triton, an unsupported platform, ...
                    if self.compile:
                        raise
                    logger.warning("stochastic rounding on %s runs eagerly (the same bits, slower): torch.compile "
                                   "failed: %s", x.device.type, str(e).splitlines()[0] if str(e) else type(e).__name__)
            self._kernels[x.device.type] = kernel
        return kernel(x, key)

    @staticmethod
    def _shaped_like(key: str, value, p: torch.Tensor) -> bool:
        return (key != COMPENSATION and torch.is_tensor(value) and value.is_floating_point()
                and value.shape == p.shape)

