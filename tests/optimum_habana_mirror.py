"""A mirror of optimum-habana's Mixtral MoE block, which calls the Gaudi kernel itself.

Mirrors optimum-habana 1.20.0 (release wheel on PyPI)
`optimum/habana/transformers/models/mixtral/modeling_mixtral.py`: `GaudiMixtralSparseMoeBlock.forward`
(router, `calculate_routing_tensors`: float32 softmax -> top-k -> renormalise -> cast) and
`call_dynamic_moe_op` (per-expert weight lists, `torch.ops.hpu.mixture_of_experts(...)` with keywords,
Mixtral's w3 passed as the kernel's w2 and w2 as its w3, `experts_min`/`experts_max` of the rank's
range). The real package needs a Gaudi to import, so the block is reproduced here; it runs wherever
`hpu::mixture_of_experts` is registered (tests/hpu_contract.py's reference library off Gaudi).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from form_catalog.mixtral4_sparse_loop import MixtralExpert


class GaudiStyleMixtralMoE(nn.Module):
    def __init__(self, hidden: int = 16, intermediate: int = 8, num_experts: int = 4, top_k: int = 2):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(MixtralExpert(hidden, intermediate) for _ in range(num_experts))
        self.experts_min, self.experts_max = 0, num_experts - 1
        self.experts_range = range(self.experts_min, self.experts_max + 1)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        original_shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, original_shape[-1])
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float32)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        w1_list = [self.experts[i].w1.weight for i in self.experts_range]
        w2_list = [self.experts[i].w2.weight for i in self.experts_range]
        w3_list = [self.experts[i].w3.weight for i in self.experts_range]
        out = torch.ops.hpu.mixture_of_experts(
            hidden_states=hidden_states,
            expert_routing_table=selected_experts,
            router_weights=routing_weights,
            w1=w1_list,
            w2=w3_list,  # Mixtral's w3 is up: the kernel's w2
            w3=w2_list,  # Mixtral's w2 is down: the kernel's w3
            permuted_weights=True,
            activation="silu",
            experts_min=self.experts_min,
            experts_max=self.experts_max,
        )
        return out.view(original_shape)


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(GaudiStyleMixtralMoE() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x
