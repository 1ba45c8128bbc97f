"""Expert loops whose rewrite would rest on a premise the code breaks: left as written, equal to eager.

Each module below is one a review (2026-11-29) found the adapters took although the proof's premise
failed, giving a wrong output, a wrong module state, or a raise where eager runs. Two tokens, top-1 of
eight experts: most experts get no token, so an expert the original skips is one the rewrite would run.
Compiled with the inner backend `eager` (what runs is the captured graph itself), each must give eager's
output and leave the module as eager leaves it.
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import assert_close_for_dtype, run_hpu_moe
from tests.loop_models import H
from tests.loop_models import SeparateGatedExpert as Expert

E = 8


class Routed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(H, E, bias=False)
        self.experts = torch.nn.ModuleList(Expert() for _ in range(E))

    def route(self, x):
        w, ids = torch.topk(self.gate(x).softmax(-1), 1)
        return w / w.sum(-1, keepdim=True), ids

    def state(self):
        return None


class StoresAStatistic(Routed):
    """A helper method the hit loop calls stores a statistic of the expert's rows on the module (the mean
    of no rows is NaN)."""

    def __init__(self):
        super().__init__()
        self.aux = torch.zeros(())

    def run_expert(self, e, rows):
        y = self.experts[e](rows)
        self.aux = self.aux + y.pow(2).mean()
        return y

    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=E).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            slot, token = torch.where(mask[e].squeeze(0))
            out.index_add_(0, token, self.run_expert(e, x[token]) * w[token, slot, None])
        return out

    def state(self):
        return self.aux


class SkipsAPrunedSet(Routed):
    """`if e in self.pruned: continue` on the hit row: a set looks a tensor up by identity (never found),
    a Python int by value."""

    pruned = set(range(E))  # every expert: an int test would skip whichever is hit

    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=E).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            if e in self.pruned:
                continue
            slot, token = torch.where(mask[e].squeeze(0))
            out.index_add_(0, token, self.experts[e](x[token]) * w[token, slot, None])
        return out


class RebindsTheMask(Routed):
    """The hit test reads one mask; the loop selects its rows from another bound to the same name."""

    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=E).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        mask = F.one_hot((ids + 1) % E, num_classes=E).permute(2, 1, 0)
        for e in hit:
            slot, token = torch.where(mask[e].squeeze(0))
            out.index_add_(0, token, self.experts[e](x[token]) * w[token, slot, None])
        return out


class SkipsOnWeightedCounts(Routed):
    """`bincount(ids, weights=...)`: an expert only padding tokens chose counts 0 although it has rows."""

    def forward(self, x):
        w, ids = self.route(x)
        real = (torch.arange(x.shape[0]) > 0).to(x.dtype)[:, None].expand_as(ids)  # token 0 is padding
        counts = torch.bincount(ids.flatten(), weights=real.flatten(), minlength=E)
        out = torch.zeros_like(x)
        for e in range(E):
            if counts[e] == 0:
                continue
            token, slot = torch.where(ids == e)
            out.index_add_(0, token, self.experts[e](x[token]) * w[token, slot, None])
        return out


class Section:
    """A context manager that counts how often it was entered."""

    def __init__(self):
        self.entered = 0

    def __enter__(self):
        self.entered += 1

    def __exit__(self, *exc):
        return False


class CountsInAContext(Routed):
    """`with self.section:` around an expert's work, skipped when the expert has no rows."""

    def __init__(self):
        super().__init__()
        self.section = Section()

    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in range(E):
            token, slot = torch.where(ids == e)
            if token.shape[0] == 0:
                continue
            with self.section:
                out.index_add_(0, token, self.experts[e](x[token]) * w[token, slot, None])
        return out

    def state(self):
        return self.section.entered


