"""The state-dict adapters (mixprec.interop.interfaces.StateDictAdapter): one per
architecture, between mixprec's parameter names and layouts and a Hugging Face folder's,
used by the initial load and by export alike.

    adapter = adapter_for(model)                  # mixprec's Llama, or a transformers model
    adapter.hf_name("layers.0.attention.wq.weight")       # model.layers.0.self_attn.q_proj.weight
    adapter.to_hf(name, tensor)                   # the tensor as the folder stores it
    adapter.read(name, folder.read, rows)         # rows of a parameter, read from the folder's layout
    adapter.hf_config("bfloat16")                 # config.json

mixprec's Llama rotates the pairs (x[2i], x[2i+1]) of each head by RoPE's i-th frequency;
Hugging Face's Llama rotates (x[i], x[i + hd/2]) (`rotate_half`). The two compute the same
attention once the rows of each q and k head are reordered: mixprec's row 2i + c of a head
is Hugging Face's row i + c * hd/2.
"""

from __future__ import annotations

import math
import re

import torch

from mixprec.errors import UserError
from mixprec.interop.interfaces import StateDictAdapter

# mixprec Llama name -> Hugging Face Llama name ({i}: the layer)
_LLAMA = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "layers.{i}.attention.wq.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "layers.{i}.attention.wk.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "layers.{i}.attention.wv.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.attention.wo.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.feed_forward.w1.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "layers.{i}.feed_forward.w3.weight": "model.layers.{i}.mlp.up_proj.weight",
    "layers.{i}.feed_forward.w2.weight": "model.layers.{i}.mlp.down_proj.weight",
    "layers.{i}.attention_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
}
# a mixture-of-experts block's feed-forward (mixprec.models.moe) -> transformers' Glm4Moe, DeepSeek-V3's MoE
# (sigmoid router, e_score_correction_bias, shared experts) beside Llama's attention; the experts fused as
# transformers holds them in memory (gate_up_proj (E, 2I, D), gate first; down_proj (E, D, I))
_MOE = {
    "layers.{i}.feed_forward.router.weight": "model.layers.{i}.mlp.gate.weight",
    "layers.{i}.feed_forward.router.bias": "model.layers.{i}.mlp.gate.e_score_correction_bias",
    "layers.{i}.feed_forward.experts.gate_up_proj": "model.layers.{i}.mlp.experts.gate_up_proj",
    "layers.{i}.feed_forward.experts.down_proj": "model.layers.{i}.mlp.experts.down_proj",
    "layers.{i}.feed_forward.shared.w1.weight": "model.layers.{i}.mlp.shared_experts.gate_proj.weight",
    "layers.{i}.feed_forward.shared.w3.weight": "model.layers.{i}.mlp.shared_experts.up_proj.weight",
    "layers.{i}.feed_forward.shared.w2.weight": "model.layers.{i}.mlp.shared_experts.down_proj.weight",
}
_LAYER = re.compile(r"layers\.(\d+)\.")


