"""Loops over chunks of an expert's rows (adapters/chunk_loops.py): run once where what `torch.where` read is no
larger than a chunk and the body accumulates once at the chunk's rows, as written otherwise (and the expert loop
around them with them where the body is not shown to)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import assert_close_for_dtype, eager_output, run_hpu_moe
from tests.loop_models import GatedExpert


class ChunkedHitLoop(torch.nn.Module):
    """MiniMax-M2's remote code: a flattened hit list read to the host, then each expert's rows in chunks,
    the expert's output scaled in place, temporaries deleted."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(8, 4, bias=False)
        self.experts = torch.nn.ModuleList(GatedExpert(8) for _ in range(4))

    def forward(self, x):
        weights, ids = torch.topk(self.gate(x).softmax(-1), 2)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=4).permute(2, 1, 0)
        hit = torch.nonzero(mask.sum(dim=(-1, -2)) > 0, as_tuple=False).flatten()
        chunk_size = 64  # as large as what torch.where reads (2 slots x 9 tokens): one chunk
        for e in hit.tolist():
            expert = self.experts[e]
            slot_all, token_all = torch.where(mask[e].squeeze(0))
            for i in range(0, token_all.size(0), chunk_size):
                token = token_all[i : i + chunk_size]
                slot = slot_all[i : i + chunk_size]
                y = expert(x.index_select(0, token))
                y.mul_(weights[token, slot].unsqueeze(-1))
                out.index_add_(0, token, y.to(out.dtype))
                del y, token, slot
            del slot_all, token_all
        del hit
        return out


class ChunkedRangeLoop(ChunkedHitLoop):
    """The same chunks in a loop over every expert, the chunk size a literal."""

    def forward(self, x):
        weights, ids = torch.topk(self.gate(x).softmax(-1), 2)
        out = torch.zeros_like(x)
        for e in range(4):
            token_all, slot_all = torch.where(ids == e)
            for start in range(0, len(token_all), 64):
                token = token_all[start : start + 64]
                out.index_add_(0, token, self.experts[e](x[token]) * weights[token, slot_all[start : start + 64], None])
        return out


class SmallChunks(ChunkedHitLoop):
    """Chunks of 2 rows: an expert's rows may take several, so the loop runs as written."""

    def forward(self, x):
        weights, ids = torch.topk(self.gate(x).softmax(-1), 2)
        out = torch.zeros_like(x)
        for e in range(4):
            token_all, slot_all = torch.where(ids == e)
            for start in range(0, len(token_all), 2):
                token = token_all[start : start + 2]
                out.index_add_(0, token, self.experts[e](x[token]) * weights[token, slot_all[start : start + 2], None])
        return out


@pytest.mark.parametrize("cls", [ChunkedHitLoop, ChunkedRangeLoop], ids=lambda c: c.__name__)
def test_a_loop_over_chunks_of_the_rows_runs_as_one_and_is_fused(cls):
    torch.manual_seed(0)
    model, inputs = cls().eval(), (torch.randn(9, 8),)  # 9 tokens, top-2 of 4: most experts over 2 chunks
    report, output, recorder = run_hpu_moe(model, inputs)
    assert (report.graph_count, report.graph_break_count, len(recorder.fused_nodes())) == (1, 0, 1), str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


class MixesRowsOfAChunk(ChunkedHitLoop):
    """Centres each chunk's output on its mean: a value of the chunk, not of each row (chunking matters where
    there are several)."""

    def forward(self, x):
        weights, ids = torch.topk(self.gate(x).softmax(-1), 2)
        out = torch.zeros_like(x)
        for e in range(4):
            token_all, slot_all = torch.where(ids == e)
            for start in range(0, len(token_all), 2):
                token = token_all[start : start + 2]
                y = self.experts[e](x[token])
                out.index_add_(0, token, y - y.mean(0))
        return out


class ReadsTheChunkStart(ChunkedHitLoop):
    """Scales by the chunk's position: the chunk start read other than as a slice bound."""

    def forward(self, x):
        weights, ids = torch.topk(self.gate(x).softmax(-1), 2)
        out = torch.zeros_like(x)
        for e in range(4):
            token_all, slot_all = torch.where(ids == e)
            for start in range(0, len(token_all), 2):
                token = token_all[start : start + 2]
                out.index_add_(0, token, self.experts[e](x[token]) * (start + 1))
        return out


class ScalesAnOuterTensorInPlace(ChunkedHitLoop):
    """An in-place op on a tensor made before the loop: it acts for every chunk, whatever the rows."""

    def forward(self, x):
        weights, ids = torch.topk(self.gate(x).softmax(-1), 2)
        out = torch.zeros_like(x)
        scale = torch.ones(1)
        for e in range(4):
            token_all, slot_all = torch.where(ids == e)
            for start in range(0, len(token_all), 2):
                token = token_all[start : start + 2]
                scale.mul_(1.5)
                out.index_add_(0, token, self.experts[e](x[token]) * scale)
        return out


