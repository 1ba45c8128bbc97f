"""Near miss: DeepSpeed's capacity-limited gating, which drops the tokens past an expert's capacity.

Mirrors microsoft/DeepSpeed `deepspeed/moe/sharded_moe.py` at commit 38327e0 (`topkgating` with
`drop_tokens=True` and `drop_policy="position"`, `_capacity`, `MOELayer.forward`; experts applied chunk
by chunk as `deepspeed/moe/experts.py` does): top-k on the float32 logits, softmax gates;
    C = max(ceil(S / E * capacity_factor * k), min_capacity)          (`_capacity`, on tensors)
    locations = cumsum(mask, 0) - 1;  mask *= locations < C            (later tokens are dropped)
    gates = softmax * mask / sum;  combine[s, e, c] = gates[s, e] * one_hot(locations)[s, e, c]
    dispatched = einsum("sec,sm->ecm", combine.bool(), x);  out = einsum("sec,ecm->sm", combine, experts(dispatched))
A token routed to a full expert loses that expert's output, which the fused kernel never does, so the
layer must be declined with that reason. The capacity is a tensor compared and read as a number on the
host: dynamo breaks the graph there too, and the dispatch and combine reach a later graph of their own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._common import GatedMLP, Router, TinyDecoder, finish, settings
from ._expected import Expected

# Both layers run the same resumed code after the gating breaks: one graph, compiled once, one decline.
EXPECTED = Expected(fused=0, declined=1, reason="capacity", graph_breaks=True, advice="breaks the graph")
CAPACITY_FACTOR = 1.0
MIN_CAPACITY = 2


class TopKGate(Router):
    """`TopKGate`'s selection: float32 logits, top-k ids, softmax gates at those ids."""

    def __init__(self, cfg: dict):
        nn.Module.__init__(self)
        self.wg = nn.Linear(cfg["hidden"], cfg["num_experts"], bias=False)
        self.top_k = cfg["top_k"]

    def forward(self, x: torch.Tensor):
        logits = F.linear(x.float(), self.wg.weight.float())
        ids = torch.topk(logits, self.top_k, dim=1)[1]
        return F.softmax(logits, dim=1).gather(1, ids), ids


def _capacity(gates: torch.Tensor, capacity_factor: torch.Tensor, min_capacity: torch.Tensor) -> torch.Tensor:
    num_tokens, num_experts = gates.shape
    capacity = torch.ceil((num_tokens / num_experts) * capacity_factor).to(torch.int64)
    if capacity < min_capacity:
        capacity = min_capacity.to(torch.int64)
    return capacity


class CapacityMoE(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.gate = TopKGate(cfg)
        self.experts = nn.ModuleList(
            GatedMLP(cfg["hidden"], cfg["intermediate"], cfg["activation"]) for _ in range(cfg["num_experts"])
        )

    def gating(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(combine weights [S, E, C], dispatch mask [S, E, C]) as `topkgating` builds them."""
        top_gates, ids = self.gate(x)
        experts = len(self.experts)
        gates = torch.zeros(x.shape[0], experts, device=x.device).scatter(1, ids, top_gates)
        mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, ids, True)
        capacity = _capacity(gates, torch.tensor(CAPACITY_FACTOR * ids.shape[1]), torch.tensor(MIN_CAPACITY))
        locations = torch.cumsum(mask, dim=0) - 1
        mask = mask * torch.lt(locations, capacity)
        masked = gates * mask
        masked = masked / torch.clamp(masked.sum(dim=1, keepdim=True), min=torch.finfo(masked.dtype).eps)
        slots = F.one_hot(locations * mask, num_classes=int(capacity)).float()
        combine = torch.einsum("se,sec->sec", masked, slots)
        return combine, combine.bool()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        combine, dispatch = self.gating(rows)
        dispatched = torch.einsum("sec,sm->ecm", dispatch.type_as(x), rows)
        chunks = dispatched.chunk(len(self.experts), dim=0)
        expert_output = torch.cat([expert(chunk) for expert, chunk in zip(self.experts, chunks, strict=True)])
        return torch.einsum("sec,ecm->sm", combine.type_as(x), expert_output).reshape(shape)


def build(**overrides):
    """(TinyDecoder of CapacityMoE layers, (x [1, T, H],)); DeepSpeed's own gating."""
    cfg = settings(overrides, exclude=("routing", "router_fp32"))
    return finish(TinyDecoder(CapacityMoE, cfg), cfg)
