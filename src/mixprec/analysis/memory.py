"""`mixprec memory`: per-device memory and per-step communication of a training setup.

Model state is counted parameter by parameter on a meta-device copy of the model (so
tied weights, GQA and the MLP width are exact). Activations are the tensors this
model's eager forward saves for backward, term by term (see `_block_activations`),
for the dtypes the policy produces: the residual stream in the storage dtype, matmuls
in param_dtype, norms, softmax and logits in FP32. Checked against PyTorch's
MemTracker on real CPU steps (tests/analysis/test_memory.py, benchmarks/memory_planner.py).

Per parameter, mixed-precision AdamW keeps 4 (FP32 weight) + 4 (FP32 gradient) + 8
(two FP32 moments) = 16 bytes of model state; master-weight modes keep a 2-byte model
weight and gradient, a 4-byte master and its 4-byte gradient, and 8 bytes of moments:
20 bytes, not the 16 some tables give. bf16-kahan keeps 2 + 2 + 4 (bfloat16 moments) +
2 (the compensation) = 10 bytes and bf16-sr 8; with 8-bit moments (precision.optimizer_states fp8
or 8bit: 1 byte and a 4-byte scale per 256 elements each) bf16-mixed-8bit keeps 4 + 4 + 2.03
and bf16-kahan-8bit 2 + 2 + 2 + 2.03, small tensors and embeddings at 8 bytes of moments; with an optimizer other than AdamW, the
step also makes FP32 working copies of the parameters, their gradients and states, for at
most CHUNK_NUMEL parameters at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from mixprec.distributed.tensor_parallel import PLAN as TP_PLAN
from mixprec.errors import UserError
from mixprec.narrow.fsdp.linear import copy_bytes, why_not
from mixprec.narrow.formats.recipe import FP8Recipe
from mixprec.models.llama import Llama, ModelArgs
from mixprec.models.loss import chunk_tokens
from mixprec.optim.updates import CHUNK_NUMEL
from mixprec.precision.layout import resolve
from mixprec.precision.optimizer_states import embeddings_of
from mixprec.precision.presets import FP32, PRESETS, resolve_preset_name
from mixprec.precision.spec import Override, PrecisionSpec, Update
from mixprec.train.parallelize import AC_MODES, checkpointed_blocks

OPTIMIZER_STATES = {"adamw": 2, "sgd": 1, "none": 0}  # state tensors per parameter (SGD: momentum)


@dataclass(frozen=True)
class Setup:
    args: ModelArgs
    preset: str | PrecisionSpec = "bf16-mixed"  # a preset's name or a spec
    batch: int = 4  # sequences per device and micro-batch
    seq_len: int = 256
    optimizer: str = "adamw"
    checkpointing: str = "none"
    dp_shard: int = 1
    dp_replicate: int = 1
    tp: int = 1
    reshard_after_forward: bool = True
    lowp_all_gather: bool = True  # FP8/microscaled weights all-gathered in their own format (mixprec.narrow.fsdp.linear)
    attention: str = "eager"  # or "sdpa": no (T, T) tensors saved
    loss: str = "full"  # or "chunked": model.loss, the full logits never exist
    bandwidth_gbps: float = 100.0  # per device, for the communication time
    overrides: tuple = ()  # per-module rules (precision.override) on top of the preset

    @property
    def spec(self) -> PrecisionSpec:
        from dataclasses import replace

        spec = self.preset if isinstance(self.preset, PrecisionSpec) else PRESETS[resolve_preset_name(self.preset,
                                                                                                       "--preset")]
        return replace(spec, overrides=spec.overrides + tuple(Override.parse(r) for r in self.overrides))

    def __post_init__(self):
        self.spec  # an unknown preset or a bad rule: one line
        for name, value, accepted in (("optimizer", self.optimizer, OPTIMIZER_STATES),
                                      ("checkpointing", self.checkpointing, AC_MODES),
                                      ("attention", self.attention, ("eager", "sdpa")),
                                      ("loss", self.loss, ("full", "chunked"))):
            if value not in accepted:
                raise UserError(f"--{name} {value!r} is not known; accepted: {', '.join(accepted)}")
        for name in ("batch", "seq_len", "dp_shard", "dp_replicate", "tp"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} {getattr(self, name)}: accepted: a positive integer")
        a = self.args
        for what, size in (("n_heads", a.n_heads), ("n_kv_heads", a.n_kv_heads), ("ffn width", a.ffn_dim)):
            if size % self.tp:
                raise UserError(f"--tp {self.tp} does not divide the model's {what} {size}; accepted: a divisor of "
                                f"n_heads {a.n_heads}, n_kv_heads {a.n_kv_heads} and ffn width {a.ffn_dim}")


def _block_activations(a: ModelArgs, B: int, T: int, c: int, r: int, n: int, casts: bool, tp: int,
                       sdpa: bool = False, fp8: float = 0.0) -> float:
    """Bytes one transformer block saves for backward. c: matmul dtype bytes; r: the
    residual stream's; n: the norm output's; casts: autocast copies each linear's input;
    fp8: the seven projections are low-precision Linears, each saving its own copy of its
    input at this many bytes an element (FP8 1; MXFP8 1 + 1/32, NVFP4 1/2 + 1/16 with the
    block scales); 0: they are not."""
    D, F, H = a.dim, a.ffn_dim // tp, a.n_heads // tp
    Dq, Dkv = H * a.head_dim, (a.n_kv_heads // tp) * a.head_dim  # this rank's heads
    BT = B * T
    norms = 2 * (4 + r) * BT * D  # each: its FP32 input and the normalised tensor
    # linear inputs: autocast makes a copy per call (wq, wk, wv; w1, w3); otherwise the
    # norm's output is saved once per norm
    inputs = 5 * fp8 * BT * D if fp8 else 5 * c * BT * D if casts else 2 * n * BT * D
    rope = (4 + c) * BT * Dq + 4 * BT * Dkv  # FP32 copies for the rotation, the rotated q
    kv = 2 * c * BT * Dq  # keys and values repeated to every query head
    if sdpa:  # the fused kernel saves its output and one FP32 log-sum-exp per row
        scores = c * BT * Dq + 4 * B * H * T
    else:  # the FP32 softmax output (and its cast back)
        scores = (4 + (c if c != 4 else 0)) * B * H * T * T
    q = fp8 if fp8 else c  # what wo and w2 keep of their inputs
    out = q * BT * Dq  # attention output, the input of wo
    mlp = (3 * c + q) * BT * F  # w1 out, silu out, w3 out, their product (w2's input)
    return norms + inputs + rope + kv + scores + out + mlp


def plan(s: Setup) -> dict:
    """Bytes per device of each kind of memory, the peak, and communication per step."""
    p = s.spec
    a = s.args
    with torch.device("meta"):
        model = Llama(a)
    sharded = s.dp_shard > 1
    layout = resolve(p, model, sharded=sharded).modules
    master = p.master_weights and not sharded  # under FSDP the sharded FP32 params are the masters
    storage = FP32 if p.master_weights and sharded else p.storage_dtype
    autocast = not sharded and (p.param_dtype != p.storage_dtype or p.master_weights)
    c, st = p.param_dtype.itemsize, storage.itemsize

    params = grads = masters = states = cast_cache = 0
    embeddings = {id(w) for w in embeddings_of(model)}  # the optimizer's rule for which moments stay FP32
    n_params = 0
    seen = set()
    for fqn, module in model.named_modules():
        for name, w in module.named_parameters(recurse=False):
            if id(w) in seen:
                continue
            seen.add(id(w))
            numel = w.numel()
            n_params += numel
            split = s.tp if fqn.startswith("layers.") and isinstance(module, torch.nn.Linear) else 1
            local = numel / split / s.dp_shard
            dtype_bytes = layout[fqn].storage.itemsize
            params += local * dtype_bytes
            grads += local * dtype_bytes
            if master and dtype_bytes != 4:
                masters += local * 4
                grads += local * 4  # the masters' FP32 gradients
            moments = p.moments  # AdamW's: a dense dtype, or 8 bits with a block scale per block_size
            if s.optimizer == "adamw" and moments.quantized:
                per = 4 if moments.keeps_fp32(numel, id(w) in embeddings, w.dim()) else \
                    moments.bytes_per_element(w.shape)
            else:
                per = moments.dtype.itemsize if s.optimizer == "adamw" else (4 if p.master_weights else st)
            states += local * OPTIMIZER_STATES[s.optimizer] * per
            if isinstance(module, torch.nn.Linear):
                # autocast keeps one low-precision copy of each weight from forward to backward;
                # an FP8 Linear keeps its 1-byte FP8 weight instead (with or without autocast), a microscaled one
                # its quantised weight where one copy serves forward and backward (NVFP4's 16x16 blocks)
                compute = layout[fqn].compute
                copy = (compute.saved_weight_bytes if isinstance(compute, FP8Recipe)
                        else compute.itemsize if autocast and compute != FP32 else 0)
                cast_cache += numel / split * copy
    # each block's share of projections in FP8 and in float32 (per-module overrides)
    fp8_share, fp32_share = [], []
    for i, block in enumerate(model.layers):
        rows = [(layout[f"layers.{i}.{n}"].compute, m.weight.numel()) for n, m in block.named_modules()
                if isinstance(m, torch.nn.Linear)]
        total = sum(n for _, n in rows)
        fp8_share.append(sum(n for f, n in rows if isinstance(f, FP8Recipe)) / total)
        fp32_share.append(sum(n for f, n in rows if f == FP32) / total if c != 4 else 0.0)
    block_params = sum(w.numel() for w in model.layers[0].parameters())
    recomputed = checkpointed_blocks(a.n_layers, s.checkpointing)
    # Bytes of one all-gather of each parameter: param_dtype, or a low-precision Linear's narrow copy
    gathered = {id(w): w.numel() / s.tp * c for w in model.parameters()}
    if sharded and s.lowp_all_gather:
        for fqn, module in model.named_modules():
            compute = layout[fqn].compute if fqn in layout else None
            if not isinstance(compute, FP8Recipe):
                continue
            block = int(fqn.split(".")[1]) if fqn.startswith("layers.") else None
            rows, cols = module.weight.shape
            split = next((style for name, style in TP_PLAN.items() if fqn.endswith(name)), None)
            rows = rows // s.tp if isinstance(split, ColwiseParallel) else rows
            cols = cols // s.tp if isinstance(split, RowwiseParallel) else cols
            if why_not(compute, (rows, cols), s.dp_shard, recomputes=block in recomputed,
                       reshards=s.reshard_after_forward if block is not None else False) is None:
                gathered[id(module.weight)] = copy_bytes(compute, rows, cols)
    unsharded = 0
    if sharded:  # all-gathered units: the current block and the prefetched next
        per_block = max(sum(gathered[id(w)] for w in block.parameters()) for block in model.layers)
        unsharded = (2 * per_block) if s.reshard_after_forward else (per_block * a.n_layers)

    B, T = s.batch, s.seq_len
    r = 4 if autocast and not p.master_weights else c if sharded else st  # the residual stream
    norm_w = 4 if master else (c if sharded else st)
    n = max(r, norm_w)
    sdpa = s.attention == "sdpa"
    saved_bytes = max((rc.saved_bytes for rc in {m.compute for m in layout.values()}
                       if isinstance(rc, FP8Recipe)), default=1.0)  # of the layout's recipes, the widest
    plain, in_fp8 = (_block_activations(a, B, T, c, r, n, autocast and n != c, s.tp, sdpa, f)
                     for f in (0.0, saved_bytes))
    wide = _block_activations(a, B, T, 4, r, n, False, s.tp, sdpa)  # float32 projections (overrides)
    # each block's activations, mixed by the share of its projections in each compute format
    blocks = [(1 - f8 - f32) * plain + f8 * in_fp8 + f32 * wide for f8, f32 in zip(fp8_share, fp32_share)]
    inputs = r * B * T * a.dim  # what a checkpointed block keeps: its input
    # Saved through the forward: each block's activations, or only its input where it
    # recomputes in backward (selective: every other block, 1, 3, 5, ...; full: all).
    saved = [inputs if i in recomputed else blocks[i] for i in range(a.n_layers)]
    layers = sum(saved)
    norm = (4 + r) * B * T * a.dim  # the final norm's FP32 input and output
    if s.loss == "chunked":
        # kept: the gradients of the hidden states and (FP32) of the output weight; while
        # one chunk runs: its logits (compute dtype), FP32 copy, log-probs, and gradient
        chunk = min(B * T, chunk_tokens(a.vocab_size))
        head = norm + n * B * T * a.dim + 4 * a.vocab_size * a.dim
        transient = chunk * a.vocab_size * (c + 4 + (4 if c != 4 else 0))
    else:
        head = norm + (c if autocast else n) * B * T * a.dim + 4 * B * T * a.vocab_size
        transient = 2 * 4 * B * T * a.vocab_size  # the backward's first tensors: d(log-probs), d(logits)
    activations = layers + head
    # The peak is at the loss (everything saved, plus the loss's temporaries), or, with
    # checkpointing, possibly in backward: block i recomputing its activations while the
    # blocks below it still hold theirs and the gradients above it exist.
    block_grads = grads * block_params / n_params  # one block's share of the gradient bytes
    other_grads = grads - a.n_layers * block_grads  # embeddings, final norm, output layer
    # An eager FP8 Linear's backward widens its operands to FP32 to cast them (the gradient,
    # and for row- and block-wise the dequantised input): two or three FP32 copies of the
    # widest projection's activations (measured on the debug flavor; Inductor fuses them away).
    recipes = {m.compute for m in layout.values() if isinstance(m.compute, FP8Recipe)}
    widenings = max((rc.backward_fp32_copies for rc in recipes), default=0)
    fp8_backward = widenings * 4 * B * T * max(a.dim, a.ffn_dim // s.tp)
    # (without checkpointing, each block's backward: its FP8 widenings on top of what the blocks below still hold)
    backward = max((sum(saved[:i]) + blocks[i] + (a.n_layers - i) * block_grads + other_grads
                    + (fp8_backward if fp8_share[i] else 0) for i in recomputed or range(a.n_layers)), default=0)
    working = max(head + transient, backward - layers)

    peak = params + states + masters + cast_cache + unsharded + layers + working
    compensation = working_copies = 0
    if p.update is not Update.NEAREST:  # mixprec.optim.updates
        compensation = params if p.update is Update.KAHAN else 0
        peak += compensation  # held all the time, like the moments
        if s.optimizer != "adamw":  # the generic path: the step runs on FP32 copies, a chunk at a time,
            # after backward freed the activations (AdamW's fused kernel needs none)
            widened = min(params / st, CHUNK_NUMEL)
            working_copies = widened * 4 * (2 + OPTIMIZER_STATES[s.optimizer])
            peak = max(peak, params + grads + states + compensation + working_copies)
    # Communication per step, per device, ring algorithms: all-gather and reduce-scatter
    # move (n-1)/n of the full size, all-reduce twice that.
    comm = {"all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": 0.0}
    full_params = n_params / s.tp  # this tensor-parallel rank's slice of the model
    if sharded:
        frac = (s.dp_shard - 1) / s.dp_shard
        gathers = 2 if s.reshard_after_forward else 1  # again in backward after a reshard
        comm["all_gather"] = gathers * sum(gathered.values()) * frac
        comm["reduce_scatter"] = full_params * 4 * frac
    if s.dp_replicate > 1:
        size = full_params * 4 / s.dp_shard
        comm["all_reduce"] += 2 * size * (s.dp_replicate - 1) / s.dp_replicate
    if s.tp > 1:  # two all-reduces of the activations per block in forward, two in backward
        comm["all_reduce"] += 4 * a.n_layers * 2 * B * T * a.dim * c * (s.tp - 1) / s.tp
    total = sum(comm.values())
    return {
        "parameters": n_params,
        "bytes": {"parameters": params, "gradients": grads, "optimizer_states": states, "master_weights": masters,
                  "compensation": compensation, "update_working_copies": working_copies,
                  "autocast_weight_copies": cast_cache, "unsharded_parameters": unsharded,
                  "activations": activations, "peak": peak},
        "model_state_bytes_per_parameter": (params + grads + states + masters + compensation) * s.dp_shard * s.tp / n_params,
        "optimizer_state_bytes_per_parameter": states * s.dp_shard * s.tp / n_params,
        "communication_bytes": {**comm, "total": total},
        "communication_seconds": total / (s.bandwidth_gbps * 1e9),
    }
