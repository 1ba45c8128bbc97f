"""Experts whose joined gate/up projection is read up first, `up, gate = gate_up(x).chunk(2)` and
`down(up * act(gate))`: the same MLP as gate first with the halves of the weight swapped, passed to the
call as two views of the one weight (gate = W[I:2I], up = W[:I]). An odd width has no halves."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import assert_close_for_dtype, backward_like_eager, eager_output, run_hpu_moe

H, E, K = 8, 4, 2


class UpFirstExpert(nn.Module):
    def __init__(self, joined=32):
        super().__init__()
        self.gate_up = nn.Linear(H, joined, bias=False)
        self.down = nn.Linear(joined - joined // 2, H, bias=False)

    def forward(self, x):
        joined = self.gate_up(x)
        up, gate = joined[..., : joined.shape[-1] // 2], joined[..., joined.shape[-1] // 2:]
        return self.down(up * F.silu(gate))


class UpFirstLoop(nn.Module):
    def __init__(self, joined=32):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(UpFirstExpert(joined) for _ in range(E))

    def forward(self, x):
        weights, ids = torch.topk(self.gate(x).softmax(-1), K)
        out = torch.zeros_like(x)
        for e in range(E):
            token, slot = torch.where(ids == e)
            out.index_add_(0, token, self.experts[e](x[token]) * weights[token, slot, None])
        return out


def test_an_expert_loop_reading_the_up_half_first_is_fused_and_equal():
    torch.manual_seed(0)
    model, inputs = UpFirstLoop().eval(), (torch.randn(6, H),)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert len(recorder.fused_nodes()) == 1 and not report.declined, str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


def test_an_expert_loop_reading_the_up_half_first_trains_like_eager():
    torch.manual_seed(0)
    report = backward_like_eager(UpFirstLoop(), (torch.randn(6, H),))
    assert [f.training for f in report.fused] == [True], str(report)


def test_an_odd_joined_width_has_no_halves_and_is_declined():
    torch.manual_seed(0)
    model, inputs = UpFirstLoop().eval(), (torch.randn(6, H),)
    model.experts = nn.ModuleList(_Broadcast() for _ in range(E))
    report, output, recorder = run_hpu_moe(model, inputs)
    assert not recorder.fused_nodes() and report.declined, str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


class _Broadcast(UpFirstExpert):
    """3 joined features cut into 1 (up) and 2 (gate), the 1-wide up broadcast."""

    def __init__(self):
        super().__init__(joined=3)
        self.down = nn.Linear(2, H, bias=False)

    def forward(self, x):
        joined = self.gate_up(x)
        return self.down(joined[..., :1] * F.silu(joined[..., 1:]))