class ShiftsTheListedRows(Routed):
    """Mixtral 4.3x's `top_x_list = top_x.tolist()` in a chunked forward that shifts `top_x` after
    listing it: the list and the shifted rows differ."""

    def forward(self, x):
        out = torch.zeros_like(x)
        for start in range(0, x.shape[0], 1):
            chunk = x[start:start + 1]
            w, ids = self.route(chunk)
            mask = F.one_hot(ids, num_classes=E).permute(2, 1, 0)
            for e in range(E):
                slot, top_x = torch.where(mask[e])
                top_x_list, slot_list = top_x.tolist(), slot.tolist()
                top_x = top_x + start
                out.index_add_(0, top_x, self.experts[e](chunk[top_x_list]) * w[top_x_list, slot_list, None])
        return out


class FloatCapacity(Routed):
    """A capacity computed as a float (`T * k / E * factor`), never exceeded: eager never slices with it."""

    def forward(self, x):
        w, ids = self.route(x)
        capacity = x.shape[0] / E * 16.0
        out = torch.zeros_like(x)
        for e in range(E):
            rows = torch.nonzero((ids == e).any(dim=-1)).squeeze(-1)
            kept = rows[:capacity] if rows.numel() > capacity else rows
            if kept.numel() > 0:
                out.index_add_(0, kept, self.experts[e](x[kept]) * (w * (ids == e))[kept].sum(-1, keepdim=True))
        return out


CASES = [StoresAStatistic, SkipsAPrunedSet, RebindsTheMask, SkipsOnWeightedCounts, CountsInAContext,
         ShiftsTheListedRows, FloatCapacity]


@pytest.mark.parametrize("cls", CASES, ids=lambda c: c.__name__)
def test_a_loop_whose_premise_fails_gives_eager_output_and_state(cls):
    torch.manual_seed(0)
    model = cls().eval()
    x = torch.randn(2, H)
    expected_model = copy.deepcopy(model)
    with torch.no_grad():
        expected = expected_model(x)
    report, output, _ = run_hpu_moe(model, (x,))
    assert_close_for_dtype(output, expected)
    if expected_model.state() is not None:
        assert torch.equal(torch.as_tensor(model.state()), torch.as_tensor(expected_model.state())), str(report)


class CountLoopCountsRuns(Routed):
    """DeepSeek-V2 4.x's loop over per-expert counts, its expert called through a helper that counts the
    experts run on the module (row-wise itself: only the store tells)."""

    def __init__(self):
        super().__init__()
        self.runs = 0

    def run_expert(self, e, rows):
        self.runs = self.runs + 1
        return self.experts[e](rows)

    def forward(self, x):
        w, ids = self.route(x)
        counts = ids.new_zeros((ids.shape[0], E)).scatter_(1, ids, 1).sum(0).tolist()
        order = ids.flatten().argsort()
        rows = x[order // ids.shape[1]]
        outputs, start = [], 0
        for e, n in enumerate(counts):
            end = start + n
            if n == 0:
                continue
            outputs.append(self.run_expert(e, rows[start:end]))
            start = end
        joined = torch.cat(outputs)
        out = torch.empty_like(joined)
        out[order] = joined
        return (out.view(*ids.shape, -1) * w[..., None]).sum(1)

    def state(self):
        return self.runs


CASES.append(CountLoopCountsRuns)


# A review of the hit-test gating, formatted keys and fixed `if`s (5dc52ab) found the cases below; each gave
# a wrong output there.


class NegatedInPlace(Routed):
    """A one-hot mask negated by `torch.neg_(mask)` before the hit test: no row sums above zero."""

    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=E).permute(2, 1, 0)
        torch.neg_(mask)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            slot, token = torch.where(mask[e].squeeze(0))
            out.index_add_(0, token, self.experts[e](x[token]) * w[token, slot, None])
        return out


class FirstTokenNegated(Routed):
    """`mask[..., 0].neg_()`, an in-place method on a subscript: token 0's expert sums to -1 unless token 1
    chose it too."""

    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=E).permute(2, 1, 0)
        mask[..., 0].neg_()
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            slot, token = torch.where(mask[e].squeeze(0))
            out.index_add_(0, token, self.experts[e](x[token]) * w[token, slot, None])
        return out


