"""transformers 4.x DeepSeek-V2: slots sorted by expert, a loop over the per-expert counts.

Mirrors transformers 4.57.6 (release wheel) `src/transformers/models/deepseek_v2/modeling_deepseek_v2.py`,
`DeepseekV2Moe.moe` (the same method in 4.55.4): counts `zeros(T, E).scatter_(1, ids, 1).sum(0)`, slot
order `ids.view(-1).argsort()`, rows `x[order // k]`, then `for i, n in enumerate(counts):` with
`if n == 0: continue`, each expert on `rows[start:start + n]`, outputs appended and `cat`, put back with
`out[order] = y` and summed over the k slots with their weights. Written as plain PyTorch: the same
constructs, in this project's words.

`if n == 0` branches on a tensor: dynamo breaks the graph there, and slicing with tensor bounds reads
them as numbers. The expert-loop adapter proves the guard removable from the source (an expert with no
rows appends no rows; the offset moves by the count alone) and has the counts kept symbolic for hpu_moe's
own trace, so each layer must become ONE `default` call with w1 = gate_proj, w2 = up_proj,
w3 = down_proj, and no dynamo setting is needed from the user.
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import GatedMLP, Router, TinyDecoder, finish, settings
from ._expected import Expected

EXPECTED = Expected(fused=2, overload="default")
ADAPTER = "hit_expert_loops"
__all__ = ["ADAPTER", "EXPECTED", "CountLoopMoE", "build"]


class CountLoopMoE(nn.Module):
    """Router + `nn.ModuleList` experts, run segment by segment over the sorted slots."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.router = Router(cfg)
        self.experts = nn.ModuleList(
            GatedMLP(cfg["hidden"], cfg["intermediate"], cfg["activation"]) for _ in range(cfg["num_experts"])
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        hidden_states = x.view(-1, shape[-1])
        weights, ids = self.router(hidden_states)
        return self.segments(hidden_states, ids, weights).view(shape)

    def segments(self, hidden_states, ids, weights):
        counts = ids.new_zeros((ids.shape[0], len(self.experts)))
        counts.scatter_(1, ids, 1)
        per_expert = counts.sum(dim=0)
        order = ids.view(-1).argsort()
        rows = hidden_states[order // ids.shape[1]]
        outputs = []
        start = 0
        for i, count in enumerate(per_expert):
            if count == 0:
                continue
            end = start + count
            outputs.append(self.experts[i](rows[start:end]))
            start = end
        joined = torch.cat(outputs, dim=0) if outputs else rows.new_empty(0)
        unsorted = torch.empty_like(joined)
        unsorted[order] = joined
        return unsorted.view(*ids.shape, -1).mul(weights.unsqueeze(-1)).sum(dim=1)


def build(**overrides):
    """(TinyDecoder of DeepSeek-V2-style blocks, (x [1, T, H],))."""
    cfg = settings(overrides)
    return finish(TinyDecoder(CountLoopMoE, cfg), cfg)
