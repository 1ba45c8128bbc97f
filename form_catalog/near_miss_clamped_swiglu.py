"""Near miss: DeepSeek-V4's clamped SwiGLU, act(clamp(gate, max=L)) * clamp(up, -L, L).

Mirrors transformers 5.23.0 (release wheel) `src/transformers/models/deepseek_v4/modeling_deepseek_v4.py`:
`DeepseekV4Experts._apply_gate` (chunk the packed gate_up halves, `gate.clamp(max=swiglu_limit)`,
`up.clamp(min=-swiglu_limit, max=swiglu_limit)`, `act_fn(gate) * up`), which the grouped_mm / batched_mm
backends of `use_experts_implementation` call on their packed output (hy_v4 and glm5_next do the same).
Here with the batched-GEMM backend of `form_catalog/hf_batched_mm.py`.

The fused kernel's plain overloads compute act(gate) * up with no clamp, and its only clamping overload
(`bias_fused_weights`, GPT-OSS) computes (up + 1) * gate * sigmoid(alpha * gate) on interleaved rows:
neither equals this gate once a value exceeds the limit, so each layer must stay as it is, with a reason
naming the clamps.
"""

from __future__ import annotations

import torch

from ._common import TinyDecoder, finish, settings
from ._expected import Expected
from ._stacked_experts import SparseMoeBlock, StackedExperts
from .hf_batched_mm import batched_mm_experts_forward

EXPECTED = Expected(fused=0, declined=2, reason="clamped before act(gate) * up")

SWIGLU_LIMIT = 0.05  # small enough that the tiny model's activations do reach it


class ClampedSwigluExperts(StackedExperts):
    """`DeepseekV4Experts`: stacked experts whose gate clamps both halves first."""

    def apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=SWIGLU_LIMIT)
        up = up.clamp(min=-SWIGLU_LIMIT, max=SWIGLU_LIMIT)
        return self.act_fn(gate) * up


def build(**overrides):
    """(TinyDecoder of SparseMoeBlocks with clamped-SwiGLU experts, (x [1, T, H],))."""
    cfg = settings(overrides)
    make = lambda c: SparseMoeBlock(c, batched_mm_experts_forward, ClampedSwigluExperts)  # noqa: E731
    return finish(TinyDecoder(make, cfg), cfg)
