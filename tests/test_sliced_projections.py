"""Expert MLPs whose projections are written in slices of their weights (LLaMA's `pretraining_tp > 1`,
kept by DiT-MoE's experts): `cat([x @ W_i.T], -1)` over W's row slices and `sum(x_i @ W_i.T)` over
matching column slices are x @ W.T, and are read as that projection; any other arrangement is not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import assert_close_for_dtype, eager_output, run_hpu_moe

H, INTER, E, K, TP = 16, 32, 4, 2, 2


class SlicedMLP(nn.Module):
    def __init__(self, order=(0, 1)):
        super().__init__()
        self.gate_proj = nn.Linear(H, INTER, bias=False)
        self.up_proj = nn.Linear(H, INTER, bias=False)
        self.down_proj = nn.Linear(INTER, H, bias=False)
        self.order = order  # the order the gate's slices are concatenated in

    def forward(self, x):
        size = INTER // TP
        gates, ups = self.gate_proj.weight.split(size, dim=0), self.up_proj.weight.split(size, dim=0)
        downs = self.down_proj.weight.split(size, dim=1)
        gate = torch.cat([F.linear(x, gates[i]) for i in self.order], dim=-1)
        up = torch.cat([F.linear(x, ups[i]) for i in range(TP)], dim=-1)
        inner = (F.silu(gate) * up).split(size, dim=-1)
        return sum(F.linear(inner[i], downs[i]) for i in range(TP))


class SlicedExpertsMoE(nn.Module):
    def __init__(self, order=(0, 1)):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(SlicedMLP(order) for _ in range(E))

    def forward(self, x):
        w, ids = torch.topk(self.gate(x).softmax(-1), K)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(E):
            token, slot = torch.where(ids == e)
            out.index_add_(0, token, self.experts[e](x[token]) * w[token, slot, None])
        return out


@pytest.mark.parametrize("order, fused", [((0, 1), 1), ((1, 0), 0)], ids=["in_order", "gate_slices_swapped"])
def test_sliced_projections_read_as_the_whole_weight(order, fused):
    """In order: one fused call, equal to eager. The gate's slices swapped is another MLP than the one
    with the whole gate weight: left as written (rewriting it with the whole weight would be wrong)."""
    torch.manual_seed(0)
    model, inputs = SlicedExpertsMoE(order).eval(), (torch.randn(9, H),)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert len(recorder.fused_nodes()) == fused, str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))
