"""Expert parallelism: each rank holds a contiguous range of the experts and sums its share.

Mirrors deepseek-ai/DeepSeek-V3 `inference/model.py` at commit 1ea5a1a (`MoE.__init__` / `MoE.forward`):
`n_local_experts = n_routed_experts // world_size`, `experts_start_idx = rank * n_local_experts`, a
`ModuleList` holding an `Expert` (`w2(silu(w1(x)) * w3(x))`, Mixtral's names: w2 is DOWN) only for the
local ids and `None` elsewhere, then `for i in range(start, end)`: `idx, top = torch.where(indices == i)`,
`y[idx] += expert(x[idx]) * weights[idx, top, None]`; `dist.all_reduce(y)` sums the ranks' shares.
Routing ids are global, so ids outside the rank's range contribute nothing here. Left out: the
`counts[i] == 0` skip (a host-side `.tolist()` shortcut dynamo cannot trace: it breaks the graph, see
`near_miss_data_dependent_loop`), the shared experts (see `deepseek_v3_routing`) and the all_reduce
(the tests sum simulated ranks). Routing is the catalog's `Router`. `torch.where` has a data-dependent
size: captured whole with `capture_dynamic_output_shape_ops=True` (`DYNAMO_CONFIG`).

The rewrite must turn each layer into ONE `default` call holding the local experts only, with
experts_min = rank * E_local and experts_max = experts_min + E_local - 1 (the kernel's expert-parallel
range, as vllm-gaudi's `VllmMixtureOfExpertsOp` passes them), w1 = w1, w2 = w3 (up), w3 = w2 (down).
`build(rank=r, world_size=n)` selects the rank; the experts' weights do not depend on it, so the
ranks' outputs sum to the single-device model's.
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import Router, TinyDecoder, finish, settings
from ._expected import Expected
from .mixtral4_sparse_loop import MixtralExpert

EXPECTED = Expected(fused=2, overload="default")
DYNAMO_CONFIG = {"capture_dynamic_output_shape_ops": True}
WORLD_SIZE, RANK = 2, 1  # the default build is the second of two ranks: experts E/2 .. E-1


class ExpertParallelMoE(nn.Module):
    """DeepSeek-V3's inference `MoE` without shared experts, holding experts [start, end) of E."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.num_experts = cfg["num_experts"]
        self.router = Router(cfg)
        self.experts = nn.ModuleList(
            MixtralExpert(cfg["hidden"], cfg["intermediate"], cfg["activation"])
            for _ in range(self.num_experts)
        )
        self.start, self.end = 0, self.num_experts

    def keep_only(self, start: int, end: int) -> None:
        """Drop the experts other ranks hold (DeepSeek's ModuleList keeps None in their places)."""
        self.start, self.end = start, end
        for i in range(self.num_experts):
            if not start <= i < end:
                self.experts[i] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.size()
        x = x.view(-1, shape[-1])
        weights, indices = self.router(x)
        y = torch.zeros_like(x)
        for i in range(self.start, self.end):
            expert = self.experts[i]
            idx, top = torch.where(indices == i)
            y[idx] += expert(x[idx]) * weights[idx, top, None]
        return y.view(shape)


def build(rank: int = RANK, world_size: int = WORLD_SIZE, **overrides):
    """(TinyDecoder of one rank's ExpertParallelMoE layers, (x [1, T, H],)); every DEFAULTS key applies.

    Weights are seeded for all experts before the other ranks' are dropped, so every rank's experts
    are the single-device model's (`world_size=1`).
    """
    cfg = settings(overrides)
    if not isinstance(world_size, int) or world_size < 1 or cfg["num_experts"] % world_size:
        raise ValueError(f"num_experts ({cfg['num_experts']}) must be divisible by world_size ({world_size})")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
    model, inputs = finish(TinyDecoder(ExpertParallelMoE, cfg), cfg)
    local = cfg["num_experts"] // world_size
    for moe in model.moes:
        moe.keep_only(rank * local, (rank + 1) * local)
    return model, inputs
