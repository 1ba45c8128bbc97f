"""Slot dispatch with a capacity ([S, E, C] dispatch and combine tensors): fused only where it cannot drop.

Written the way a GShard-style author would, not as the corpus's Hunyuan-Large mirror: top-1 by
`max(dim)`, slots from a running count with an `arange` comparison for the one-hot, the dispatch as a
`bmm` over the merged expert/slot dim, and the experts run over `unbind` and `stack`ed back.

    capacity >= tokens, slots = running count   -> fused (nothing can be dropped)
    capacity <  tokens                          -> declined as capacity-limited
    capacity == tokens, slots shifted by S // 2 -> declined: crowded probes see the shifted slots overflow
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import backward_like_eager, eager_output, run_hpu_moe

E, H, INTER = 4, 16, 8


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.w_gate, self.w_in = nn.Linear(H, INTER, bias=False), nn.Linear(H, INTER, bias=False)
        self.w_out = nn.Linear(INTER, H, bias=False)

    def forward(self, x):
        return self.w_out(F.silu(self.w_gate(x)) * self.w_in(x))


class SlotDispatch(nn.Module):
    def __init__(self, capacity_factor: float = 1.0, shift_slots: bool = False):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(E))
        self.capacity_factor, self.shift_slots = capacity_factor, shift_slots

    def forward(self, hidden):
        batch, seq, width = hidden.shape
        x = hidden.reshape(-1, width)
        tokens = x.shape[0]
        capacity = int(tokens * self.capacity_factor)
        probs = torch.softmax(self.router(x), dim=-1)
        top_prob, top_expert = probs.max(dim=-1)
        chosen = F.one_hot(top_expert, E)  # [S, E]
        slot = ((torch.cumsum(chosen, dim=0) - 1) * chosen).sum(dim=-1)  # position within its expert
        if self.shift_slots:
            slot = slot + tokens // 2
        in_slot = (slot.unsqueeze(-1) == torch.arange(capacity)).to(x.dtype)  # [S, C]; past C: no slot
        combine = (probs * chosen).unsqueeze(-1) * in_slot.unsqueeze(1)  # [S, E, C]
        dispatch = (combine > 0).to(x.dtype)
        slots = torch.bmm(dispatch.reshape(tokens, E * capacity).t().unsqueeze(0), x.unsqueeze(0))
        slots = slots.reshape(E, capacity, width)
        outputs = torch.stack([expert(rows) for expert, rows in zip(self.experts, slots.unbind(0), strict=True)])
        out = combine.reshape(tokens, E * capacity) @ outputs.reshape(E * capacity, width)
        return out.reshape(batch, seq, width)


def _compile(model, batch: int = 2, seq: int = 5):
    torch.manual_seed(1)
    inputs = (torch.randn(batch, seq, H),)
    expected = eager_output(model, inputs)
    report, output, _ = run_hpu_moe(model, inputs)
    torch.testing.assert_close(output, expected)
    return report


@pytest.mark.parametrize("capacity_factor", [1.0, 2.0])
@pytest.mark.parametrize("batch, seq", [(2, 5), (1, 1)])
def test_a_dispatch_that_cannot_drop_is_fused(capacity_factor, batch, seq):
    torch.manual_seed(0)
    report = _compile(SlotDispatch(capacity_factor).eval(), batch, seq)
    assert report.graph_count == 1 and len(report.fused) == 1 and not report.declined, str(report)
    fused = report.fused[0]
    assert (fused.form, fused.top_k) == ("capacity_dispatch", 1), str(report)


def test_a_capacity_below_the_token_count_is_declined():
    torch.manual_seed(0)
    report = _compile(SlotDispatch(0.5).eval())
    assert not report.fused and "tokens past an expert's capacity are dropped" in report.declined[0].reason


def test_slots_that_overflow_only_when_crowded_are_declined():
    """Random routings put two or three tokens on an expert, whose shifted slots still fit; a crowded
    routing (every token on one expert) overflows them, which drops tokens in the model too."""
    torch.manual_seed(0)
    report = _compile(SlotDispatch(1.0, shift_slots=True).eval())
    assert not report.fused and report.declined, str(report)
    assert "not the routing weights" in report.declined[0].reason, str(report)


def test_a_dispatch_that_cannot_drop_trains_fused_like_eager():
    """The call's router weights are the combine's table gathered at the ids: gradients reach the router."""
    torch.manual_seed(0)
    report = backward_like_eager(SlotDispatch(), (torch.randn(2, 5, H),))
    assert len(report.fused) == 1 and report.fused[0].training, str(report)
