"""Experts that store their outputs into a copy of the tokens (HF Switch Transformers 4.x).

    next_states = hidden_states.clone()
    for e in range(E):
        next_states[mask[:, e]] = experts[e](hidden_states[mask[:, e]])
    out = p_max[:, None] * next_states

Every old row is replaced where each token is stored by one expert (top-1, nothing dropped): fused. Where
a routing leaves a token to no expert (a capacity, a threshold), that token keeps its input, which the
kernel does not compute: declined, naming the copy.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import eager_output, run_hpu_moe

H, INTER, E, T = 16, 24, 4, 12


class GatedExpert(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, INTER, bias=False)
        self.up = nn.Linear(H, INTER, bias=False)
        self.down = nn.Linear(INTER, H, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class StoresIntoACopy(nn.Module):
    """Top-1 by argmax; `capacity` None keeps every token, else tokens past it keep their input."""

    def __init__(self, capacity: int | None = None, top_k: int = 1, start: str = "clone", local: int = E):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(GatedExpert() for _ in range(local))
        self.capacity, self.top_k, self.start = capacity, top_k, start

    def forward(self, x):
        probs = F.softmax(self.router(x), dim=-1)
        top, ids = probs.topk(self.top_k, dim=-1)
        mask = F.one_hot(ids, E).sum(1)
        if self.capacity is not None:
            mask = mask * (torch.cumsum(mask, dim=0) <= self.capacity)
        mask = mask.bool()
        out = {"clone": x.clone, "ones": lambda: torch.ones_like(x)}[self.start]()
        for e in range(len(self.experts)):
            out[mask[:, e]] = self.experts[e](x[mask[:, e]])
        return out * top.sum(-1, keepdim=True)


def _run(model):
    torch.manual_seed(1)
    x = torch.randn(T, H)
    report, output, _ = run_hpu_moe(model, (x,))
    torch.testing.assert_close(output, eager_output(model, (x,)))
    return report


def test_top1_stores_into_a_copy_of_the_tokens_are_fused():
    torch.manual_seed(0)
    report = _run(StoresIntoACopy())
    assert [f.top_k for f in report.fused] == [1] and not report.declined, str(report)


def test_a_buffer_of_other_values_is_fused_too():
    torch.manual_seed(0)
    report = _run(StoresIntoACopy(start="ones"))
    assert [f.top_k for f in report.fused] == [1] and not report.declined, str(report)


def test_tokens_past_a_capacity_keep_their_input_and_are_declined():
    torch.manual_seed(0)
    report = _run(StoresIntoACopy(capacity=2))
    assert not report.fused and report.declined, str(report)
    assert "capacity" in report.declined[0].reason, str(report)


def test_tokens_of_experts_outside_the_loop_keep_their_input_and_are_declined():
    """A range of the experts stores into the copy: the other experts' tokens keep their input (with
    zeros, that range would be fused as the kernel's experts_min..experts_max)."""
    torch.manual_seed(0)
    report = _run(StoresIntoACopy(local=E - 1))
    assert not report.fused and report.declined, str(report)
    assert "keeps the old value" in report.declined[0].reason, str(report)


@pytest.mark.parametrize("top_k", [2])
def test_stores_under_top_k_are_declined(top_k):
    torch.manual_seed(0)
    report = _run(StoresIntoACopy(top_k=top_k))
    assert not report.fused and report.declined, str(report)


class ColumnHitList(nn.Module):
    """Switch Transformers 4.x as its authors write it: a [B, S, E] boolean mask, the hit experts as a
    Python list of the mask's non-empty columns, experts in a ModuleDict, stores into a [B, S, H] buffer,
    the router's probability applied after the loop."""

    def __init__(self, start: str = "zeros"):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleDict({f"expert_{i}": GatedExpert() for i in range(E)})
        self.start = start

    def route(self, hidden_states):
        probs = F.softmax(self.router(hidden_states), dim=-1)
        router_probs, expert_index = probs.max(dim=-1, keepdim=True)
        next_states = torch.zeros_like(hidden_states) if self.start == "zeros" else hidden_states.clone()
        return F.one_hot(expert_index.squeeze(-1), E), router_probs, next_states

    def forward(self, hidden_states):
        router_mask, router_probs, next_states = self.route(hidden_states)
        router_mask = router_mask.bool()
        batch_size, seq_len, num_experts = router_mask.shape
        idx_mask = router_mask.reshape(batch_size * seq_len, num_experts).sum(dim=0)
        idx_mask = torch.nonzero(idx_mask, as_tuple=True)[0].tolist()
        for idx in idx_mask:
            next_states[router_mask[:, :, idx]] = getattr(self.experts, f"expert_{idx}")(
                hidden_states[router_mask[:, :, idx]])
        return router_probs * next_states


