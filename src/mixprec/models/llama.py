"""A Llama-style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention.

Shapes: B batch, T sequence, D model dim, H query heads, K key/value heads,
hd head dim, F feed-forward dim, V vocabulary.

Precision contract (checked by tests/precision/test_op_dtypes.py):
- RMSNorm, softmax and RoPE compute in FP32 whatever the input dtype;
- the logits are upcast to FP32 before the loss;
- everything else runs in the dtype of its inputs (or autocast's).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.errors import UserError
from mixprec.models.loss import chunked_cross_entropy
from mixprec.models.moe import MoE, aux_loss, moe_layers
from mixprec.models.ties import retie, tie_pairs


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 512
    n_layers: int = 8
    n_heads: int = 8
    n_kv_heads: int = 4  # < n_heads: grouped-query attention
    vocab_size: int = 256
    multiple_of: int = 256  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    attention: str = "eager"  # or "sdpa": F.scaled_dot_product_attention, fused, no (T, T) tensors kept
    loss_chunk: int = 0  # tokens per chunk of the output projection and loss; 0: the full logits at once
    hidden_dim: int | None = None  # the SwiGLU hidden size as given (a pretrained model's); None: Llama's rule
    # Mixture of experts (mixprec.models.moe); n_experts 0: every block has the dense SwiGLU
    n_experts: int = 0  # routed experts per MoE block
    top_k: int = 0  # routed experts each token goes through
    moe_hidden_dim: int = 0  # each expert's SwiGLU hidden size
    n_shared_experts: int = 0  # experts every token goes through (one SwiGLU of n times the hidden size)
    n_dense_layers: int = 0  # the first blocks keep the dense SwiGLU (DeepSeek's first_k_dense_replace)
    route_scale: float = 1.0  # the routed experts' weights are scaled by it (DeepSeek's routed_scaling_factor)
    balance: str = "bias"  # "bias": auxiliary-loss-free (a per-expert bias), "aux": the auxiliary loss
    balance_rate: float = 1e-3  # the bias's step after each optimizer step (DeepSeek-V3: 0.001)
    aux_loss_coeff: float = 1e-2  # the auxiliary loss's weight, balance "aux" (Switch Transformer: 0.01)

    # How the model computes or trains, not what it is: a checkpoint resumes under other values.
    RUNTIME_FIELDS = ("attention", "loss_chunk", "balance", "balance_rate", "aux_loss_coeff")

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise UserError(f"model: dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise UserError(
                f"model: n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}"
            )
        if (self.dim // self.n_heads) % 2:
            raise UserError(f"model: head dim {self.dim // self.n_heads} must be even for RoPE")
        if self.balance not in ("bias", "aux"):
            raise UserError(f"model.balance: {self.balance!r} is not a balancing; accepted: bias (DeepSeek-V3's "
                            "auxiliary-loss-free), aux (the auxiliary loss)")
        if self.n_experts and not (0 < self.top_k <= self.n_experts and self.moe_hidden_dim > 0):
            raise UserError(f"model: {self.n_experts} experts need 0 < top_k <= n_experts and moe_hidden_dim > 0 "
                            f"(top_k {self.top_k}, moe_hidden_dim {self.moe_hidden_dim})")

    def moe_block(self, layer: int) -> bool:
        """Whether block `layer` has the mixture of experts (else the dense SwiGLU)."""
        return self.n_experts > 0 and layer >= self.n_dense_layers

    def architecture(self) -> dict:
        """What a checkpoint records of the model (hidden_dim only where given, the MoE fields only for
        an MoE: older checkpoints lack them)."""
        moe = ("top_k", "moe_hidden_dim", "n_shared_experts", "n_dense_layers", "route_scale")
        return {k: v for k, v in asdict(self).items()
                if k not in self.RUNTIME_FIELDS and not (k == "hidden_dim" and v is None)
                and not (k in moe + ("n_experts",) and not self.n_experts)}

    @classmethod
    def from_architecture(cls, fields: dict) -> "ModelArgs":
        """The shape a checkpoint recorded (its other entries, such as the tokenizer, ignored)."""
        return cls(**{k: v for k, v in fields.items() if k in cls.__dataclass_fields__})

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_dim(self) -> int:
        if self.hidden_dim is not None:
            return self.hidden_dim
        # Llama's rule: 2/3 of 4*dim, times an optional multiplier, rounded up.
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


# vocab_size None: taken from the tokenizer. The Llama-3 shapes keep their
# 128256-token vocabulary so that parameter and memory counts are the real ones.
FLAVORS: dict[str, dict] = {
    "debug": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=512),
    "small": dict(dim=512, n_layers=10, n_heads=8, n_kv_heads=4, multiple_of=256),
    "1B": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
               ffn_dim_multiplier=1.5, multiple_of=256, rope_theta=500000.0,
               max_seq_len=8192, tie_embeddings=True),
    "8B": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
               ffn_dim_multiplier=1.3, multiple_of=1024, rope_theta=500000.0, max_seq_len=8192),
    "70B": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
                ffn_dim_multiplier=1.3, multiple_of=4096, rope_theta=500000.0, max_seq_len=8192),
    # Mixtures of experts, DeepSeek-V3's design (mixprec.models.moe): sigmoid routing, shared experts
    "moe-debug": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=512,
                      n_experts=8, top_k=2, moe_hidden_dim=32, n_shared_experts=1),
    "moe-small": dict(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, multiple_of=256,
                      n_experts=16, top_k=4, moe_hidden_dim=256, n_shared_experts=1, n_dense_layers=1),
    # DeepSeek-V2-Lite's shape (15.8B parameters, 2.7B active a token) with grouped-query attention in place of
    # its latent attention: 64 routed experts, 6 a token, 2 shared, the first block dense
    "moe-16B": dict(dim=2048, n_layers=27, n_heads=16, n_kv_heads=16, vocab_size=102400, hidden_dim=10944,
                    rope_theta=10000.0, max_seq_len=4096, n_experts=64, top_k=6, moe_hidden_dim=1408,
                    n_shared_experts=2, n_dense_layers=1),
}


def resolve_attention(mode: str, device_type: str) -> str:
    """model.attention: auto is sdpa on CUDA, where the fused kernels win, and eager on a
    CPU, whose fused BF16 backward measured slower than eager."""
    if mode != "auto":
        return mode
    return "sdpa" if device_type == "cuda" else "eager"


def model_args(flavor: str, vocab_size: int, **overrides) -> ModelArgs:
    """The flavor's shape; the tokenizer's vocab unless the flavor fixes its own."""
    if flavor not in FLAVORS:
        raise UserError(f"model.flavor: unknown flavor {flavor!r}; accepted: {', '.join(FLAVORS)}")
    fields = dict(FLAVORS[flavor])
    if fields.setdefault("vocab_size", vocab_size) < vocab_size:
        raise UserError(
            f"model.flavor {flavor!r} has {fields['vocab_size']} token ids, "
            f"the tokenizer needs {vocab_size}"
        )
    return replace(ModelArgs(**fields), **overrides)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Computed in FP32: the mean of squares of a BF16 activation loses the
        # small components (bf16 has 8 bits of mantissa).
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(seq_len: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (T, hd/2), always FP32: positions up to 8192 need more than
    bf16's 8 mantissa bits (position 257 * freq would round to 256 * freq)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, T, heads, hd), rotated as pairs (x[2i], x[2i+1]) in FP32.
    x32 = x.float().unflatten(-1, (-1, 2))
    x1, x2 = x32[..., 0], x32[..., 1]  # (B, T, heads, hd/2)
    cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, hd/2)
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.sdpa = args.attention == "sdpa"
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: under tensor parallel each rank holds n_heads / degree of them
        q = self.wq(x).view(B, T, -1, self.head_dim)
        k = self.wk(x).view(B, T, -1, self.head_dim)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Grouped-query attention: each key/value head serves n_heads / n_kv_heads query heads.
        repeats = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(repeats, dim=2), v.repeat_interleave(repeats, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, hd)
        if self.sdpa:  # the fused kernels accumulate the softmax of BF16/FP16 inputs in FP32
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
            return self.wo(out)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # (B, H, T, T)
        # Softmax in FP32: exp() of BF16 scores overflows or rounds the small
        # probabilities away; autocast on CPU would leave it in BF16.
        probs = F.softmax(scores.float().masked_fill(mask, float("-inf")), dim=-1).type_as(q)
        out = (probs @ v).transpose(1, 2).reshape(B, T, -1)  # (B, T, H*hd)
        return self.wo(out)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # SwiGLU: (B, T, F) -> (B, T, D)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = MoE(args) if args.moe_block(layer) else FeedForward(args)
        self.checkpointed = False  # activation checkpointing: keep only the input, recompute in backward

    def forward(self, x, cos, sin, mask):
        if self.checkpointed and torch.is_grad_enabled():
            # non-reentrant: works under autocast, FSDP2 and torch.compile, and restores the RNG state; an
            # expert-parallel layer's dispatch is recorded in the forward and replayed in the recompute (its
            # exchanges, host read and all-to-alls once a step, as TorchTitan saves the all-to-alls' outputs)
            ep = getattr(getattr(self.feed_forward, "experts", None), "ep", None)
            replay = {"context_fn": ep.recompute_contexts} if ep is not None else {}
            return torch.utils.checkpoint.checkpoint(self._forward, x, cos, sin, mask, use_reentrant=False, **replay)
        return self._forward(x, cos, sin, mask)

    def _forward(self, x, cos, sin, mask):
        h = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Output(nn.Linear):
    """The output projection, and the loss when targets are given. The loss lives in this
    module's forward so that FSDP2's hooks on it (all-gather, reshard) see the call."""

    def __init__(self, args: ModelArgs):
        super().__init__(args.dim, args.vocab_size, bias=False)
        self.loss_chunk = args.loss_chunk

    def forward(self, h: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        # h (B, T, D) -> FP32 logits (B, T, V), or the mean loss over B*T tokens
        if targets is not None and self.loss_chunk:
            return chunked_cross_entropy(h.flatten(0, 1), self.weight, targets.flatten(), self.loss_chunk)
        logits = super().forward(h).float()  # upcast before the loss: log-softmax of BF16 logits is coarse
        return logits if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Llama(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = Output(args)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, T) int64 -> logits (B, T, V) in FP32, or the mean loss when targets are given."""
        T = tokens.shape[1]
        if T > self.args.max_seq_len:
            raise UserError(f"sequence length {T} exceeds the model's max_seq_len {self.args.max_seq_len}")
        cos, sin = rope_tables(T, self.args.head_dim, self.args.rope_theta, tokens.device)
        mask = torch.ones(T, T, dtype=torch.bool, device=tokens.device).triu(1)  # True above the diagonal
        h = self.tok_embeddings(tokens)  # (B, T, D)
        for layer in self.layers:
            h = layer(h, cos, sin, mask)
        loss = self.output(self.norm(h), targets)
        if targets is not None and self.args.balance == "aux" and torch.is_grad_enabled():
            blocks = [layer.feed_forward for layer in self.layers if isinstance(layer.feed_forward, MoE)]
            aux = aux_loss(blocks, self.args.aux_loss_coeff)  # the MoE blocks' balancing loss, training only
            loss = loss if aux is None else loss + aux
        return loss

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Normal(0, 0.02) weights, output projections scaled by 1/sqrt(2 * n_layers) (GPT-2),
        norms at one. Values are drawn in FP32 and then stored, so every storage dtype
        starts from the same weights (rounded)."""
        gen = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.args.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            std = residual_std if name.endswith(("wo.weight", "w2.weight", "down_proj")) else 0.02
            p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=gen))
        for layer in moe_layers(self):
            layer.router.reset()

    def num_params(self, exclude_embedding: bool = False, active: bool = False) -> int:
        """Parameters; active: those one token computes with (top_k of each block's routed experts)."""
        n = sum(p.numel() for p in self.parameters())
        if active and self.args.n_experts:
            routed = sum(p.numel() for name, p in self.named_parameters() if ".experts." in name)
            n -= routed - routed * self.args.top_k // self.args.n_experts
        return n - self.tok_embeddings.weight.numel() if exclude_embedding else n

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 per non-embedding parameter it computes with (an MoE's active
        ones) plus attention's score and value matmuls (PaLM appendix B)."""
        a = self.args
        return 6 * self.num_params(exclude_embedding=True, active=True) + 12 * a.n_layers * a.n_heads * a.head_dim * seq_len


def construct(args: ModelArgs, storage_dtype: torch.dtype) -> Llama:
    """The model in the storage dtype on the default device, not initialised (the memory planner
    builds it so under FakeTensorMode)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(storage_dtype)
    try:
        return Llama(args)
    finally:
        torch.set_default_dtype(previous)


def build_model(args: ModelArgs, *, device: torch.device | str, storage_dtype: torch.dtype,
                seed: int | None) -> Llama:
    """Build on the meta device under the storage dtype (no memory touched), then
    materialise on `device` and initialise. seed None: left on the meta device, for weights
    that come from a checkpoint (`mixprec.interop.load`: sharded first, then materialised)."""
    with torch.device("meta"):
        model = construct(args, storage_dtype)
    if seed is None:
        return model
    tied = tie_pairs(model)
    model.to_empty(device=device)
    retie(model, tied)  # to_empty makes one tensor per module
    model.init_weights(seed)
    return model
