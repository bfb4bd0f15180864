"""gpt-oss's own MXFP4 layout, which transformers reads for the family (`mixprec export --format mxfp4` of a
gpt-oss model): each experts tensor (E, K, N) as `X_blocks` (E, N, K/32, 16), two e2m1 codes a byte, and
`X_scales` (E, N, K/32), the E8M0 exponent bytes; quantization_config {"quant_method": "mxfp4"}; attention,
routers, embeddings and the head stay in the export's dtype, as the family's checkpoints keep them."""

from __future__ import annotations

import logging

import torch

from mixprec.errors import UserError
from mixprec.interop.expert_files import is_fused
from mixprec.interop.interfaces import View
from mixprec.interop.quantized.scales import scale_values

logger = logging.getLogger(__name__)


def own_layout(fmt: str, config: dict) -> bool:
    """Whether the model family has a layout of its own for `fmt` that holds its fused experts (gpt-oss's MXFP4)."""
    return fmt == "mxfp4" and config.get("model_type") == "gpt_oss"


def write(tensors, config):
    """gpt-oss's experts in its MXFP4 layout, cast as the mxfp4 recipe casts weights (1 x 32, the scale rounded
    up), along each expert's input dimension."""
    from mixprec.narrow.formats.microscaling import E2M1, quantize_mx
    from mixprec.narrow.formats.recipe import RECIPES

    out, narrow = {}, set()
    for name, w in tensors.items():
        if not (is_fused(name) and w.dim() == 3):
            out[name] = w
            continue
        E, K, N = w.shape
        if K % 32:
            raise UserError(f"--format mxfp4: {name} sums over {K} elements, not a multiple of 32; accepted: a "
                            "gpt-oss model whose hidden and intermediate sizes are multiples of 32")
        q = quantize_mx(w.transpose(1, 2).reshape(E * N, K).float(), E2M1, rounding=RECIPES["mxfp4"].scale_rounding)
        out[name + "_blocks"] = q.data.view(torch.uint8).reshape(E, N, K // 32, 16)
        out[name + "_scales"] = q.scale.view(torch.uint8).reshape(E, N, K // 32)
        narrow |= {name + "_blocks", name + "_scales"}
    config = {**config, "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}
    logger.info("export: %d gpt-oss experts tensors in MXFP4 (_blocks, _scales); attention, routers, embeddings "
                "and the head in the export's dtype", len(narrow) // 2)
    return out, config, narrow


class GptOssMxfp4(View):
    """A gpt-oss MXFP4 folder read as its weights: each `X_blocks` with `X_scales` as the experts tensor `X`
    (E, K, N), e2m1 x 2^(byte - 127); a rank's rows are its experts."""

    def __init__(self, folder, key: str):
        super().__init__(folder)
        self.packed = {n.removesuffix("_blocks"): n for n in folder.names() if n.endswith("_blocks")}
        for name, blocks in self.packed.items():
            shape, scales = folder.shape(blocks), name + "_scales"
            if (len(shape) != 4 or shape[-1] != 16 or scales not in folder.where
                    or tuple(folder.shape(scales)) != tuple(shape[:3])):
                raise UserError(f"{key} {folder.path}: {blocks!r} is {list(shape)}; accepted: gpt-oss MXFP4 blocks "
                                "(E, N, K/32, 16) with scales (E, N, K/32) beside them")
        self.hidden = set(self.packed.values()) | {n + "_scales" for n in self.packed}
        logger.info("%s: %s, gpt-oss MXFP4 (quant_method mxfp4): %d experts tensors dequantized as the format "
                    "defines (e2m1 x 2^(scale - 127))", key, folder.path, len(self.packed))

    @property
    def made(self) -> dict[str, str]:
        return self.packed

    def _shape(self, name: str) -> tuple[int, ...]:
        E, N, G, _ = self.source.shape(self.packed[name])
        return E, G * 32, N

    def _read(self, name: str, rows: slice | None) -> torch.Tensor:
        from mixprec.narrow.formats.microscaling import decode_e2m1

        blocks = self.source.read(self.packed[name], rows)  # (e, N, G, 16): this rank's experts only
        scales = scale_values(self.source.read(name + "_scales", rows).view(torch.uint8))
        e, N, G, _ = blocks.shape
        values = decode_e2m1(blocks.reshape(e * N * G, 16)).reshape(e, N, G, 32) * scales[..., None]
        return values.reshape(e, N, G * 32).transpose(1, 2)
