"""The transformers 4.x sparse expert loop shared by `hf4_sparse_loop` and `mixtral4_sparse_loop`.

Mirrors transformers 4.57.6 (release wheel) `src/transformers/models/olmoe/modeling_olmoe.py`,
`OlmoeSparseMoeBlock.forward`: router softmax(float32) → top-k → (renormalise) → cast; then
`expert_mask = one_hot(ids, E).permute(2, 1, 0)` and, for every expert in `range(E)`,
`idx, top_x = torch.where(expert_mask[e])`, `expert(hidden[None, top_x].reshape(-1, H)) *
w[top_x, idx, None]`, `index_add_(0, top_x, out.to(dtype))`. `torch.where(mask)` has a data-dependent
size: dynamo captures the loop in one graph only with `capture_dynamic_output_shape_ops=True`
(`DYNAMO_CONFIG` of the forms that use this shell).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._common import Router

# What torch._dynamo.config needs for this form to be captured in one graph (tests apply it).
DYNAMO_CONFIG = {"capture_dynamic_output_shape_ops": True}


class SparseLoopMoE(nn.Module):
    """Router + `nn.ModuleList` experts, each run on its routed tokens only and added back with index_add_."""

    def __init__(self, cfg: dict, make_expert):
        super().__init__()
        self.num_experts = cfg["num_experts"]
        self.router = Router(cfg)
        self.experts = nn.ModuleList(make_expert(cfg) for _ in range(cfg["num_experts"]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden_dim = x.shape
        hidden_states = x.view(-1, hidden_dim)
        routing_weights, selected_experts = self.router(hidden_states)
        final_hidden_states = torch.zeros(
            (batch * seq, hidden_dim), dtype=hidden_states.dtype, device=hidden_states.device
        )
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        return final_hidden_states.reshape(batch, seq, hidden_dim)
