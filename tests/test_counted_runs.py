"""Loops over the runs of sorted expert ids with their counts (transformers' first AFMoE), and count loops
that store each expert's rows into a slice of a buffer (adapters/present_ids.counted_runs_as_counts,
adapters/count_loops.Sink).

    present, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    for e, n in zip(present.tolist(), counts.tolist()):
        out[start:start + n] = self[e](rows[start:start + n]) ...

is traced as a loop over every expert's count, fused; where the runs are not the experts' (unsorted ids) or
the id is read other than as the index of the experts, the loop is left as written, with eager's output.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import eager_output, run_hpu_moe, skip_unless_dynamo_slices_for, torch_release
from tests.loop_models import H, SeparateGatedExpert

E, K = 6, 2


class RunExperts(nn.ModuleList):
    """The experts as a ModuleList that dispatches to itself, as AFMoE writes it."""

    def __init__(self):
        super().__init__(SeparateGatedExpert() for _ in range(E))

    def forward(self, x, ids, weights):  # x [T, H]; ids, weights [B, S, k]
        token_of_slot = torch.arange(x.shape[0]).repeat_interleave(ids.shape[-1])
        flat_ids, flat_weights = ids.reshape(-1), weights.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        token_of_slot, flat_weights = token_of_slot[order], flat_weights[order]
        flat_ids = flat_ids[order]
        rows = x.index_select(0, token_of_slot)
        outputs = torch.zeros_like(rows)
        present, counts = torch.unique_consecutive(flat_ids, return_counts=True)
        start = 0
        for e, n in zip(present.tolist(), counts.tolist()):  # noqa: B905 - as AFMoE writes it
            if n == 0:
                continue
            end = start + n
            outputs[start:end] = self[e](rows[start:end])
            start = end
        return torch.zeros_like(x).scatter_add_(0, token_of_slot[:, None].expand_as(rows), outputs * flat_weights[:, None])


class UniqueRuns(RunExperts):
    """`torch.unique(..., return_counts=True)` (sorted by default), no zero-count skip written."""

    def forward(self, x, ids, weights):
        flat_ids = ids.reshape(-1)
        order = flat_ids.argsort()
        present, counts = flat_ids.unique(return_counts=True)
        rows = x[order // ids.shape[-1]]
        outputs = torch.zeros_like(rows)
        start = 0
        for e, n in zip(present, counts, strict=True):
            end = start + n
            outputs[start:end] = self[e](rows[start:end])
            start = end
        picked = outputs * weights.reshape(-1)[order][:, None]
        return torch.zeros_like(x).index_add_(0, order // ids.shape[-1], picked)


class UnsortedRuns(RunExperts):
    """Runs of ids in token order: the same expert may come back in several runs."""

    def forward(self, x, ids, weights):
        flat_ids, flat_weights = ids.reshape(-1), weights.reshape(-1)
        rows = x.repeat_interleave(ids.shape[-1], dim=0)
        outputs = torch.zeros_like(rows)
        present, counts = torch.unique_consecutive(flat_ids, return_counts=True)
        start = 0
        for e, n in zip(present.tolist(), counts.tolist(), strict=True):
            end = start + n
            outputs[start:end] = self[e](rows[start:end])
            start = end
        return (outputs * flat_weights[:, None]).view(x.shape[0], -1, H).sum(1)


class TestsTheId(RunExperts):
    """The id read other than as the index of the experts (the last expert is skipped)."""

    def forward(self, x, ids, weights):
        token_of_slot = torch.arange(x.shape[0]).repeat_interleave(ids.shape[-1])
        flat_ids, flat_weights = ids.reshape(-1), weights.reshape(-1)
        order = torch.argsort(flat_ids)
        token_of_slot, flat_weights = token_of_slot[order], flat_weights[order]
        flat_ids = flat_ids[order]
        rows = x.index_select(0, token_of_slot)
        outputs = torch.zeros_like(rows)
        present, counts = torch.unique_consecutive(flat_ids, return_counts=True)
        start = 0
        for e, n in zip(present.tolist(), counts.tolist(), strict=True):
            end = start + n
            if e != E - 1:
                outputs[start:end] = self[e](rows[start:end])
            start = end
        return torch.zeros_like(x).scatter_add_(0, token_of_slot[:, None].expand_as(rows), outputs * flat_weights[:, None])


class StoresThroughAnAlias(RunExperts):
    """The buffer is also read through another name after the loop: stored in place, not rebound."""

    def forward(self, x, ids, weights):
        flat_ids = ids.reshape(-1)
        order = flat_ids.argsort()
        present, counts = flat_ids.unique(return_counts=True)
        rows = x[order // ids.shape[-1]]
        outputs = torch.zeros_like(rows)
        seen = outputs
        start = 0
        for e, n in zip(present.tolist(), counts.tolist(), strict=True):
            end = start + n
            outputs[start:end] = self[e](rows[start:end])
            start = end
        picked = seen * weights.reshape(-1)[order][:, None]
        return torch.zeros_like(x).index_add_(0, order // ids.shape[-1], picked)


class ReadsTheRunAfter(RunExperts):
    """The last run's id read after the loop (the copy's loop would leave the last expert's)."""

    def forward(self, x, ids, weights):
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids)
        flat_ids = flat_ids[order]
        rows = x[order // ids.shape[-1]]
        outputs = torch.zeros_like(rows)
        present, counts = torch.unique_consecutive(flat_ids, return_counts=True)
        start = 0
        for e, n in zip(present.tolist(), counts.tolist(), strict=True):
            end = start + n
            outputs[start:end] = self[e](rows[start:end])
            start = end
        picked = outputs * weights.reshape(-1)[order][:, None] * (e + 1)
        return torch.zeros_like(x).index_add_(0, order // ids.shape[-1], picked)


class IdsChangedAfterTheSort(RunExperts):
    """The ids turned around in place between their argsort and the gather: no longer ascending."""

    def forward(self, x, ids, weights):
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids)
        flat_ids.mul_(-1).add_(E - 1)
        flat_ids = flat_ids[order]
        rows = x[order // ids.shape[-1]]
        outputs = torch.zeros_like(rows)
        present, counts = torch.unique_consecutive(flat_ids, return_counts=True)
        start = 0
        for e, n in zip(present.tolist(), counts.tolist(), strict=True):
            end = start + n
            outputs[start:end] = self[e](rows[start:end])
            start = end
        picked = outputs * weights.reshape(-1)[order][:, None]
        return torch.zeros_like(x).index_add_(0, order // ids.shape[-1], picked)


class EachTokensIdsSorted(RunExperts):
    """[T, k] ids sorted along each token's k: the runs are not the experts'."""

    def forward(self, x, ids, weights):
        rows = x.repeat_interleave(ids.shape[-1], dim=0)
        ids, _ = torch.sort(ids)
        outputs = torch.zeros_like(rows)
        present, counts = torch.unique_consecutive(ids, return_counts=True)
        start = 0
        for e, n in zip(present.tolist(), counts.tolist(), strict=True):
            end = start + n
            outputs[start:end] = self[e](rows[start:end])
            start = end
        return outputs.view(x.shape[0], -1, H).sum(1)


class EndMovedAgain(RunExperts):
    """A count loop whose end moves past a separator row: for an empty expert too, were the skip removed."""

    def forward(self, x, ids, weights):
        flat_ids = ids.reshape(-1)
        rows = torch.cat([x[flat_ids.argsort() // ids.shape[-1]], torch.zeros(E, H)])
        outputs = torch.zeros_like(rows)
        counts = F.one_hot(flat_ids, E).sum(0)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            end = start + n
            outputs[start:end] = self[e](rows[start:end])
            end = end + 1
            start = end
        return outputs.sum(0, keepdim=True) + x * 0


class EachTokensSlotsSorted(RunExperts):
    """An argsort along each token's k slots, read as if it sorted the flat ids."""

    def forward(self, x, ids, weights):
        order = torch.argsort(ids, dim=-1).reshape(-1)
        rows = x[order // K]
        outputs = torch.zeros_like(rows)
        counts = F.one_hot(ids.reshape(-1), E).sum(0)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            end = start + n
            outputs[start:end] = self[e](rows[start:end])
            start = end
        return torch.zeros_like(x).index_add_(0, order // K, outputs * weights.reshape(-1)[order][:, None])


class RunsMoE(nn.Module):
    def __init__(self, experts: type[RunExperts] = RunExperts):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = experts()

    def forward(self, x):  # [B, S, H], routed as [T, H] and handed on as [B, S, k] (AFMoE)
        weights, ids = self.router(x.view(-1, H)).softmax(-1).topk(K)
        weights = weights / weights.sum(-1, keepdim=True)
        routed = (*x.shape[:-1], K)
        return self.experts(x.view(-1, H), ids.view(routed), weights.view(routed)).view(x.shape)


@pytest.mark.parametrize("experts", [RunExperts, UniqueRuns])
def test_runs_of_sorted_ids_are_fused_and_equal(experts):
    torch.manual_seed(0)
    model, x = RunsMoE(experts), torch.randn(2, 5, H)
    report, output, recorder = run_hpu_moe(model, (x,))
    torch.testing.assert_close(output, eager_output(model, (x,)))
    skip_unless_dynamo_slices_for("deepseek_v2_count_loop")  # the adapted count loop cuts at counts read
    assert (report.graph_count, report.graph_break_count) == (1, 0), str(report)
    assert len(recorder.fused_nodes()) == 1, str(report)
    compiled = torch.compile(model, backend="hpu_moe", dynamic=True)
    with torch.no_grad():
        for tokens in (3, 8):
            y = torch.randn(1, tokens, H)
            torch.testing.assert_close(compiled(y), model(y))


def test_a_buffer_read_through_another_name_is_stored_in_place():
    torch.manual_seed(0)
    model, x = RunsMoE(StoresThroughAnAlias), torch.randn(2, 5, H)
    report, output, recorder = run_hpu_moe(model, (x,))
    torch.testing.assert_close(output, eager_output(model, (x,)))
    if torch_release() >= (2, 12):  # older dynamo cannot tell an in-place slice has the value's rows
        assert len(recorder.fused_nodes()) == 1, str(report)
    else:
        assert not recorder.fused_nodes(), str(report)


@pytest.mark.parametrize("experts", [UnsortedRuns, TestsTheId, ReadsTheRunAfter, IdsChangedAfterTheSort,
                                     EachTokensIdsSorted, EndMovedAgain, EachTokensSlotsSorted])
@pytest.mark.parametrize("seed", [0, 2])  # routings that leave different experts empty
def test_runs_that_are_not_the_experts_are_left_as_written(experts, seed):
    torch.manual_seed(seed)
    model, x = RunsMoE(experts), torch.randn(1, 2, H)  # 4 slots: some of the 6 experts hold none
    report, output, recorder = run_hpu_moe(model, (x,))
    assert not recorder.fused_nodes(), str(report)
    torch.testing.assert_close(output, eager_output(model, (x,)))


class SliceStoresAtOtherRows(RunExperts):
    """A count loop storing each expert's rows one row past its cut: not the rows the count cuts."""

    def forward(self, x, ids, weights):
        flat_ids = ids.reshape(-1)
        order = flat_ids.argsort()
        rows = x[order // ids.shape[-1]]
        outputs = torch.zeros(rows.shape[0] + 1, H)
        counts = F.one_hot(flat_ids, E).sum(0)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            end = start + n
            outputs[start + 1:end + 1] = self[e](rows[start:end])
            start = end
        picked = outputs[1:] * weights.reshape(-1)[order][:, None]
        return torch.zeros_like(x).index_add_(0, order // ids.shape[-1], picked)


def test_a_store_off_the_cut_rows_keeps_the_skip_named():
    torch.manual_seed(0)
    model = RunsMoE(SliceStoresAtOtherRows)
    x = torch.randn(2, 5, H)
    report, output, recorder = run_hpu_moe(model, (x,))
    assert not recorder.fused_nodes(), str(report)
    assert "not at the rows cut between the running offset" in str(report), str(report)
    torch.testing.assert_close(output, eager_output(model, (x,)))
