"""A routed MoE with a sigmoid-gated shared expert beside it (Qwen2-MoE).

Mirrors transformers 5.23.0 (release wheel) `src/transformers/models/qwen2_moe/modeling_qwen2_moe.py`:
`Qwen2MoeSparseMoeBlock.forward`: routed experts (`Qwen2MoeExperts`, here run by
`batched_mm_experts_forward` from `src/transformers/integrations/moe.py`) plus
`sigmoid(shared_expert_gate(x)) * shared_expert(x)`, where `shared_expert` is a dense gated MLP of
`shared_expert_intermediate_size` and `shared_expert_gate` an `nn.Linear(H, 1)`.

The rewrite must turn the routed experts of each layer into ONE `fused_weights` call and leave the
shared expert, its gate and the sum exactly as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._common import GatedMLP, TinyDecoder, finish, settings
from ._expected import Expected
from ._stacked_experts import SparseMoeBlock
from .hf_batched_mm import batched_mm_experts_forward

EXPECTED = Expected(fused=2, overload="fused_weights")
SHARED_INTERMEDIATE_FACTOR = 2  # the shared expert is wider than a routed one, as in Qwen2-MoE


class SharedExpertMoeBlock(SparseMoeBlock):
    """SparseMoeBlock + Qwen2-MoE's gated shared expert."""

    def __init__(self, cfg: dict):
        super().__init__(cfg, batched_mm_experts_forward)
        hidden = cfg["hidden"]
        self.shared_expert = GatedMLP(
            hidden, SHARED_INTERMEDIATE_FACTOR * cfg["intermediate"], cfg["activation"]
        )
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        flat = x.view(-1, hidden)
        weights, ids = self.gate(flat)
        routed = self.experts(flat, ids, weights)
        shared = F.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return (routed + shared).reshape(batch, seq, hidden)


def build(**overrides):
    """(TinyDecoder of SharedExpertMoeBlocks, (x [1, T, H],)); every `_common.DEFAULTS` key applies."""
    cfg = settings(overrides)
    return finish(TinyDecoder(SharedExpertMoeBlock, cfg), cfg)
