"""A cut of an expert's rows to a capacity, guarded by a size read on the host (makeMoE):

    rows = torch.nonzero((ids == e).any(dim=-1)).squeeze(-1)
    kept = rows[:capacity] if rows.numel() > capacity else rows
    if kept.numel() > 0:
        acc.index_add_(0, kept, expert(x[kept]) * probs[kept, e, None])

The expert-loop adapter traces the cut unconditionally (the branch picks the same value either way) and
drops the emptiness guard (no rows add nothing), so the loop is one graph. The cut drops tokens when an
expert has more than `capacity`, which the fused kernel never does: the layer must be declined, never
fused, and run as eager does. A capacity at least the token count, proved from the shapes, cuts nothing:
that layer is fused (its weights, `probs[kept, e]`, are the softmax table read at the chosen ids).
"""

from __future__ import annotations

import ast

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moe_passes.adapters.host_reads import CutToCapacity, capacity_cut, cut_to_capacity
from tests.helpers import eager_output, run_hpu_moe

E, H, INTER, K = 4, 16, 8, 2


class SwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(H, INTER, bias=False), nn.Linear(H, INTER, bias=False)
        self.w2 = nn.Linear(INTER, H, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class CapacityMoE(nn.Module):
    def __init__(self, capacity_factor: float):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(SwiGLU() for _ in range(E))
        self.capacity_factor = capacity_factor

    def forward(self, x):
        probs = F.softmax(self.gate(x), dim=-1)
        _, chosen = probs.topk(K, dim=-1)
        capacity = int(x.shape[0] * K / E * self.capacity_factor)
        acc = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = torch.nonzero((chosen == e).any(dim=-1)).squeeze(-1)
            kept = rows[:capacity] if rows.numel() > capacity else rows
            if kept.numel() > 0:
                acc.index_add_(0, kept, expert(x[kept]) * probs[kept, e].unsqueeze(1))
        return acc


def _one_graph_report(model):
    """The report of a compile whose output equals eager's; None where torch 2.9's dynamo guards on the
    unbacked size at a slice by a capacity read on the host (a named break, nothing fused)."""
    torch.manual_seed(0)
    inputs = (torch.randn(13, H),)
    expected = eager_output(model, inputs)
    report, output, _ = run_hpu_moe(model, inputs)
    torch.testing.assert_close(output, expected)
    if report.graph_break_count:
        assert not report.fused and "data-dependent" in " ".join(b.reason for b in report.graph_breaks), str(report)
        return None
    assert report.graph_count == 1, str(report)
    return report


@pytest.mark.parametrize("capacity_factor", [0.5, 4.0], ids=["drops", "never_drops"])
def test_a_capacity_cut_is_one_graph_declined_and_equal_to_eager(capacity_factor):
    torch.manual_seed(0)
    report = _one_graph_report(CapacityMoE(capacity_factor).eval())
    assert report is not None  # torch 2.9 too: the cut narrows to min(len, C), which it traces
    if capacity_factor < 1:
        assert not report.fused and "cut to a capacity" in report.declined[0].reason, str(report)
    else:  # C = 26 >= 13 tokens: the shape environment bounds each expert's rows by 13, so nothing is cut
        assert len(report.fused) == 1 and not report.declined, str(report)


@pytest.mark.parametrize("shape", [(5,), (2,), (0,), (5, 0), (5, 3)])
@pytest.mark.parametrize("test", ["rows.numel() > 3", "len(rows) > 3", "rows.shape[0] > 3", "3 < rows.size(0)"])
def test_the_cut_is_the_same_value_as_the_branch(shape, test):
    source = f"rows[:3] if {test} else rows"
    original = ast.parse(source, mode="eval")
    assert capacity_cut(original.body) is not None
    rewritten = ast.fix_missing_locations(CutToCapacity("cut_to_capacity").visit(ast.parse(source, mode="eval")))
    rows = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
    expected = eval(compile(original, "<cut>", "eval"), {"rows": rows})
    actual = eval(compile(rewritten, "<cut>", "eval"), {"rows": rows, "cut_to_capacity": cut_to_capacity})
    assert actual.shape == expected.shape and torch.equal(actual, expected)


class LargestCountCapacity(nn.Module):
    """The capacity is the largest per-expert count, read on the host: nothing is ever cut (`shrink`
    takes one off it, which cuts the busiest expert)."""

    def __init__(self, shrink: int = 0):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(SwiGLU() for _ in range(E))
        self.shrink = shrink

    def forward(self, x):
        weights, chosen = F.softmax(self.gate(x), dim=-1).topk(K, dim=-1)
        capacity = int(torch.bincount(chosen.flatten(), minlength=E).max().item()) - self.shrink
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(chosen == e)
            tok, slot = tok[:capacity], slot[:capacity]
            out.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
        return out


@pytest.mark.parametrize("shrink", [0, 1], ids=["largest_count", "one_less"])
def test_a_capacity_of_the_largest_count_is_fused(shrink):
    torch.manual_seed(0)
    report = _one_graph_report(LargestCountCapacity(shrink).eval())
    if report is None:
        return
    assert len(report.fused) == (1 - shrink) and len(report.declined) == shrink, str(report)