def _halves_to_pairs(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    # (heads * hd, D) rows [x_0..x_{hd/2-1}, y_0..] per head -> [x_0, y_0, x_1, y_1, ...]
    return w.unflatten(0, (-1, 2, head_dim // 2)).transpose(1, 2).flatten(0, 2)


def _pairs_to_halves(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    return w.unflatten(0, (-1, head_dim // 2, 2)).transpose(1, 2).flatten(0, 2)


class LlamaAdapter:
    """mixprec's Llama <-> transformers' LlamaForCausalLM; its mixture-of-experts flavors <->
    Glm4MoeForCausalLM (DeepSeek-V3's MoE with Llama's attention: the closest transformers has)."""

    def __init__(self, args):
        self.args = args
        self.names = {}
        for ours, theirs in _LLAMA.items():
            for i in range(args.n_layers) if "{i}" in ours else [None]:
                if i is None or not (args.moe_block(i) and ".feed_forward." in ours):
                    self.names[ours.format(i=i)] = theirs.format(i=i)
        for ours, theirs in _MOE.items():
            for i in filter(args.moe_block, range(args.n_layers)):
                if args.n_shared_experts or ".shared." not in ours:
                    self.names[ours.format(i=i)] = theirs.format(i=i)

    def hf_name(self, name: str) -> str:
        if name not in self.names:
            raise KeyError(name)
        return self.names[name]

    def _rotated(self, name: str) -> bool:
        return name.endswith(("attention.wq.weight", "attention.wk.weight"))

    def to_hf(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return _pairs_to_halves(tensor, self.args.head_dim) if self._rotated(name) else tensor

    def read(self, name: str, read, rows: slice | None = None) -> torch.Tensor:
        """Parameter `name` (or its `rows`) from a folder's `read(hf_name, rows)`. A rotated q/k
        row range is read as the whole heads that cover it, reordered, then cut."""
        hf = self.hf_name(name)
        if not self._rotated(name):
            return read(hf, rows)
        hd = self.args.head_dim
        if rows is None:
            return _halves_to_pairs(read(hf, None), hd)
        first = rows.start // hd
        heads = _halves_to_pairs(read(hf, slice(first * hd, math.ceil(rows.stop / hd) * hd)), hd)
        return heads[rows.start - first * hd: rows.stop - first * hd]

    def hf_config(self, dtype: str) -> dict:
        a = self.args
        decoder = {"hidden_size": a.dim, "intermediate_size": a.ffn_dim, "num_hidden_layers": a.n_layers,
                   "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads, "head_dim": a.head_dim,
                   "vocab_size": a.vocab_size, "rms_norm_eps": a.norm_eps, "max_position_embeddings": a.max_seq_len,
                   "tie_word_embeddings": a.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
                   "initializer_range": 0.02, "torch_dtype": dtype}
        if not a.n_experts:
            return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **decoder,
                    "rope_theta": a.rope_theta, "rope_scaling": None, "mlp_bias": False}
        # transformers' Glm4Moe computing what mixprec's MoE does: full rotary, no q/k norm, one expert group
        # (plain top-k), the top-k weights normalised then scaled
        return {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", **decoder,
                "moe_intermediate_size": a.moe_hidden_dim, "n_routed_experts": a.n_experts,
                "num_experts_per_tok": a.top_k, "n_shared_experts": a.n_shared_experts,
                "first_k_dense_replace": a.n_dense_layers, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
                "routed_scaling_factor": a.route_scale, "partial_rotary_factor": 1.0, "use_qk_norm": False,
                "rope_parameters": {"rope_type": "default", "rope_theta": a.rope_theta, "partial_rotary_factor": 1.0}}


def llama_fields(config: dict, where: str) -> dict:
    """ModelArgs fields of a Hugging Face Llama config.json; one line for what mixprec's Llama
    does not compute (biases, RoPE scaling, another activation or head size)."""
    c = config
    if c.get("model_type") != "llama":
        raise UserError(f"{where}: model_type {c.get('model_type')!r} is not a Llama; accepted: model_type llama "
                        "for mixprec's own Llama, or model.hf_config set to the folder to train it as a transformers "
                        "model (qwen2, gpt2, mistral, ...)")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    unsupported = [(c.get("attention_bias") or c.get("mlp_bias"), "biases"),
                   (c.get("hidden_act", "silu") != "silu", f"hidden_act {c.get('hidden_act')}"),
                   (rope.get("rope_type", rope.get("type", "default")) != "default",
                    f"RoPE scaling {rope.get('rope_type', rope.get('type'))}"),
                   (c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
                    != c["hidden_size"] // c["num_attention_heads"], f"head_dim {c.get('head_dim')}")]
    for bad, what in unsupported:
        if bad:
            raise UserError(f"{where}: this Llama has {what}, which mixprec's Llama does not compute; accepted: set "
                            "model.hf_config to the same folder to train it as a transformers model")
    return dict(dim=c["hidden_size"], n_layers=c["num_hidden_layers"], n_heads=c["num_attention_heads"],
                n_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"], vocab_size=c["vocab_size"],
                hidden_dim=c["intermediate_size"], norm_eps=c.get("rms_norm_eps", 1e-6),
                rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
                max_seq_len=c.get("max_position_embeddings", 2048),
                tie_embeddings=bool(c.get("tie_word_embeddings", False)))


class HFAdapter:
    """A transformers model trained by mixprec (`HFCausalLM`): the same names under `hf.`, the
    same layouts. `fields`: its config.json's fields (a checkpoint's meta keeps them)."""

    def __init__(self, fields: dict):
        self.fields = fields

    def hf_name(self, name: str) -> str:
        if not name.startswith("hf."):
            raise KeyError(name)
        return name.removeprefix("hf.")

    def to_hf(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def read(self, name: str, read, rows: slice | None = None) -> torch.Tensor:
        return read(self.hf_name(name), rows)

    def hf_config(self, dtype: str) -> dict:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        return {**self.fields, "architectures": [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[self.fields["model_type"]]],
                "torch_dtype": dtype}


def adapter_for(model: torch.nn.Module, fields: dict | None = None) -> StateDictAdapter:
    """The model's adapter; `fields`: a transformers model's config.json fields as recorded
    (default: its config's)."""
    from mixprec.models.hf import HFCausalLM, meta_of

    if isinstance(model, HFCausalLM):
        return HFAdapter(fields if fields is not None else meta_of(model.config))
    return LlamaAdapter(model.args)
