"""Expert loops that select tokens with a boolean mask and read weights from the router's whole table.

Written the way hand-written MoE code spells them, not the way transformers does:

    best = probs.argmax(-1)                                  # Switch-style top-1, ids of shape [T]
    for e in range(E):
        mask = best == e
        out[mask] = self.experts[e](x[mask]) * probs[mask, e, None]   # a store at a mask, not an add

The expert-loop adapter captures the mask gathers (a nonzero underneath) in one graph; the sparse-loop
finder reads the store as an accumulation only where no other expert writes the same rows (checked on
the probe routings), and the weights as the table read at the ids. Each case also runs with
`backend="eager"`'s output as the reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import SwiGLU, backward_like_eager, eager_output, run_hpu_moe

E, H, INTER = 4, 16, 8


class Routed(nn.Module):
    """A router and E experts; subclasses spell the loop."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(SwiGLU(H, INTER) for _ in range(E))


class SwitchTop1(Routed):
    """Top-1 by argmax; each expert stores its output at its tokens' mask."""

    def forward(self, x):
        probs = self.router(x).softmax(-1)
        best = probs.argmax(-1)
        out = torch.zeros_like(x)
        for e in range(E):
            mask = best == e
            out[mask] = self.experts[e](x[mask]) * probs[mask, e, None]
        return out


class OverlappingStores(Routed):
    """Top-2 with stores: a token in two experts' masks keeps only the second expert's output."""

    def forward(self, x):
        probs = self.router(x).softmax(-1)
        top = probs.topk(2, dim=-1).indices
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            chose = (top == e).any(dim=-1)
            out[chose] = expert(x[chose]) * probs[chose, e].unsqueeze(-1)
        return out


class TableWeights(Routed):
    """Top-2 without renormalisation: rows by nonzero, weights read from the softmax table."""

    def __init__(self, shift: int = 0):
        super().__init__()
        self.shift = shift  # read another expert's column: not the routing the experts got

    def forward(self, x):
        probs = F.softmax(self.router(x), dim=-1)
        _, chosen = probs.topk(2, dim=-1)
        acc = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = torch.nonzero((chosen == e).any(dim=-1)).squeeze(-1)
            column = (e + self.shift) % E
            acc.index_add_(0, rows, expert(x[rows]) * probs[rows, column].unsqueeze(1))
        return acc


class DenseMaskedTable(Routed):
    """Every expert on every token, scaled by its table column and by whether the token chose it."""

    def forward(self, x):
        probs = self.router(x).softmax(-1)
        top = probs.topk(2, dim=-1).indices
        out = torch.zeros_like(x)
        for e in range(E):
            chose = (top == e).any(-1, keepdim=True)
            out = out + self.experts[e](x) * probs[:, e : e + 1] * chose
        return out


class TopKRouted(Routed):
    """Softmax top-2, renormalised: the routing the next spellings read."""

    def route(self, x):
        weights, ids = self.router(x).softmax(-1).topk(2, dim=-1)
        return weights / weights.sum(-1, keepdim=True), ids


class BoolTableByScatter(TopKRouted):
    """A boolean table made with `dtype=torch.bool` and scattered into; its column picks the tokens."""

    def forward(self, x):
        weights, ids = self.route(x)
        routed = torch.zeros(x.size(0), E, dtype=torch.bool, device=x.device).scatter_(1, ids, True)
        gates = torch.zeros(x.size(0), E, dtype=x.dtype, device=x.device).scatter_(1, ids, weights)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            chose = routed[:, e]
            out[chose] += expert(x[chose]) * gates[chose, e : e + 1]
        return out


class WeightAboveZero(TopKRouted):
    """The expert's weight per token, summed over the slots of its mask; its tokens where it is positive."""

    def forward(self, x):
        weights, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in range(E):
            weight = ((ids == e) * weights).sum(-1)
            rows = weight > 0
            out[rows] += self.experts[e](x[rows]) * weight[rows, None]
        return out


