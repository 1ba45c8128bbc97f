"""transformers 4.x Aria: sorted rows cut at cumsum offsets, expert outputs written over their rows.

Mirrors transformers 4.57.6 (release wheel) `src/transformers/models/aria/modeling_aria.py` (the same
code in 4.55.4): `AriaTextMoELayer.forward` (top-k on the logits, softmax over the k, per-expert counts
`histc(ids.float(), bins=E, min=0, max=E - 1)`, slots sorted with `argsort`, rows
`x.index_select(0, order // k)`, outputs put back with `zeros.index_copy_(0, order, y)` and summed
over the k slots with their weights), `AriaGroupedExpertsMLP` (fc1 on [E, H, 2I], `chunk(2)`,
`silu(first) * second`, fc2 on [E, I, H]) and `sequential_experts_gemm` (offsets
`cat([0], cumsum(counts))`, for every expert `out[start:end] = rows[start:end] @ W[e]` into zeros).
Written as plain PyTorch: the same constructs, in this project's words.

Slicing at tensor offsets reads them as numbers: dynamo breaks the graph there unless it may keep them
symbolic (`capture_scalar_outputs`). The expert-loop adapter sees the counts handed to the experts
submodule and switches that on for hpu_moe's own trace; each layer must then become ONE `fused_weights`
call (w12 = fc1[e] as [in, out], w3 = fc2[e]).
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import ACTIVATIONS, TinyDecoder, finish, settings
from ._expected import Expected

EXPECTED = Expected(fused=2, overload="fused_weights")
ADAPTER = "hit_expert_loops"
__all__ = ["ADAPTER", "EXPECTED", "OffsetRouter", "OffsetSegmentMoE", "build", "offset_matmul"]


def offset_matmul(rows, weight, counts):
    """rows[s_e:t_e] @ weight[e] written over the same rows of a zeros buffer, for every expert e."""
    out = torch.zeros(rows.shape[0], weight.shape[-1], dtype=rows.dtype, device=rows.device)
    offsets = torch.cat((torch.zeros(1, dtype=torch.long, device=counts.device), torch.cumsum(counts, dim=0)))
    for e in range(weight.shape[0]):
        start, end = offsets[e], offsets[e + 1]
        out[start:end] = torch.matmul(rows[start:end], weight[e])
    return out


class OffsetExperts(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        experts, hidden, inter = cfg["num_experts"], cfg["hidden"], cfg["intermediate"]
        self.activation = ACTIVATIONS[cfg["activation"]]
        self.fc1 = nn.Parameter(torch.empty(experts, hidden, 2 * inter))
        self.fc2 = nn.Parameter(torch.empty(experts, inter, hidden))

    def forward(self, rows, counts):
        first, second = offset_matmul(rows, self.fc1, counts).chunk(2, dim=-1)
        return offset_matmul(self.activation(first) * second, self.fc2, counts)


class OffsetRouter(nn.Module):
    """Top-k on the logits, softmax over the k: (scores [T, k], ids [T, k])."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.top_k = cfg["top_k"]
        self.layer = nn.Linear(cfg["hidden"], cfg["num_experts"], bias=False)

    def forward(self, hidden_states):
        top_logits, ids = torch.topk(self.layer(hidden_states), k=self.top_k, dim=1)
        return torch.softmax(top_logits, dim=-1), ids


class OffsetSegmentMoE(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.num_experts, self.top_k = cfg["num_experts"], cfg["top_k"]
        self.router = OffsetRouter(cfg)
        self.experts = OffsetExperts(cfg)

    def forward(self, x):
        shape = x.shape
        hidden_states = x.view(-1, shape[-1])
        scores, ids = self.router(hidden_states)
        counts = torch.histc(ids.flatten().float(), bins=self.num_experts, min=0, max=self.num_experts - 1).long()
        order = torch.argsort(ids.view(-1))
        rows = hidden_states.index_select(0, order // self.top_k)
        outputs = self.experts(rows, counts)
        unsorted = torch.zeros(ids.numel(), outputs.shape[1], dtype=outputs.dtype, device=outputs.device)
        unsorted.index_copy_(0, order, outputs)
        return (unsorted.view(-1, self.top_k, outputs.shape[1]) * scores.unsqueeze(-1)).sum(dim=1).view(shape)


def build(**overrides):
    """(TinyDecoder of Aria-style blocks, (x [1, T, H],)); the routing is Aria's own."""
    cfg = settings(overrides, exclude=("routing", "router_fp32"))
    return finish(TinyDecoder(OffsetSegmentMoE, cfg), cfg)
