"""Experts storing into an uninitialised buffer of slots (DeepSeek-V2's training loop, ESFT's forward):

    xs = x.repeat_interleave(k, dim=0); y = torch.empty_like(xs)
    for e, expert in enumerate(experts): y[ids.view(-1) == e] = expert(xs[ids.view(-1) == e])
    out = (y.view(T, k, H) * w.unsqueeze(-1)).sum(dim=1)

Fused where the probes show every slot stored once, by the expert its id names; a loop that leaves
slots unwritten (their values are whatever memory held) or a combine without the weights is declined.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import assert_close_for_dtype, backward_like_eager, eager_output, run_hpu_moe


class Expert(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.gate = torch.nn.Linear(hidden, 2 * hidden, bias=False)
        self.up = torch.nn.Linear(hidden, 2 * hidden, bias=False)
        self.down = torch.nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class SlotStores(torch.nn.Module):
    def __init__(self, hidden=8, experts=4, top_k=2, variant="exact"):
        super().__init__()
        self.top_k, self.variant = top_k, variant
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.experts = torch.nn.ModuleList(Expert(hidden) for _ in range(experts))

    def forward(self, x):
        weights, ids = torch.topk(self.router(x).softmax(-1), self.top_k)
        weights = weights / weights.sum(-1, keepdim=True)
        flat = ids.view(-1)
        xs = x.repeat_interleave(self.top_k, dim=0)
        y = torch.empty_like(xs)
        experts = self.experts if self.variant != "one_left_out" else self.experts[:-1]
        for e, expert in enumerate(experts):
            y[flat == e] = expert(xs[flat == e])
        if self.variant == "unweighted":
            return y.view(*weights.shape, -1).sum(dim=1)
        return (y.view(*weights.shape, -1) * weights.unsqueeze(-1)).sum(dim=1)


class GuardedStores(SlotStores):
    """OpenNMT-py's loop: each expert's store skipped where no slot chose it, its rows given as [1, n, H]."""

    def forward(self, x):
        weights, ids = torch.topk(self.router(x).softmax(-1), self.top_k)
        flat, xs = ids.view(-1), x.repeat_interleave(self.top_k, dim=0)
        y = torch.empty_like(xs)
        for e, expert in enumerate(self.experts):
            if torch.any(flat == e):
                y[flat == e] = expert(xs[flat == e].unsqueeze(0))
        return (y.view(*weights.shape, -1) * weights.unsqueeze(-1)).sum(dim=1)


class ResidualStores(SlotStores):
    """GuardedStores with experts that add their rows back (OpenNMT-py's experts carry a residual)."""

    def forward(self, x):
        weights, ids = torch.topk(self.router(x).softmax(-1), self.top_k)
        flat, xs = ids.view(-1), x.repeat_interleave(self.top_k, dim=0)
        y = torch.empty_like(xs)
        for e, expert in enumerate(self.experts):
            if torch.any(flat == e):
                y[flat == e] = xs[flat == e] + expert(xs[flat == e])
        return (y.view(*weights.shape, -1) * weights.unsqueeze(-1)).sum(dim=1)


class IndexGuardedStores(SlotStores):
    """The guard tests indices: `any()` is false when the one index is 0, so that row's store is skipped."""

    def forward(self, x):
        weights, ids = torch.topk(self.router(x).softmax(-1), self.top_k)
        flat, xs = ids.view(-1), x.repeat_interleave(self.top_k, dim=0)
        y = torch.zeros_like(xs)
        for e, expert in enumerate(self.experts):
            rows = (flat == e).nonzero().squeeze(-1)
            if torch.any(rows):
                y[rows] = expert(xs[rows])
        return (y.view(*weights.shape, -1) * weights.unsqueeze(-1)).sum(dim=1)


@pytest.mark.parametrize("tokens", [6, 1], ids=["default", "decode"])
def test_slot_stores_are_fused_and_equal(tokens):
    torch.manual_seed(0)
    model, inputs = SlotStores().eval(), (torch.randn(tokens, 8),)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert (report.graph_count, report.graph_break_count, len(recorder.fused_nodes())) == (1, 0, 1), str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


@pytest.mark.parametrize(("variant", "reason"), [
    ("one_left_out", "leave some of its rows unwritten"),
    ("unweighted", "not summed per token with the routing weights"),
])
def test_slot_stores_the_probes_do_not_prove_are_declined(variant, reason):
    torch.manual_seed(0)
    model, inputs = SlotStores(variant=variant).eval(), (torch.randn(6, 8),)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert not recorder.fused_nodes() and any(reason in d.reason for d in report.declined), str(report)
    if variant != "one_left_out":  # the left-out expert's slots hold uninitialised memory in eager too
        assert_close_for_dtype(output, eager_output(model, inputs))


def _run(model_class):
    torch.manual_seed(0)
    model, inputs = model_class().eval(), (torch.randn(6, 8),)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert_close_for_dtype(output, eager_output(model, inputs))
    return report, len(recorder.fused_nodes())


def test_a_store_skipped_at_its_tested_mask_is_captured_and_fused():
    """`if torch.any(M): y[M] = v`: with no entry of M set the store writes nothing, so the guard goes."""
    report, fused = _run(GuardedStores)
    assert (report.graph_count, report.graph_break_count, fused) == (1, 0, 1), str(report)


def test_an_expert_with_its_own_residual_is_declined_as_such():
    report, fused = _run(ResidualStores)
    assert report.graph_count == 1 and not fused and "a residual" in report.declined[0].reason, str(report)


def test_a_guard_on_indices_is_kept():
    report, fused = _run(IndexGuardedStores)
    assert report.graph_break_count > 0 and not fused, str(report)


def test_slot_stores_train_like_eager():
    torch.manual_seed(0)
    report = backward_like_eager(SlotStores(), (torch.randn(6, 8),))
    assert len(report.fused) == 1, str(report)
