"""BFloat16 weights without FP32 master copies: compensated (Kahan) and stochastically
rounded updates around any torch optimizer.

A bfloat16 weight keeps 8 significant bits, so an update smaller than 2^-9 of the
weight rounds away (1 + 2^-9 == 1) and training in pure bfloat16 stalls. Two cures,
neither needing a 4-byte master copy:

- kahan: a compensation buffer per parameter (in the parameter's dtype) carries what the
  last rounding dropped; the weight the optimizer steps is weight + compensation (16
  significant bits), and after the step weight = round(w32), compensation = w32 - weight.
- stochastic: the stepped weight rounds up or down to a neighbouring bfloat16 value with
  probability proportional to its distance (mixprec.rounding), so the rounding is
  unbiased on average and small updates survive in expectation.

Two paths, chosen once and logged:

- torch.optim.AdamW: its update is computed by mixprec.optim.fused_adamw, one compiled
  kernel per parameter that reads bfloat16 and writes bfloat16 (FP32 only in registers).
- any other optimizer: the step pre-hook swaps, in the optimizer's param groups, each
  low-precision parameter for an FP32 working copy carrying the FP32 gradient and the
  widened state; the optimizer's own foreach or fused kernel steps those; the post-hook
  rounds each result into the parameter's own storage and narrows the state back. The
  working copies exist only during the step, and BF16Updates.step (which Policy.step
  calls) makes them for at most `chunk_numel` elements at a time.

Either way, between steps the optimizer holds its own parameters, keyed as always, so
state_dict, DCP and FSDP2's sharded state dicts see nothing unusual; the compensation is
one more state entry, shaped, sharded and saved like the parameter, and the optimizer
state (moments included) stays in the parameter's dtype. Both paths write into the
parameters' own storage, so FSDP2's shards keep their views.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from mixprec.optim import fused_adamw
from mixprec.rounding import compile_options, compiled_nearest_unsafe, rounding_key, stochastic_round_bf16

logger = logging.getLogger(__name__)

METHODS = ("kahan", "stochastic")
CHUNK_NUMEL = 2**26  # generic path: parameter elements widened at a time (1 GiB of FP32 copies with Adam)
COMPENSATION = "kahan_compensation"  # the optimizer-state key of the Kahan buffer
FP32 = torch.float32


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or a plain tensor's detached view (either writes through to
    the storage). Not an nn.Parameter: torch.compile keeps a Parameter's shape static, and
    through duck sizing the shapes of the tensors beside it, compiling once per shape."""
    return t.to_local() if hasattr(t, "device_mesh") else t.detach()


