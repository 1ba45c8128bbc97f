"""GPT-OSS experts: interleaved gate/up, per-expert biases, clamped swiglu, transposed stacks.

Mirrors transformers 5.23.0 (release wheel) `src/transformers/models/gpt_oss/modeling_gpt_oss.py`:
`GptOssExperts` (`gate_up_proj [E, H, 2I]` with gate in the even and up in the odd columns,
`gate_up_proj_bias [E, 2I]`, `down_proj [E, I, H]`, `down_proj_bias [E, H]`, decorated
`use_experts_implementation(is_concatenated=False, is_transposed=True, has_bias=True)`) and its
`_apply_gate`: `gate.clamp(max=limit)`, `up.clamp(-limit, limit)`, `glu = gate * sigmoid(gate * alpha)`,
`(up + 1) * glu` with alpha 1.702 and limit 7.0; run by `batched_mm_experts_forward`
(`src/transformers/integrations/moe.py`). GPT-OSS routes top-k on the logits then softmax over the k
(`GptOssTopKRouter`), which is this form's default routing.

The rewrite must turn each layer into ONE `bias_fused_weights` call (w12 = gate_up_proj[e] as stored,
w12_bias / w3_bias the per-expert biases, alpha and limit read from the graph), as vllm-gaudi
`vllm_gaudi/ops/hpu_fused_moe.py` does by hand for `model_type == "gpt_oss"`.
"""

from __future__ import annotations

import torch

from ._common import TinyDecoder, finish, settings
from ._expected import Expected
from ._stacked_experts import SparseMoeBlock, StackedExperts
from .hf_batched_mm import batched_mm_experts_forward

EXPECTED = Expected(fused=2, overload="bias_fused_weights")
ALPHA, LIMIT = 1.702, 7.0


class GptOssExperts(StackedExperts):
    """Transposed, biased stacks whose gate is GPT-OSS's clamped swiglu over interleaved columns."""

    def __init__(self, cfg: dict, experts_forward):
        super().__init__(cfg, experts_forward, is_transposed=True, has_bias=True)
        self.alpha, self.limit = ALPHA, LIMIT

    def apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return (up + 1) * glu


def build(**overrides):
    """(TinyDecoder of GPT-OSS expert blocks, (x [1, T, H],)); all DEFAULTS but `activation` (fixed swiglu)."""
    cfg = settings({"routing": "topk_softmax", **overrides}, exclude=("activation",))
    cfg["activation"] = "silu"  # unused: the clamped swiglu replaces act_fn
    make = lambda c: SparseMoeBlock(c, batched_mm_experts_forward, experts_class=GptOssExperts)  # noqa: E731
    return finish(TinyDecoder(make, cfg), cfg)