class ColumnHitListOverDims(ColumnHitList):
    def forward(self, hidden_states):
        router_mask, router_probs, next_states = self.route(hidden_states)
        router_mask = router_mask.bool()
        _, _, num_experts = router_mask.shape
        counts = router_mask.sum(dim=(0, 1))
        hit = counts.nonzero(as_tuple=True)[0].tolist()
        for e in hit:
            next_states[router_mask[:, :, e]] = self.experts[f"expert_{e}"](hidden_states[router_mask[:, :, e]])
        return router_probs * next_states


class RowCountHitList(ColumnHitList):
    """Counts per token, cut to E entries: not the columns' counts."""

    def forward(self, hidden_states):
        router_mask, router_probs, next_states = self.route(hidden_states)
        router_mask = router_mask.bool()
        batch_size, seq_len, num_experts = router_mask.shape
        idx_mask = router_mask.reshape(batch_size * seq_len, num_experts).sum(dim=1)[:num_experts]
        idx_mask = torch.nonzero(idx_mask, as_tuple=True)[0].tolist()
        for idx in idx_mask:
            next_states[router_mask[:, :, idx]] = getattr(self.experts, f"expert_{idx}")(
                hidden_states[router_mask[:, :, idx]])
        return router_probs * next_states


@pytest.mark.parametrize(("cls", "start"), [(ColumnHitList, "zeros"), (ColumnHitListOverDims, "zeros"),
                                            (ColumnHitList, "clone")])
def test_a_hit_list_over_mask_columns_is_fused(cls, start):
    torch.manual_seed(0)
    model = cls(start)
    x = torch.randn(2, 5, H)
    report, output, _ = run_hpu_moe(model, (x,))
    assert report.graph_break_count == 0 and [f.top_k for f in report.fused] == [1], str(report)
    torch.testing.assert_close(output, eager_output(model, (x,)))


def test_a_hit_list_of_other_counts_is_left_as_written():
    """The loop keeps its list (a graph break), and the output is eager's."""
    torch.manual_seed(0)
    model = RowCountHitList()
    x = torch.randn(2, 5, H)
    report, output, _ = run_hpu_moe(model, (x,))
    assert not report.fused and report.graph_break_count > 0, str(report)
    torch.testing.assert_close(output, eager_output(model, (x,)))


class HandedInIds(nn.Module):
    """Ids from outside the graph may hold a drop sentinel (E): that token keeps its input in a copy."""

    def __init__(self, start: str):
        super().__init__()
        self.experts = nn.ModuleList(GatedExpert() for _ in range(E))
        self.start = start

    def forward(self, x, ids, top):
        out = x.clone() if self.start == "clone" else torch.zeros_like(x)
        for e in range(E):
            m = ids == e
            out[m] = self.experts[e](x[m])
        return out * top[:, None]


@pytest.mark.parametrize("start", ["clone", "zeros"])
def test_ids_handed_in_are_not_taken_to_cover_a_copy(start):
    """Into a copy, the passes cannot show every id names an expert: declined. Into zeros, a sentinel
    adds nothing, as in the kernel's range: fused."""
    torch.manual_seed(0)
    model = HandedInIds(start)
    x, top = torch.randn(T, H), torch.rand(T)
    ids = torch.randint(0, E, (T,))
    ids[::3] = E
    report, output, _ = run_hpu_moe(model, (x, ids, top))
    torch.testing.assert_close(output, eager_output(model, (x, ids, top)))
    if start == "clone":
        assert not report.fused and "not a choice made in this graph" in report.declined[0].reason, str(report)
    else:
        assert [f.top_k for f in report.fused] == [1], str(report)


class ColumnsOfTheWrongAxis(ColumnHitList):
    """`M.sum(dim=0)` of a [B, S, E] mask is [S, E], not the columns' counts; rows `M[:, idx]`."""

    def forward(self, hidden_states):
        router_mask, router_probs, next_states = self.route(hidden_states)
        router_mask = router_mask.bool()
        batch_size, seq_len, num_experts = router_mask.shape
        counts = router_mask.sum(dim=0)
        hit = torch.nonzero(counts, as_tuple=True)[0].tolist()
        for idx in hit:
            next_states[router_mask[:, idx]] = getattr(self.experts, f"expert_{idx}")(
                hidden_states[router_mask[:, idx]])
        return router_probs * next_states


def test_counts_over_other_axes_than_the_mask_has_are_left_as_written():
    torch.manual_seed(0)
    model = ColumnsOfTheWrongAxis("clone")
    x = torch.randn(2, E, H)  # S == E: every index the loop reads exists
    report, output, _ = run_hpu_moe(model, (x,))
    assert not report.fused, str(report)
    torch.testing.assert_close(output, eager_output(model, (x,)))
