"""DeepSeek-V3's official inference `MoE`, with its host-side count skip.

Mirrors deepseek-ai/DeepSeek-V3 `inference/model.py` at commit 013e221 (`Gate.forward`, `MoE.forward`,
`Expert`, `MLP`). The gate scores with a sigmoid, adds a per-expert correction bias for the choice only,
picks the best `topk_groups` of `n_groups` groups by the sum of each group's two best scores, masks the
other groups, takes the top-k, gathers the original scores as weights, renormalises and scales them. The
layer then reads the per-expert counts on the host,
    counts = torch.bincount(indices.flatten(), minlength=E).tolist()
and loops over the experts it holds, skipping those no token chose (`if counts[i] == 0: continue`),
`idx, top = torch.where(indices == i)`, `y[idx] += expert(x[idx]) * weights[idx, top, None]`; a shared
expert is added. Left out: the distributed all-reduce (one process) and fp8/bf16 linear kernels
(plain nn.Linear). Constructs: `.tolist()` counts, an empty-expert skip on them, `torch.where(mask)`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("deepseek-ai/DeepSeek-V3", "inference/model.py", "013e2213cc47bf9f3549e23c9920d41714405cf3",
                "MoE.forward")
HIDDEN, INTER, EXPERTS, TOP_K, GROUPS, TOP_GROUPS = 16, 8, 8, 2, 4, 2


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(EXPERTS, HIDDEN))
        self.bias = nn.Parameter(torch.empty(EXPERTS))
        self.route_scale = 2.5

    def forward(self, x):
        scores = F.linear(x, self.weight).sigmoid()
        original = scores
        scores = scores + self.bias
        grouped = scores.view(x.size(0), GROUPS, -1)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        keep = group_scores.topk(TOP_GROUPS, dim=-1)[1]
        mask = grouped.new_ones(x.size(0), GROUPS, dtype=torch.bool).scatter_(1, keep, False)
        scores = grouped.masked_fill_(mask.unsqueeze(-1), float("-inf")).flatten(1)
        indices = torch.topk(scores, TOP_K, dim=-1)[1]
        weights = original.gather(1, indices)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights * self.route_scale).type_as(x), indices


class Expert(nn.Module):
    """w2(silu(w1(x)) * w3(x)): w1 gate, w3 up, w2 down."""

    def __init__(self, hidden, inter):
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = Gate()
        self.experts = nn.ModuleList(Expert(HIDDEN, INTER) for _ in range(EXPERTS))
        self.shared_experts = Expert(HIDDEN, 2 * INTER)
        self.start, self.end = 0, EXPERTS

    def forward(self, x):
        shape = x.size()
        x = x.view(-1, HIDDEN)
        weights, indices = self.gate(x)
        y = torch.zeros_like(x)
        counts = torch.bincount(indices.flatten(), minlength=EXPERTS).tolist()
        for i in range(self.start, self.end):
            if counts[i] == 0:
                continue
            idx, top = torch.where(indices == i)
            y[idx] += self.experts[i](x[idx]) * weights[idx, top, None]
        return (y + self.shared_experts(x)).view(shape)


def build():
    return tiny(MoE, HIDDEN)