class BF16Updates:
    """Kahan-compensated or stochastically rounded updates of the optimizer's bfloat16
    (or, for kahan, any low-precision) parameters; FP32 parameters step as they are.

        optimizer = torch.optim.AdamW(model.parameters())  # model in bfloat16
        updates = BF16Updates(optimizer, "kahan")
        ... loss.backward(); updates.step() (or optimizer.step()) ...

    `compile`: run the kernels compiled by Inductor (None: where they compile; otherwise,
    logged, eagerly: the same bits for the rounding, several times slower on a CPU).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, method: str, *, seed: int = 0, compile: bool | None = None,
                 chunk_numel: int = CHUNK_NUMEL):
        if method not in METHODS:
            raise ValueError(f"method {method!r}: accepted {', '.join(METHODS)}")
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if method == "stochastic":
            odd = {p.dtype for p in params} - {torch.bfloat16, FP32}
            if odd:
                raise ValueError(f"stochastic rounding is to bfloat16; these parameters are {', '.join(map(str, odd))}")
        self.optimizer, self.method, self.seed, self.chunk_numel = optimizer, method, seed, chunk_numel
        self.steps = 0  # optimizer steps taken: part of the stochastic rounding's key
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.compile = compile
        self._index = {id(p): i for i, p in enumerate(params)}  # a parameter's part of the key
        self._kernels = {}  # (function, device type, emulated casts) -> the kernel chosen there
        self._counted, self._chunking = True, False
        self._working: list[tuple[torch.Tensor, torch.Tensor, list, int]] = []  # generic path
        self._held: list[tuple[dict, list, list]] = []  # fused path: (group, its params, the ones stepped here)
        reason = fused_adamw.unsupported(optimizer)
        self.fused = reason is None
        if self.fused:
            logger.info("%s updates: AdamW's arithmetic in one kernel per parameter (float32 in registers, "
                        "%s in memory)", method, _dtype_names(params))
        else:
            logger.info("%s updates: %s, so its own step runs on float32 working copies (%d elements at a time), "
                        "rounded back after", method, reason, chunk_numel)
        self._hooks = [optimizer.register_step_pre_hook(self._before), optimizer.register_step_post_hook(self._after)]

    def remove(self) -> None:
        """Detach from the optimizer (its later steps are plain low-precision steps)."""
        for h in self._hooks:
            h.remove()

    def step(self) -> None:
        """optimizer.step(). On the generic path, over chunks of the parameters that have
        gradients, at most chunk_numel elements each (a larger parameter alone), so that
        the FP32 working copies stay within 16 bytes x chunk_numel with Adam; the
        optimizer's step hooks then run once per chunk."""
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
        if self.fused or len(chunks) == 1:
            self.optimizer.step()
            return
        self._chunking = True
        try:
            for chunk in chunks:
                for group, params in zip(groups, chunk):
                    group["params"] = params
                self.optimizer.step()
        finally:
            self._chunking = False
            for group, params in zip(groups, full):
                group["params"] = params
        self.steps += self._counted

    def state_dict(self) -> dict:
        return {"method": self.method, "seed": self.seed, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        if state["method"] != self.method:
            raise ValueError(f"state of {state['method']} updates loaded into {self.method} updates")
        self.seed, self.steps = int(state["seed"]), int(state["steps"])

    # ---- the step hooks ----------------------------------------------------------------------
    @torch.no_grad()
    def _before(self, optimizer, args, kwargs) -> None:
        state = optimizer.state
        # DCP's state-dict helpers fill an empty optimizer state by a step with zero gradients
        # at lr 0 (before loading the saved state over it): not a step of the run, not counted
        # (told by its learning rates on the host: the gradients would cost a device read)
        self._counted = bool(state) or any(g["lr"] != 0 for g in optimizer.param_groups)
        for group in optimizer.param_groups:
            params = group["params"]
            if self.fused:  # the optimizer's own step sees only the rest; _after steps these
                mine = [p for p in params if p.grad is not None and p.dtype != FP32]
                self._held.append((group, params, mine))
                taken = {id(p) for p in mine}
                group["params"] = [p for p in params if id(p) not in taken]
                continue
            for i, p in enumerate(params):
                if p.grad is None or p.dtype == FP32:
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
    def _after(self, optimizer, args, kwargs) -> None:
        if self.fused:
            self._fused_steps(optimizer)
        else:
            self._narrow(optimizer)
        if not self._chunking:
            self.steps += self._counted

    def _narrow(self, optimizer) -> None:
        state = optimizer.state
        for p, w, params, i in self._working:
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
                _local(p).copy_(self._kernel(stochastic_round_bf16, _local(w), self._key(p)))
            state[p] = {k: v.to(p.dtype) if self._shaped_like(k, v, p) else v for k, v in moved.items()}
        self._working.clear()

    def _fused_steps(self, optimizer) -> None:
        """Each held parameter's kernel, skipped on the device where `optimizer.found_inf`
        (set by Policy.step, as for torch's fused AdamW) is 1: the step counts live on the
        parameters' device and count only the steps taken."""
        found_inf = getattr(optimizer, "found_inf", None)
        for group, params, mine in self._held:
            group["params"] = params
            if not mine:
                continue
            for p in mine:
                state = optimizer.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if self.method == "kahan":
                        state[COMPENSATION] = torch.zeros_like(p, memory_format=torch.preserve_format)
            device = _local(mine[0]).device
            skip = found_inf.to(device) if found_inf is not None else torch.zeros((), device=device)
            all_scalars = fused_adamw.device_steps(group, [optimizer.state[p] for p in mine],
                                                   [_local(p).device for p in mine], skip)
            for p, scalars in zip(mine, all_scalars):
                state = optimizer.state[p]
                tensors = [_local(t) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])]
                if self.method == "kahan":
                    self._kernel(fused_adamw.adamw_kahan_, tensors[0], _local(state[COMPENSATION]), *tensors[1:],
                                 skip, *scalars)
                else:
                    self._kernel(fused_adamw.adamw_stochastic_, *tensors, self._key(p), skip, *scalars)
        self._held.clear()

    # ---- helpers -----------------------------------------------------------------------------
    def _key(self, p: torch.Tensor) -> torch.Tensor:
        """The stochastic rounding's key for `p` in this step, a host scalar."""
        return torch.tensor(rounding_key(self.seed, self.rank, self.steps, self._index.get(id(p), -1)),
                            dtype=torch.int32)

    def _kernel(self, fn, x: torch.Tensor, *args):
        """fn(x, *args), compiled into one kernel on x's device where that works."""
        options = compile_options(x.dtype)
        key = (fn, x.device.type, options["emulate_precision_casts"])
        kernel = self._kernels.get(key)
        if kernel is None:
            kernel = fn
            # only the Kahan kernel rounds to nearest by Veltkamp's split (stochastic rounding works on the bits)
            unsafe = (compiled_nearest_unsafe(x.device)
                      if fn is fused_adamw.adamw_kahan_ and x.dtype == torch.bfloat16 else None)
            if self.compile is not False and unsafe is not None:
                if self.compile:
                    raise RuntimeError(f"{fn.__name__} cannot be compiled exactly here: {unsafe}")
                logger.warning("%s on %s runs eagerly (the same arithmetic, slower): %s", fn.__name__,
                               x.device.type, unsafe)
            elif self.compile is not False:
                logger.info("compiling %s for %s (once per process; seconds on a CPU)", fn.__name__, x.device.type)
                compiled = torch.compile(fn, dynamic=True, options=options)
                try:
                    out = compiled(x, *args)  # compiles here, on this device
                    self._kernels[key] = compiled
                    return out
                except Exception as e:  # no C++ compiler or Triton, an unsupported platform, ...
                    if self.compile:
                        raise
                    logger.warning("%s on %s runs eagerly (the same arithmetic, slower): torch.compile failed: %s",
                                   fn.__name__, x.device.type, str(e).splitlines()[0] if str(e) else type(e).__name__)
            self._kernels[key] = kernel
        return kernel(x, *args)

    @staticmethod
    def _shaped_like(key: str, value, p: torch.Tensor) -> bool:
        return (key != COMPENSATION and torch.is_tensor(value) and value.is_floating_point()
                and value.shape == p.shape)


def _dtype_names(params) -> str:
    return ", ".join(sorted(str(d).replace("torch.", "") for d in {p.dtype for p in params} - {FP32}))