class AddedAsAStore(TopKRouted):
    """`out[m] = out[m] + y` after `if not m.any(): continue`, weights read through the slot mask."""

    def forward(self, x):
        weights, ids = self.route(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            slots = ids == e
            chose = slots.any(-1)
            if not chose.any():
                continue
            out[chose] = out[chose] + weights[slots][:, None] * expert(x[chose])
        return out


def _compile(model_class, *args, tokens: int = 13):
    torch.manual_seed(0)
    model = model_class(*args).eval()
    inputs = (torch.randn(tokens, H),)
    expected = eager_output(model, inputs)
    report, output, _ = run_hpu_moe(model, inputs)
    torch.testing.assert_close(output, expected)
    return report


@pytest.mark.parametrize("model_class", [SwitchTop1, TableWeights, DenseMaskedTable])
def test_mask_selected_experts_with_table_weights_are_fused(model_class):
    report = _compile(model_class)
    assert report.graph_count == 1 and report.graph_break_count == 0, str(report)
    assert len(report.fused) == 1 and not report.declined, str(report)
    assert report.fused[0].top_k == (1 if model_class is SwitchTop1 else 2), str(report)


@pytest.mark.parametrize("tokens", [13, 1], ids=["prefill", "decode"])
@pytest.mark.parametrize("model_class", [BoolTableByScatter, WeightAboveZero, AddedAsAStore])
def test_masks_spelled_by_hand_are_fused(model_class, tokens):
    report = _compile(model_class, tokens=tokens)
    assert report.graph_count == 1 and report.graph_break_count == 0, str(report)
    assert [f.top_k for f in report.fused] == [2] and not report.declined, str(report)


def test_switch_top1_is_fused_for_a_single_token():
    report = _compile(SwitchTop1, tokens=1)
    assert len(report.fused) == 1, str(report)


class NeighbourStores(Routed):
    """Top-1, but each expert also stores at the tokens of the next expert: masks share tokens."""

    def forward(self, x):
        probs = self.router(x).softmax(-1)
        best = probs.argmax(-1)
        out = torch.zeros_like(x)
        for e in range(E):
            mask = (best == e) | (best == (e + 1) % E)
            out[mask] = self.experts[e](x[mask]) * probs[mask, e, None]
        return out


@pytest.mark.parametrize("model_class, reason", [
    (OverlappingStores, "under top-k routing with k > 1"),
    (NeighbourStores, "at rows another expert writes too"),
])
def test_stores_at_overlapping_masks_are_declined(model_class, reason):
    report = _compile(model_class)
    assert not report.fused and report.declined, str(report)
    assert reason in report.declined[0].reason, str(report)


def test_a_column_of_another_expert_is_not_the_routing():
    report = _compile(TableWeights, 1)
    assert not report.fused and report.declined, str(report)
    assert "routing weight" in report.declined[0].reason, str(report)


def test_switch_top1_trains_fused_like_eager():
    torch.manual_seed(0)
    report = backward_like_eager(SwitchTop1(), (torch.randn(13, H),))
    assert len(report.fused) == 1 and report.fused[0].training, str(report)


class IndexListsScaledAfter(Routed):
    """Top-1 by `max`; index lists built by a comprehension, stored at their rows, and the router's
    probability applied to the whole output after the loop (labml.ai's annotated Switch layer)."""

    def forward(self, x):
        best_prob, best = self.router(x).softmax(-1).max(dim=-1)
        rows = [torch.eq(best, e).nonzero(as_tuple=True)[0] for e in range(E)]
        out = x.new_zeros(x.shape)
        outputs = [self.experts[e](x[rows[e], :]) for e in range(E)]
        for e in range(E):
            out[rows[e], :] = outputs[e]
        return out * best_prob.view(-1, 1)


def test_comprehended_index_lists_scaled_after_the_loop_are_fused():
    report = _compile(IndexListsScaledAfter)
    assert report.graph_count == 1 and report.graph_break_count == 0, str(report)
    assert len(report.fused) == 1 and report.fused[0].top_k == 1, str(report)


class IndexColumns(Routed):
    """Top-1 by `max`; each expert's rows as the [n, 1] column `nonzero()` gives (no as_tuple), gathered as
    [n, 1, H] and stored with `out[idx, :] = y`, the probability applied after the loop (BlackMamba's
    SwitchMLP)."""

    def forward(self, x):
        best_prob, best = self.router(x).softmax(-1).max(dim=1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            idx = (best == e).nonzero()
            out[idx, :] = expert(x[idx, :])
        return out * best_prob.unsqueeze(1)


class NeighbourColumns(Routed):
    """IndexColumns, but each expert also takes the next expert's tokens: the stores overlap."""

    def forward(self, x):
        best_prob, best = self.router(x).softmax(-1).max(dim=1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            idx = ((best == e) | (best == (e + 1) % E)).nonzero()
            out[idx, :] = expert(x[idx, :])
        return out * best_prob.unsqueeze(1)


def test_index_columns_stored_back_are_fused():
    report = _compile(IndexColumns)
    assert report.graph_count == 1 and len(report.fused) == 1 and report.fused[0].top_k == 1, str(report)


class MatmulColumns(Routed):
    """IndexColumns with experts written as `torch.matmul` of the [n, 1, H] rows by the transposed weights
    (Megatron's legacy SwitchMLP, whose linears call matmul): torch 2.9's matmul reads numel() there."""

    def forward(self, x):
        best_prob, best = self.router(x).softmax(-1).max(dim=1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            idx = (best == e).nonzero()
            rows = x[idx, :]
            h = F.silu(torch.matmul(rows, expert.gate.weight.t())) * (rows @ expert.up.weight.t())
            out[idx, :] = torch.matmul(h, expert.down.weight.t())
        return out * best_prob.unsqueeze(1)


def test_matmul_of_index_columns_is_fused():
    report = _compile(MatmulColumns)
    assert report.graph_count == 1 and len(report.fused) == 1 and report.fused[0].top_k == 1, str(report)


def test_index_columns_of_overlapping_tokens_are_declined():
    report = _compile(NeighbourColumns)
    assert not report.fused and "at rows another expert writes too" in report.declined[0].reason, str(report)


class LookupsInALoop(nn.Module):
    """Not an expert loop: a table looked up at each key under a comparison, as bookkeeping code
    (torch's DistributedDataParallel among them) writes it. `table[key]` is not a boolean-mask gather."""

    def forward(self, names, params):
        index_of = {p: i for i, p in enumerate(params)}
        found = {}
        for key in names:
            if key != "skip":
                position = index_of[key]
                found[position] = key
        return found


def test_lookups_in_a_loop_are_not_expert_loops():
    from torch.nn.parallel import DistributedDataParallel

    from moe_passes.adapters.hit_expert_loops import adaptations_of

    assert adaptations_of(LookupsInALoop) == {}
    assert adaptations_of(DistributedDataParallel) == {}
    assert set(adaptations_of(SwitchTop1)) == {"forward"}


def _loop_with(selection: str) -> type:
    """A module whose loop over the experts gathers `x[<selection>]`: ids [T]; mask [E, T], boolean;
    hits [E, T, 1], int64 (a one-hot)."""
    import linecache

    code = (
        "class Loop(nn.Module):\n"
        "    def forward(self, x, ids):\n"
        "        mask = ids == torch.arange(E)[:, None]\n"
        "        hits = F.one_hot(ids, E).t()[:, :, None]\n"
        "        out = torch.zeros_like(x)\n"
        "        for e in range(E):\n"
        f"            out[{selection}] += x[{selection}]\n"
        "        return out\n"
    )
    filename = f"<mask loop: {selection}>"
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)  # for inspect.getsource
    namespace = {"torch": torch, "nn": nn, "F": F, "E": E}
    exec(compile(code, filename, "exec"), namespace)  # noqa: S102 - test-only source
    return namespace["Loop"]


@pytest.mark.parametrize("selection, selects", [
    ("ids == e", True),
    ("mask[e]", True),  # a lookup in a name bound only to a comparison: boolean
    ("hits[e].any(-1)", True),  # `any` is boolean whatever it reduces
    ("hits[e].squeeze(-1).bool()", True),
    ("hits[e].squeeze(-1)", False),  # int64: an integer gather of rows 0 and 1, not the expert's tokens
    ("(ids == e).long()", False),
    ("mask[e].bool().long()", False),
])
def test_a_subscript_selects_an_experts_tokens_only_with_a_boolean_mask(selection, selects):
    from moe_passes.adapters.hit_expert_loops import _selects_in_a_loop

    assert _selects_in_a_loop(_loop_with(selection).forward) is selects
