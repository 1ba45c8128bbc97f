"""Near miss: GPT-OSS's clamped swiglu over concatenated gate/up halves instead of interleaved columns.

Mirrors transformers 5.23.0 (release wheel) `src/transformers/models/minimax_m3_vl/modeling_minimax_m3_vl.py`
(`_apply_gate`: "same as GPT OSS, but the weights are not interleaved": `gate_up.chunk(2, -1)`,
`gate.clamp(max=limit)`, `up.clamp(-limit, limit)`, `(up + 1) * gate * sigmoid(gate * alpha)`), which
`src/transformers/models/openai_privacy_filter/modeling_openai_privacy_filter.py` shares; here on the
GPT-OSS storage of `form_catalog/gpt_oss_experts.py` (transposed stacks with biases).

The kernel's `bias_fused_weights` overload computes exactly this gate but reads gate and up from the
even and odd rows of w12: with halves the rewrite would have to re-lay the weights out on every call,
so each layer is left as it is, with a reason that says how to get it fused (interleave the rows once
at load time, which is `gpt_oss_experts`).
"""

from __future__ import annotations

import torch

from ._common import TinyDecoder, finish, settings
from ._expected import Expected
from ._stacked_experts import SparseMoeBlock
from .gpt_oss_experts import GptOssExperts
from .hf_batched_mm import batched_mm_experts_forward

EXPECTED = Expected(fused=0, declined=2, reason="concatenated gate/up halves")


class ConcatenatedSwigluExperts(GptOssExperts):
    """GPT-OSS experts whose gate reads the first and second half of gate_up, not even/odd columns."""

    def apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return (up + 1) * glu


def build(**overrides):
    """(TinyDecoder of GPT-OSS-storage blocks with a concatenated clamped swiglu, (x [1, T, H],))."""
    cfg = settings({"routing": "topk_softmax", **overrides}, exclude=("activation",))
    cfg["activation"] = "silu"  # unused: the clamped swiglu replaces act_fn
    make = lambda c: SparseMoeBlock(c, batched_mm_experts_forward, ConcatenatedSwigluExperts)  # noqa: E731
    return finish(TinyDecoder(make, cfg), cfg)
