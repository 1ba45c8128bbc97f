"""Loops over the expert ids present (`for e in ids.unique().tolist():`), written afresh in the spellings
hand-written MoE code uses: run over every expert in one graph and fused where the body's proof holds,
left as written (and equal to eager) where it does not."""

from __future__ import annotations

import pytest
import torch

from moe_passes.adapters import hit_expert_loops
from tests.helpers import assert_close_for_dtype, eager_output, run_hpu_moe
from tests.loop_models import E, H, K, PresentIds


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


class RowsOfEveryToken(PresentIds):
    """Every token's row, weighted by whether it chose the id: the rows are not the id's, so an absent
    id would be visited. Kept (the proof needs the rows of `ids == e`)."""

    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            token, slot = torch.where(ids == e)
            (every,) = torch.where(w[:, 0] >= 0)
            chose = torch.zeros_like(w).index_put((token, slot), w[token, slot]).sum(-1, keepdim=True)
            out.index_add_(0, every, self.experts[e](x[every]) * chose)
        return out


class IdReadAfterTheLoop(PresentIds):
    """The loop variable read after the loop: the last id present, not the last expert. Kept."""

    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            token, slot = torch.where(ids == e)
            out.index_add_(0, token, self.experts[e](x[token]) * w[token, slot, None])
        return out * (e + 1)


class SetOfTensors(PresentIds):
    """`sorted(set(ids.flatten()))`: 0-dim tensors hash by identity, so every slot's id stays and its
    expert runs once per occurrence. Kept."""

    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in sorted(set(ids.flatten())):
            token, slot = torch.where(ids == e)
            out.index_add_(0, token, self.experts[e](x[token]) * w[token, slot, None])
        return out


class ZeroComputationExpert(PresentIds):
    """A router over the experts and one identity expert with the next id (LongCat's zero-computation
    experts): the test `e == self.routed` singles out an id no expert holds. Kept."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(H, E + 1, bias=False)
        self.routed = E

    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            token, slot = torch.where(ids == e)
            y = x[token] if e == self.routed else self.experts[e](x[token])
            out.index_add_(0, token, y * w[token, slot, None])
        return out


class GivenIds(PresentIds):
    """Ids handed in from outside the layer: nothing bounds them to the experts."""

    def forward(self, x, ids, w):
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            token, slot = torch.where(ids == e)
            out.index_add_(0, token, self.experts[e](x[token]) * w[token, slot, None])
        return out


class ParallelListsOverUnique(torch.nn.Module):
    """LLMs-from-scratch's spelling: `torch.unique` bound to a name, the id read as `int(t.item())`, a skip
    `if not (ids == e).any()`, the tokens as `(ids == e).any(-1).nonzero()`, the expert as three parallel
    ModuleLists, the weight at the slot `argmax` finds, routing left [B, S, k] beside its [T, k] view."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(H, E, bias=False)
        self.fc1 = torch.nn.ModuleList(torch.nn.Linear(H, 2 * H, bias=False) for _ in range(E))
        self.fc2 = torch.nn.ModuleList(torch.nn.Linear(H, 2 * H, bias=False) for _ in range(E))
        self.fc3 = torch.nn.ModuleList(torch.nn.Linear(2 * H, H, bias=False) for _ in range(E))

    def forward(self, x):
        logits, ids = torch.topk(self.gate(x), K, dim=-1)
        probs = torch.softmax(logits, dim=-1).reshape(-1, K)
        flat_ids, x_flat = ids.reshape(-1, K), x.reshape(-1, x.shape[-1])
        out = torch.zeros_like(x_flat)
        present = torch.unique(flat_ids)
        for e_tensor in present:
            e = int(e_tensor.item())
            mask = flat_ids == e
            if not mask.any():
                continue
            rows = mask.any(dim=-1).nonzero(as_tuple=False).squeeze(-1)
            if rows.numel() == 0:
                continue
            h = x_flat.index_select(0, rows)
            y = self.fc3[e](torch.nn.functional.silu(self.fc1[e](h)) * self.fc2[e](h))
            slot = mask[rows].int().argmax(dim=-1, keepdim=True)
            weight = torch.gather(probs.index_select(0, rows), dim=-1, index=slot).squeeze(-1)
            out.index_add_(0, rows, y * weight.unsqueeze(-1))
        return out.reshape(x.shape)


class IdsChangedAfterUnique(ParallelListsOverUnique):
    """The ids changed in place between `torch.unique` and the loop: the loop visits the ids as they were.
    Kept."""

    def forward(self, x):
        logits, ids = torch.topk(self.gate(x), K, dim=-1)
        probs = torch.softmax(logits, dim=-1)
        out = torch.zeros_like(x)
        present = torch.unique(ids)
        ids.add_(1).remainder_(E)
        for e in present:
            token, slot = torch.where(ids == e)
            out.index_add_(0, token, self.fc3[e](self.fc1[e](x[token])) * probs[token, slot, None])
        return out


class TensorReadBesideItsNumber(ParallelListsOverUnique):
    """The 0-dim id scales the output beside its `int(t.item())` alias. Kept."""

    def forward(self, x):
        logits, ids = torch.topk(self.gate(x), K, dim=-1)
        probs = torch.softmax(logits, dim=-1)
        out = torch.zeros_like(x)
        for t in torch.unique(ids):
            e = int(t.item())
            token, slot = torch.where(ids == e)
            out.index_add_(0, token, self.fc3[e](self.fc1[e](x[token])) * probs[token, slot, None] * t)
        return out


def test_a_loop_over_unique_ids_read_as_numbers_into_parallel_lists_is_fused():
    torch.manual_seed(0)
    model, inputs = ParallelListsOverUnique().eval(), (torch.randn(2, 3, H),)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert (report.graph_count, report.graph_break_count, len(recorder.fused_nodes())) == (1, 0, 1), str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


@pytest.mark.parametrize(("cls", "reason"), [(IdsChangedAfterUnique, None),
                                             (TensorReadBesideItsNumber, "is read beside its alias")],
                         ids=lambda c: getattr(c, "__name__", ""))
def test_a_loop_over_unique_ids_the_source_does_not_prove_runs_as_written(cls, reason):
    torch.manual_seed(0)
    model, inputs = cls().eval(), (torch.randn(1, H),)  # one token: the ids changed are not the ids present
    report, output, recorder = run_hpu_moe(model, inputs)
    assert not recorder.fused_nodes(), str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))
    declined = hit_expert_loops.declined_classes().get(f"{cls.__module__}.{cls.__qualname__}")
    assert (declined is None) if reason is None else (reason in declined), declined


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
    [(UnsortedUnique, None), (UnsortedSet, None), (SetOfTensors, None), (IdReadAsANumber, "used other than in"),
     (RowsOfEveryToken, "are not `torch.where("), (IdReadAfterTheLoop, "read outside the loop"),
     (ZeroComputationExpert, "used other than in")],
    ids=lambda c: getattr(c, "__name__", ""),
)
def test_a_loop_the_source_does_not_prove_runs_as_written(cls, reason):
    torch.manual_seed(0)
    model = cls().eval()
    inputs = (torch.randn(6 if cls is not ZeroComputationExpert else 16, H),)
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
    with pytest.raises(RuntimeError, match="negative or past the experts"):
        torch.compile(model, backend="hpu_moe", options={"target": "portable"})(x, bad, w)
