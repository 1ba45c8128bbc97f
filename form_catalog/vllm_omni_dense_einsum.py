"""vLLM-Omni's dense experts: every expert on every token as einsums, combined by a one-hot routing table.

Mirrors vllm-project/vllm-omni (read in the YongZhuIntel/vllm-omni fork at commit 049203c)
`vllm_omni/diffusion/models/lingbot_vla_v2/modeling_lingbot_vla_v2.py` (`GroupedExperts.forward_dense`,
the path `TokenMoeBlock` takes with `moe_implementation == "dense"`): with gate/up stacked [E, I, H] and
down [E, H, I],
    gate = einsum("td,eid->eti", x, gate_proj)        up = einsum("td,eid->eti", x, up_proj)
    y = einsum("eti,edi->etd", silu(gate) * up, down_proj)
    table = (one_hot(ids, E).to(w.dtype) * w.unsqueeze(-1)).sum(dim=1)          # [T, E]
    out = einsum("etd,te->td", y, table.to(y.dtype))
The table is zero outside each token's top-k, so out is the kernel's weighted sum: each layer must become
ONE `default` call (and the E-fold work of the dense form is gone). The routing is the catalog's Router
(the source's own sigmoid router is in the wild corpus, form_catalog/corpus/vllm_omni_lingbot_dense.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._common import ACTIVATIONS, Router, TinyDecoder, finish, settings
from ._expected import Expected

EXPECTED = Expected(fused=2, overload="default")
# Keeps its source's own forward: tests/test_mutations.py's per-family mutated forwards do not apply.
MUTATED = False


class DenseEinsumExperts(nn.Module):
    """`GroupedExperts` with its `forward_dense`: stacked gate_proj/up_proj [E, I, H], down_proj [E, H, I]."""

    def __init__(self, cfg: dict):
        super().__init__()
        experts, hidden, inter = cfg["num_experts"], cfg["hidden"], cfg["intermediate"]
        self.num_experts = experts
        self.gate_proj = nn.Parameter(torch.empty(experts, inter, hidden))
        self.up_proj = nn.Parameter(torch.empty(experts, inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inter))
        self.act = ACTIVATIONS[cfg["activation"]]

    def forward_dense(self, hidden_flat, routing_weights, selected_experts):
        gate = torch.einsum("td,eid->eti", hidden_flat, self.gate_proj)
        up = torch.einsum("td,eid->eti", hidden_flat, self.up_proj)
        expert_out = torch.einsum("eti,edi->etd", self.act(gate) * up, self.down_proj)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).to(routing_weights.dtype)
        weights = (expert_mask * routing_weights.unsqueeze(-1)).sum(dim=1)
        return torch.einsum("etd,te->td", expert_out, weights.to(expert_out.dtype))


class DenseEinsumMoE(nn.Module):
    """`TokenMoeBlock` with the dense experts: route, then `forward_dense` on the flattened tokens."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.router = Router(cfg)
        self.experts = DenseEinsumExperts(cfg)

    def forward(self, hidden_states):
        shape = hidden_states.shape
        hidden_flat = hidden_states.reshape(-1, shape[-1])
        routing_weights, selected_experts = self.router(hidden_flat)
        return self.experts.forward_dense(hidden_flat, routing_weights, selected_experts).view(shape)


def build(**overrides):
    """(TinyDecoder of DenseEinsumMoE layers, (x [1, T, H],)); every catalog setting applies."""
    cfg = settings(overrides)
    return finish(TinyDecoder(DenseEinsumMoE, cfg), cfg)