class MixesRowsInOneChunk(ChunkedHitLoop):
    """Centres the chunk's output on its mean, in chunks as large as what torch.where reads: one chunk."""

    def forward(self, x):
        weights, ids = torch.topk(self.gate(x).softmax(-1), 2)
        out = torch.zeros_like(x)
        for e in range(4):
            token_all, slot_all = torch.where(ids == e)
            for start in range(0, len(token_all), 64):
                token = token_all[start : start + 64]
                y = self.experts[e](x[token])
                out.index_add_(0, token, y - y.mean(0))
        return out


class AddsEveryRowPerChunk(ChunkedHitLoop):
    """Adds all the expert's rows once per chunk (nothing sliced): as many times as there are chunks."""

    def forward(self, x):
        weights, ids = torch.topk(self.gate(x).softmax(-1), 2)
        out = torch.zeros_like(x)
        for e in range(4):
            token_all, slot_all = torch.where(ids == e)
            y = self.experts[e](x[token_all]) * weights[token_all, slot_all, None]
            for _start in range(0, len(token_all), 64):
                out.index_add_(0, token_all, y)
        return out


@pytest.mark.parametrize("cls", [MixesRowsInOneChunk, AddsEveryRowPerChunk], ids=lambda c: c.__name__)
def test_a_chunk_loop_run_once_is_exact_whatever_its_body_computes(cls):
    torch.manual_seed(0)
    model, inputs = cls().eval(), (torch.randn(9, 8),)
    report, output, _ = run_hpu_moe(model, inputs)
    assert (report.graph_count, report.graph_break_count) == (1, 0), str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


class CarriesAValueAcrossChunks(ChunkedHitLoop):
    """Doubles a scale at each chunk through a walrus: the body binds a name the next chunk reads."""

    def forward(self, x):
        weights, ids = torch.topk(self.gate(x).softmax(-1), 2)
        out = torch.zeros_like(x)
        scale = 1.0
        for e in range(4):
            token_all, slot_all = torch.where(ids == e)
            for start in range(0, len(token_all), 64):
                token = token_all[start : start + 64]
                out.index_add_(0, token, self.experts[e](x[token]) * (scale := scale * 2))
        return out


class RowsBoundAgain(ChunkedHitLoop):
    """Slices a rows name bound again, longer than the length the range reads."""

    def forward(self, x):
        weights, ids = torch.topk(self.gate(x).softmax(-1), 2)
        out = torch.zeros_like(x)
        for e in range(4):
            slot_all, token_all = torch.where(ids.t() == e)
            token_all = torch.cat([token_all, token_all])
            for start in range(0, slot_all.size(0), 64):
                token = token_all[start : start + 64]
                out.index_add_(0, token, self.experts[e](x[token]))
        return out


@pytest.mark.parametrize("cls", [SmallChunks, MixesRowsOfAChunk, ReadsTheChunkStart, ScalesAnOuterTensorInPlace,
                                 CarriesAValueAcrossChunks, RowsBoundAgain], ids=lambda c: c.__name__)
def test_a_chunk_loop_not_shown_to_run_once_stays_as_written(cls):
    torch.manual_seed(0)
    model, inputs = cls().eval(), (torch.randn(9, 8),)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert not recorder.fused_nodes(), str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


class FlattenedHitOfTwoDims(torch.nn.Module):
    """A flattened hit list of a 2-D test: every coordinate (expert, slot), in order, each indexing an expert
    (odd but valid; the hit test is not one flag per expert, so the copy must keep what is written)."""

    def __init__(self):
        super().__init__()
        self.experts = torch.nn.ModuleList(GatedExpert(8) for _ in range(4))

    def forward(self, x, ids):
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=4).permute(2, 1, 0)
        hit = torch.nonzero(mask.sum(-1) > 0).flatten()
        for e in hit.tolist():
            slot, token = torch.where(mask[e])
            out.index_add_(0, token, self.experts[e](x[token]))
        return out


def test_a_flattened_hit_list_keeps_every_coordinate_where_the_test_is_not_one_flag_per_expert():
    torch.manual_seed(0)
    ids = torch.tensor([[3, 1], [2, 3], [3, 0]])
    model, inputs = FlattenedHitOfTwoDims().eval(), (torch.randn(3, 8), ids)
    _, output, _ = run_hpu_moe(model, inputs)
    assert_close_for_dtype(output, eager_output(model, inputs))
