"""transformers 4.45-4.57 sparse MoE block: the loop over the experts that were hit.

Mirrors transformers 4.55.4 (release wheel) `src/transformers/models/mixtral/modeling_mixtral.py`,
`MixtralSparseMoeBlock.forward` (Qwen2-MoE, Qwen3-MoE, Qwen3-Next, ERNIE-4.5-MoE, MiniMax and
HunYuan-MoE 4.x blocks are the same loop): `expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)),
0).nonzero()`, `for expert_idx in expert_hit:`, `self.experts[expert_idx]` indexed with the [1]-shaped
tensor, `torch.where(expert_mask[expert_idx].squeeze(0))`, `index_add_`. Dynamo cannot iterate a tensor
of data-dependent length, so as written the block is never captured.

The hit-expert-loop adapter (`moe_passes/adapters/hit_expert_loops.py`) traces it as a loop over every
expert (an expert no token chose adds nothing) with data-dependent shapes captured for that compile, so
each layer must become ONE `default` call with w1 = gate_proj, w2 = up_proj, w3 = down_proj, and no
dynamo setting is needed from the user.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._common import GatedMLP, Router, TinyDecoder, finish, settings
from ._expected import Expected

EXPECTED = Expected(fused=2, overload="default")
# Captured in one graph only through this adapter, i.e. only under hpu_moe (plain dynamo breaks).
ADAPTER = "hit_expert_loops"
__all__ = ["ADAPTER", "EXPECTED", "HitExpertLoopMoE", "build"]


class HitExpertLoopMoE(nn.Module):
    """Router + `nn.ModuleList` experts; only the experts some token chose run."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.num_experts = cfg["num_experts"]
        self.router = Router(cfg)
        self.experts = nn.ModuleList(
            GatedMLP(cfg["hidden"], cfg["intermediate"], cfg["activation"]) for _ in range(cfg["num_experts"])
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden_dim = x.shape
        hidden_states = x.view(-1, hidden_dim)
        routing_weights, selected_experts = self.router(hidden_states)
        final_hidden_states = torch.zeros(
            (batch * seq, hidden_dim), dtype=hidden_states.dtype, device=hidden_states.device
        )
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        return final_hidden_states.reshape(batch, seq, hidden_dim)


def build(**overrides):
    """(TinyDecoder of HitExpertLoopMoE layers, (x [1, T, H],)); every DEFAULTS key applies."""
    cfg = settings(overrides)
    return finish(TinyDecoder(HitExpertLoopMoE, cfg), cfg)
