"""Loops over the expert ids present (`for e in ids.unique().tolist():`), written afresh in the spellings
hand-written MoE code uses: run over every expert in one graph and fused where the body's proof holds,
left as written (and equal to eager) where it does not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_passes.adapters import hit_expert_loops
from tests.helpers import assert_close_for_dtype, eager_output, run_hpu_moe

H, E, K = 8, 4, 2


class Expert(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Linear(H, 2 * H, bias=False)
        self.w3 = torch.nn.Linear(H, 2 * H, bias=False)
        self.w2 = torch.nn.Linear(2 * H, H, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class PresentIds(torch.nn.Module):
    """`for e in ids.unique().tolist()` with `index_add_` at `torch.where(ids == e)`."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(H, E, bias=False)
        self.experts = torch.nn.ModuleList(Expert() for _ in range(E))

    def route(self, x):
        weights, ids = torch.topk(self.gate(x).softmax(-1), K)
        return weights / weights.sum(-1, keepdim=True), ids

    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            token, slot = torch.where(ids == e)
            out.index_add_(0, token, self.experts[e](x[token]) * w[token, slot, None])
        return out


class PresentIdsTensor(PresentIds):
    """`torch.unique(ids, sorted=True)`: 0-dim tensors index the experts; `+=` at the rows."""

    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in torch.unique(ids, sorted=True):
            token, slot = torch.where(ids == e)
            out[token] += self.experts[e](x[token]) * w[token, slot, None]
        return out


class PresentIdsEmptySkip(PresentIds):
    """`if token.numel() == 0: continue` cannot hold for a present id, and is removed as for a range loop."""

    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in ids.flatten().cpu().unique().tolist():
            token, slot = torch.where(ids == e)
            if token.numel() == 0:
                continue
            out.index_add_(0, token, self.experts[e](x[token]) * w[token, slot, None])
        return out


class SortedSetOfIds(PresentIds):
    """`sorted(set(ids.flatten().tolist()))`: the distinct ids, ascending, as Python ints."""

    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in sorted(set(ids.flatten().tolist())):
            token, slot = torch.where(ids == e)
            expert = self.experts[e]
            out.index_add_(0, token, expert(x[token]) * w[token, slot, None])
        return out


class UnsortedUnique(PresentIds):
    """`unique(sorted=False)`: an order the copy cannot promise. Kept."""

    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in ids.unique(sorted=False).tolist():
            token, slot = torch.where(ids == e)
            out.index_add_(0, token, self.experts[e](x[token]) * w[token, slot, None])
        return out


class UnsortedSet(PresentIds):
    """`set(ids.tolist())`: an order the copy cannot promise. Kept."""

    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in set(ids.flatten().tolist()):
            token, slot = torch.where(ids == e)
            out.index_add_(0, token, self.experts[e](x[token]) * w[token, slot, None])
        return out


class IdReadAsANumber(PresentIds):
    """The id scales the output: a Python int and a tensor id differ in type there. Kept."""

    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            token, slot = torch.where(ids == e)
            out.index_add_(0, token, self.experts[e](x[token]) * w[token, slot, None] * (e + 1))
        return out


class RowsOfOtherIds(PresentIds):
    """The rows come from the first slot's ids, the loop from all: an absent first-slot id may still add. Kept."""

    def forward(self, x):
        w, ids = self.route(x)
        first, second = ids[:, 0], ids[:, 1]
        out = torch.zeros_like(x)
        for e in second.unique().tolist():
            (token,) = torch.where(first == e)
            out.index_add_(0, token, self.experts[e](x[token]) * w[token, 0, None])
        return out


class GivenIds(PresentIds):
    """Ids handed in from outside the layer: nothing bounds them to the experts."""

    def forward(self, x, ids, w):
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            token, slot = torch.where(ids == e)
            out.index_add_(0, token, self.experts[e](x[token]) * w[token, slot, None])
        return out


@pytest.mark.parametrize("tokens", [6, 1], ids=["default", "decode"])
@pytest.mark.parametrize("cls", [PresentIds, PresentIdsTensor, PresentIdsEmptySkip, SortedSetOfIds],
                         ids=lambda c: c.__name__)
def test_a_loop_over_the_ids_present_is_fused_in_one_graph(cls, tokens):
    torch.manual_seed(0)
    model = cls().eval()
    inputs = (torch.randn(tokens, H),)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert (report.graph_count, report.graph_break_count) == (1, 0), str(report)
    assert len(recorder.fused_nodes()) == 1, str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


@pytest.mark.parametrize(
    ("cls", "reason"),
    [(UnsortedUnique, None), (UnsortedSet, None), (IdReadAsANumber, "used other than compared"), (RowsOfOtherIds, "are not `torch.where(")],
    ids=lambda c: getattr(c, "__name__", ""),
)
def test_a_loop_the_source_does_not_prove_runs_as_written(cls, reason):
    torch.manual_seed(0)
    model = cls().eval()
    inputs = (torch.randn(6, H),)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert report.graph_break_count > 0 and not recorder.fused_nodes(), str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))
    declined = hit_expert_loops.declined_classes().get(f"{cls.__module__}.{cls.__qualname__}")
    assert (declined is None) if reason is None else (reason in declined), declined


def test_an_id_past_the_experts_raises_at_run_time():
    """The original raised on `self.experts[e]`; the loop over every expert must not skip that id."""
    torch.manual_seed(0)
    model = GivenIds().eval()
    x, w = torch.randn(5, H), torch.rand(5, K)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [0, 3], [3, 1]])
    report, output, _ = run_hpu_moe(model, (x, ids, w))
    assert report.graph_break_count == 0, str(report)
    assert_close_for_dtype(output, eager_output(model, (x, ids, w)))
    bad = ids.clone()
    bad[4, 0] = E
    with pytest.raises(IndexError):
        model(x, bad, w)
    with pytest.raises(RuntimeError, match="outside 0..number of experts"):
        torch.compile(model, backend="hpu_moe", options={"target": "portable"})(x, bad, w)
