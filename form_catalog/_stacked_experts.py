"""The transformers 5.x MoE block shell shared by the grouped-GEMM and batched-GEMM forms.

Mirrors transformers 5.23.0 (release wheel) `src/transformers/models/qwen3_moe/modeling_qwen3_moe.py`:
`Qwen3MoeSparseMoeBlock.forward` (flatten to [T, H], route, experts, reshape back), `Qwen3MoeTopKRouter`
(linear → softmax(float32) → top-k → optional renormalise → cast to the logits dtype; here `_common.route`)
and `Qwen3MoeExperts`, stored stacked as `gate_up_proj [E, 2I, H]` (gate rows first) and
`down_proj [E, H, I]`, with `_default_apply_gate` from `src/transformers/integrations/moe.py`. The
experts' forward is the backend a form plugs in, as `use_experts_implementation` does.
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import ACTIVATIONS, Router


class StackedExperts(nn.Module):
    """`Qwen3MoeExperts` storage; `forward` dispatches to the given experts backend.

    `is_transposed` and `has_bias` are the `use_experts_implementation` flags of the same names:
    transposed stacks are [E, H, 2I] / [E, I, H] (Aria, GPT-OSS), biases [E, 2I] / [E, H] (GPT-OSS).
    """

    def __init__(self, cfg: dict, experts_forward, is_transposed: bool = False, has_bias: bool = False):
        super().__init__()
        e, h, i = cfg["num_experts"], cfg["hidden"], cfg["intermediate"]
        self.num_experts = e
        self.is_transposed, self.has_bias = is_transposed, has_bias
        gate_up, down = ((e, h, 2 * i), (e, i, h)) if is_transposed else ((e, 2 * i, h), (e, h, i))
        self.gate_up_proj = nn.Parameter(torch.empty(gate_up))
        self.down_proj = nn.Parameter(torch.empty(down))
        if has_bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
            self.down_proj_bias = nn.Parameter(torch.empty(e, h))
        self.act_fn = ACTIVATIONS[cfg["activation"]]
        self._experts_forward = experts_forward

    def apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`_default_apply_gate`: concatenated halves, gate first: act(gate) * up."""
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return self._experts_forward(self, hidden_states, top_k_index, top_k_weights)


class SparseMoeBlock(nn.Module):
    """`Qwen3MoeSparseMoeBlock`: [B, S, H] in and out, experts on the flattened tokens."""

    def __init__(self, cfg: dict, experts_forward, experts_class=StackedExperts, **experts_flags):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = experts_class(cfg, experts_forward, **experts_flags)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        flat = x.view(-1, hidden)
        weights, ids = self.gate(flat)
        return self.experts(flat, ids, weights).reshape(batch, seq, hidden)
