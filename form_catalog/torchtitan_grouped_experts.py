"""torchtitan's MoE: token-choice router, stable argsort + gather, grouped experts, scatter_add back.

Mirrors pytorch/torchtitan `torchtitan/models/moe/moe.py` at commit de335b3 (`TokenChoiceTopKRouter`,
`TokenReorderer`, `GroupedExperts` with `_run_experts_grouped_mm`, `MoE.forward`), with
`score_before_experts=False` (torchtitan's DeepSeek-V3 and Qwen3 configurations) and no shared expert:
    scores = softmax(gate(x).float());  top_scores, ids = topk(scores, k)        (route_norm=False)
    counts = histc(ids.view(-1), bins=E, min=0, max=E)        (bins of width 1: bin j holds id j)
    order = argsort(ids.view(-1), stable=True);  w = top_scores.view(-1)[order];  order //= k
    rows = gather(x, 0, order[:, None].expand(-1, H))
    h = silu(grouped_mm(rows, w1^T, offs)) * grouped_mm(rows, w3^T, offs)        offs = cumsum(counts)
    y = (grouped_mm(h, w2^T, offs).float() * w[:, None]).to(x.dtype)
    out = zeros_like(x).scatter_add(0, order[:, None].expand(-1, H), y)
Weights are kept as torchtitan keeps them: separate w1 (gate) and w3 (up) [E, I, H], w2 (down) [E, H, I].
Here histc reads the ids as floats (CPU histc has no integer kernel; torchtitan runs it on GPU).
Like every grouped-GEMM form, bfloat16 only (`aten._grouped_mm`'s fake kernel) and 16-byte strides.

The rewrite must turn each layer into ONE `default` call with w1 = w1[e], w2 = w3[e], w3 = w2[e].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._common import ACTIVATIONS, SourceRouter, TinyDecoder, finish, settings
from ._expected import Expected
from .hf_grouped_mm import ALIGNMENT_BYTES

EXPECTED = Expected(fused=2, overload="default")
# Keeps its source's own forward: tests/test_mutations.py's per-family mutated forwards do not apply.
MUTATED = False


class TokenChoiceRouter(SourceRouter):
    """torchtitan's `TokenChoiceTopKRouter` (softmax score function, no expert bias, no route_norm)."""

    def forward(self, x: torch.Tensor):
        scores = F.softmax(self.gate(x).float(), dim=1)
        return torch.topk(scores, self.top_k, dim=1)


class GroupedExpertsMoE(nn.Module):
    """Router, token reordering and `GroupedExperts`; `score_before_experts` scales the rows instead."""

    def __init__(self, cfg: dict, score_before_experts: bool = False):
        super().__init__()
        experts, hidden, inter = cfg["num_experts"], cfg["hidden"], cfg["intermediate"]
        self.router = TokenChoiceRouter(cfg)
        self.w1 = nn.Parameter(torch.empty(experts, inter, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, inter))
        self.w3 = nn.Parameter(torch.empty(experts, inter, hidden))
        self.act = ACTIVATIONS[cfg["activation"]]
        self.score_before_experts = score_before_experts

    def experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        h = self.act(_grouped_mm(x, self.w1.transpose(-2, -1), offsets))
        h = h * _grouped_mm(x, self.w3.transpose(-2, -1), offsets)
        return _grouped_mm(h, self.w2.transpose(-2, -1), offsets).type_as(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(-1, shape[-1])
        top_scores, ids = self.router(x)
        counts = torch.histc(ids.view(-1).float(), bins=self.w1.shape[0], min=0, max=self.w1.shape[0])
        order = torch.argsort(ids.view(-1), stable=True)
        scores_sorted = top_scores.view(-1)[order]
        order = order // self.router.top_k
        index = order.reshape(-1, 1).expand(-1, x.shape[-1])
        rows = torch.gather(x, dim=0, index=index)
        if self.score_before_experts:
            rows = (rows.float() * scores_sorted.reshape(-1, 1)).to(x.dtype)
        out = self.experts(rows, counts)
        if not self.score_before_experts:
            out = (out.float() * scores_sorted.reshape(-1, 1)).to(x.dtype)
        return torch.zeros_like(x).scatter_add(0, index, out).view(shape)


def _grouped_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm
    return grouped_mm(x.bfloat16(), weight.bfloat16(), offs=offs)


def check_can_compile(cfg: dict, name: str) -> None:
    """Refuse, with the reason, builds whose grouped_mm torch.compile cannot trace."""
    if cfg["dtype"] != torch.bfloat16:
        raise ValueError(f"{name}: torch._grouped_mm compiles for bfloat16 only")
    per_row = ALIGNMENT_BYTES // cfg["dtype"].itemsize
    for size in ("hidden", "intermediate"):
        if cfg[size] % per_row:
            raise ValueError(f"{name}: {size} must be a multiple of {per_row} (16-byte strides)")


def build(**overrides):
    """(TinyDecoder of GroupedExpertsMoE layers, (x [1, T, H],)); bfloat16; torchtitan's own routing."""
    cfg = settings({"dtype": torch.bfloat16, **overrides}, exclude=("routing", "router_fp32"))
    check_can_compile(cfg, "torchtitan_grouped_experts")
    return finish(TinyDecoder(GroupedExpertsMoE, cfg), cfg)
