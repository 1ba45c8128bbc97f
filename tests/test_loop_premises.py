"""Expert loops whose rewrite would rest on a premise the code breaks: left as written, equal to eager.

Each module below is one a review (2026-11-29) found the adapters took although the proof's premise
failed, giving a wrong output, a wrong module state, or a raise where eager runs. Two tokens, top-1 of
eight experts: most experts get no token, so an expert the original skips is one the rewrite would run.
Compiled with the inner backend `eager` (what runs is the captured graph itself), each must give eager's
output and leave the module as eager leaves it.
"""

from __future__ import annotations

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