class ChangedAfterTheTest(Routed):
    """The handed-in one-hot is changed through the tensor the mask views, after the hit test: the rows
    are read from the changed mask, the hit experts are those of the test."""

    def forward(self, x):
        w, ids = self.route(x)
        return self.run_experts(x, F.one_hot(ids, num_classes=E), w)

    def run_experts(self, x, selected, w):
        out = torch.zeros_like(x)
        expert_mask = selected.permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        selected[0] = 1
        for expert_idx in expert_hit:
            slot, token = torch.where(expert_mask[expert_idx].squeeze(0))
            out.index_add_(0, token, self.experts[expert_idx](x[token]) * w[token, slot, None])
        return out


class ShortListInAFixedArm(Routed):
    """`if self.use_extra: y = self.extra[e](y)`, an arm not taken, over a list shorter than the experts."""

    use_extra = False

    def __init__(self):
        super().__init__()
        self.extra = torch.nn.ModuleList(torch.nn.Linear(H, H) for _ in range(2))

    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=E).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            slot, token = torch.where(mask[e].squeeze(0))
            y = self.experts[e](x[token]) * w[token, slot, None]
            if self.use_extra:
                y = self.extra[e](y)
            out.index_add_(0, token, y)
        return out


class TestsAProperty(Routed):
    """A fixed `if` reading a property that counts its reads."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    @property
    def p(self):
        self.reads += 1
        return 0.25

    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=E).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            slot, token = torch.where(mask[e].squeeze(0))
            y = self.experts[e](x[token]) * w[token, slot, None]
            if self.p > 0:
                y *= 0.5
            out.index_add_(0, token, y)
        return out

    def state(self):
        return self.reads


class DefaultScales(Routed):
    """Scales in a defaultdict keyed by the formatted row: a missing key is made, for the experts the
    original visits only."""

    def __init__(self):
        super().__init__()
        self.experts = torch.nn.ModuleDict({f"expert_{i}": expert for i, expert in enumerate(self.experts)})
        self.scales = collections.defaultdict(float, {"s0": 1.0, "s1": 2.0})

    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=E).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            slot, token = torch.where(mask[e].squeeze(0))
            y = self.experts[f"expert_{e[0]}"](x[token]) * (self.scales[f"s{e[0]}"] + 1.0)
            out.index_add_(0, token, y * w[token, slot, None])
        return out

    def state(self):
        return sorted(self.scales.values())


CASES += [NegatedInPlace, FirstTokenNegated, ChangedAfterTheTest, ShortListInAFixedArm, TestsAProperty,
          DefaultScales]


def test_a_sum_in_a_narrow_dtype_is_read_gated():
    """`mask.sum(dims, dtype=torch.uint8) > 0` wraps at 256 rows: the test may reject a row with entries."""
    from moe_passes.adapters import hit_expert_loops

    _, _, plan = hit_expert_loops.analyse(NarrowSum.forward, NarrowSum)
    assert [loop.gated for loop in plan.hit_loops] == [True]


class NarrowSum(Routed):
    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=E).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2), dtype=torch.uint8), 0).nonzero()
        for e in hit:
            slot, token = torch.where(mask[e].squeeze(0))
            out.index_add_(0, token, self.experts[e](x[token]) * w[token, slot, None])
        return out


class SumsItsRows(Routed):
    """What the loop adds is summed over the expert's rows (`keepdim`): one row even for an expert no
    token chose, where the written loop (one token, so each hit expert has one row) never runs it. The
    copy failed the trace's size check, a raise where eager runs."""

    def forward(self, x):
        x = x[:1]
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=E).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            slot, token = torch.where(mask[e].squeeze(0))
            y = self.experts[e](x[token]) * w[token, slot, None]
            out.index_add_(0, token, y.sum(0, keepdim=True))
        return out


CASES.append(SumsItsRows)
