"""Routing tables and counts as hand-written MoE code spells them: each fused, and equal to eager.

Three spellings that the catalog's helpers never write, in layers written the way their authors would:
- a dense [T, E] table of routing weights built with `scatter_add` (or `index_put` with accumulate),
  read by a loop that runs every expert on every token;
- the same table built as `(one_hot(ids) * w[..., None]).sum(1)`;
- per-expert counts built by adding ones at the ids (`zeros(E).scatter_add_(0, ids, ones)`), whose
  running sum gives the grouped GEMM its offsets.
The finders read what each computes (the dense loop checks each column from the ids and weights on
probes, the grouped finder reads a histogram of the ids), so a fourth spelling of the same meaning
needs no new code. The fuzz generator draws these spellings too (tests/fuzz_models.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import assert_close_for_dtype, eager_output, run_hpu_moe

TOKENS, HIDDEN, INTER, EXPERTS, TOP_K = 11, 16, 8, 4, 2


class SwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(HIDDEN, INTER, bias=False)
        self.w2 = nn.Linear(INTER, HIDDEN, bias=False)
        self.w3 = nn.Linear(HIDDEN, INTER, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TopKRouter(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, EXPERTS, bias=False)

    def forward(self, x):
        probs = self.proj(x).softmax(dim=-1)
        weights, ids = probs.topk(TOP_K, dim=-1)
        return weights / weights.sum(dim=-1, keepdim=True), ids


class ScatterAddTableMoE(nn.Module):
    """Every expert on every token, weighted by its column of a table scattered-added from the ids."""

    def __init__(self, accumulate_with: str = "scatter_add"):
        super().__init__()
        self.router = TopKRouter()
        self.experts = nn.ModuleList(SwiGLU() for _ in range(EXPERTS))
        self.accumulate_with = accumulate_with

    def forward(self, x):
        weights, ids = self.router(x)
        gates = torch.zeros(x.size(0), len(self.experts), dtype=x.dtype, device=x.device)
        if self.accumulate_with == "scatter_add":
            gates.scatter_add_(1, ids, weights)
        else:
            tokens = torch.arange(x.size(0), device=x.device).unsqueeze(1).expand_as(ids)
            gates.index_put_((tokens, ids), weights, accumulate=True)
        y = torch.zeros_like(x)
        for i in range(len(self.experts)):
            y = y + self.experts[i](x) * gates[:, i : i + 1]
        return y


class OneHotTableMoE(nn.Module):
    """The table as the one-hot of the ids times their weights, summed over the k slots."""

    def __init__(self):
        super().__init__()
        self.router = TopKRouter()
        self.experts = nn.ModuleList(SwiGLU() for _ in range(EXPERTS))

    def forward(self, hidden_states):
        weights, ids = self.router(hidden_states)
        table = (F.one_hot(ids, num_classes=EXPERTS).to(weights.dtype) * weights[..., None]).sum(dim=1)
        out = torch.zeros_like(hidden_states)
        for e, expert in enumerate(self.experts):
            out += expert(hidden_states) * table[:, e].unsqueeze(-1)
        return out


def _grouped_mm(x, w, offs):
    return F.grouped_mm(x, w, offs=offs) if hasattr(F, "grouped_mm") else torch._grouped_mm(x, w, offs=offs)


class ScatterCountsGroupedMoE(nn.Module):
    """Rows sorted by expert, counts by adding ones at the ids, grouped GEMMs over their running sum."""

    def __init__(self):
        super().__init__()
        self.router = TopKRouter()
        self.w_gate = nn.Parameter(torch.randn(EXPERTS, HIDDEN, INTER) / HIDDEN**0.5)
        self.w_up = nn.Parameter(torch.randn(EXPERTS, HIDDEN, INTER) / HIDDEN**0.5)
        self.w_down = nn.Parameter(torch.randn(EXPERTS, INTER, HIDDEN) / INTER**0.5)

    def forward(self, x):
        weights, ids = self.router(x)
        flat_ids = ids.view(-1)
        tokens_per_expert = torch.zeros(EXPERTS, dtype=torch.int32, device=x.device)
        tokens_per_expert.scatter_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
        order = torch.argsort(flat_ids, stable=True)
        token_of_row = order // TOP_K
        rows = x[token_of_row]
        offsets = tokens_per_expert.cumsum(0, dtype=torch.int32)
        h = F.silu(_grouped_mm(rows, self.w_gate, offsets)) * _grouped_mm(rows, self.w_up, offsets)
        y = _grouped_mm(h, self.w_down, offsets) * weights.view(-1)[order].unsqueeze(-1).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token_of_row, y)


class TableColumnLoopMoE(nn.Module):
    """Each expert on the tokens whose column of the [T, E] routing table is non-zero, as hand-written MoE
    code reads a dense table in `for i, expert in enumerate(self.experts)`: the subclasses spell the column's
    tokens three ways."""

    def __init__(self):
        super().__init__()
        self.router = TopKRouter()
        self.experts = nn.ModuleList(SwiGLU() for _ in range(EXPERTS))

    def table(self, x):
        weights, ids = self.router(x)
        return torch.zeros(x.size(0), len(self.experts), dtype=x.dtype, device=x.device).scatter(1, ids, weights)


class ColumnThresholdMoE(TableColumnLoopMoE):
    """The column compared with 0, an accumulation through the boolean mask."""

    def forward(self, x):
        gates = self.table(x)
        y = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            chosen = gates[:, i] > 0
            y[chosen] += gates[chosen, i, None] * expert(x[chosen])
        return y


class BoolTableColumnMoE(TableColumnLoopMoE):
    """The table cast to bool once, its column looked up per expert."""

    def forward(self, x):
        gates = self.table(x)
        routed = gates.bool()
        y = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            chosen = routed[:, i]
            y[chosen] = y[chosen] + gates[chosen, i].unsqueeze(-1) * expert(x[chosen])
        return y


class ColumnWhereSkipEmptyMoE(TableColumnLoopMoE):
    """`torch.where` of the column, an expert with no rows skipped, `index_add_` of its output."""

    def forward(self, x):
        gates = self.table(x)
        y = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            rows, = torch.where(gates[:, i] > 0)
            if rows.numel() == 0:
                continue
            y.index_add_(0, rows, gates[rows, i, None] * expert(x[rows]))
        return y


class ColumnTestByFlagMoE(TableColumnLoopMoE):
    """The column's test picked by a configuration flag in a conditional expression."""

    def __init__(self, strict: bool = True):
        super().__init__()
        self.strict = strict

    def forward(self, x):
        gates = self.table(x)
        y = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            chosen = gates[:, i] > 0 if self.strict else gates[:, i] != 0
            y[chosen] += gates[chosen, i, None] * expert(x[chosen])
        return y


def _grouped_mm_runs_here() -> bool:
    try:
        offs = torch.tensor([2], dtype=torch.int32)
        _grouped_mm(torch.ones(2, 16, dtype=torch.bfloat16), torch.ones(1, 16, 16, dtype=torch.bfloat16), offs)
        return True
    except (RuntimeError, NotImplementedError):
        return False


CASES = {
    "scatter_add_table": (lambda: ScatterAddTableMoE("scatter_add"), torch.float32, "dense_loop"),
    "index_put_table": (lambda: ScatterAddTableMoE("index_put"), torch.float32, "dense_loop"),
    "one_hot_table": (OneHotTableMoE, torch.float32, "dense_loop"),
    "scatter_add_counts": (ScatterCountsGroupedMoE, torch.bfloat16, "grouped_mm"),
    "column_threshold": (ColumnThresholdMoE, torch.float32, "sparse_loop"),
    "column_of_bool_table": (BoolTableColumnMoE, torch.float32, "sparse_loop"),
    "column_where_skip_empty": (ColumnWhereSkipEmptyMoE, torch.float32, "sparse_loop"),
    "column_test_by_flag": (ColumnTestByFlagMoE, torch.float32, "sparse_loop"),
    "column_test_by_flag_off": (lambda: ColumnTestByFlagMoE(strict=False), torch.float32, "sparse_loop"),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("tokens", [TOKENS, 1])
def test_hand_written_spelling_is_fused_and_equal(name, tokens):
    build, dtype, form = CASES[name]
    if form == "grouped_mm" and not _grouped_mm_runs_here():
        pytest.skip("this torch has no CPU grouped GEMM")
    torch.manual_seed(0)
    model = build().to(dtype).eval()
    inputs = (torch.randn(tokens, HIDDEN, dtype=dtype),)
    expected = eager_output(model, inputs)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert [f.form for f in report.fused] == [form], (report.declined, report.fallbacks)
    assert len(recorder.fused_nodes()) == 1
    assert_close_for_dtype(output, expected)


def test_a_table_of_other_weights_is_declined():
    """A table whose columns are not the routing weights (here: the full softmax at the chosen experts'
    cells, not renormalised) is a different layer: declined, never fused."""

    class FullProbabilityTable(ScatterAddTableMoE):
        def forward(self, x):
            probs = self.router.proj(x).softmax(dim=-1)
            _, ids = probs.topk(TOP_K, dim=-1)
            mask = torch.zeros_like(probs).scatter_add_(1, ids, torch.ones_like(ids, dtype=probs.dtype))
            gates = probs * mask + 0.5 * probs  # every expert keeps half its probability
            y = torch.zeros_like(x)
            for i in range(len(self.experts)):
                y = y + self.experts[i](x) * gates[:, i : i + 1]
            return y

    torch.manual_seed(0)
    model = FullProbabilityTable().eval()
    inputs = (torch.randn(TOKENS, HIDDEN),)
    expected = eager_output(model, inputs)
    report, output, _ = run_hpu_moe(model, inputs)
    assert not report.fused and report.declined
    torch.testing.assert_close(output, expected)


def test_a_column_cut_at_a_weight_threshold_is_declined():
    """`gates[:, i] > 0.3` drops the routes whose weight is below 0.3, which the fused kernel computes: the
    probes' weights (whole numbers from 1) never show the cut, so it is declined, named, and runs as written."""

    class ColumnCutMoE(TableColumnLoopMoE):
        def forward(self, x):
            gates = self.table(x)
            y = torch.zeros_like(x)
            for i, expert in enumerate(self.experts):
                chosen = gates[:, i] > 0.3
                y[chosen] += gates[chosen, i, None] * expert(x[chosen])
            return y

    torch.manual_seed(0)
    model = ColumnCutMoE().eval()
    inputs = (torch.randn(TOKENS, HIDDEN),)
    expected = eager_output(model, inputs)
    report, output, _ = run_hpu_moe(model, inputs)
    assert not report.fused and "threshold other than 0" in report.declined[0].reason
    torch.testing.assert_close(output, expected)


class SignOfRawLogitsMoE(TableColumnLoopMoE):
    """Top-2 of the raw logits as the routing weights (no softmax): signed; the column read by sign
    (`> 0`), which drops the routes of negative weight."""

    def gates(self, x):
        weights, ids = self.router.proj(x).topk(TOP_K, dim=-1)
        return torch.zeros(x.size(0), len(self.experts), dtype=x.dtype).scatter(1, ids, weights)

    def forward(self, x):
        gates = self.gates(x)
        y = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            chosen = gates[:, i] > 0
            y[chosen] += gates[chosen, i, None] * expert(x[chosen])
        return y


class NonZeroRawLogitsMoE(SignOfRawLogitsMoE):
    """The same signed table read by `!= 0`: every routed entry."""

    def forward(self, x):
        gates = self.gates(x)
        y = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            chosen = gates[:, i] != 0
            y[chosen] += gates[chosen, i, None] * expert(x[chosen])
        return y


@pytest.mark.parametrize("model_class", [SignOfRawLogitsMoE, NonZeroRawLogitsMoE], ids=lambda c: c.__name__)
def test_a_column_of_signed_weights_is_read_by_sign_only_when_proved_non_negative(model_class):
    """The probes' weights are all positive, so they cannot show what `> 0` drops: that test is taken only
    of values proved non-negative (a softmax's, as in the spellings above), `!= 0` of any."""
    torch.manual_seed(0)
    model = model_class().eval()
    inputs = (torch.randn(TOKENS, HIDDEN),)
    expected = eager_output(model, inputs)
    report, output, _ = run_hpu_moe(model, inputs)
    if model_class is SignOfRawLogitsMoE:
        assert not report.fused and "tests the sign of a value not proved non-negative" in report.declined[0].reason
    else:
        assert [f.form for f in report.fused] == ["sparse_loop"], report.declined
    torch.testing.assert_close(output, expected)


class NextColumnWeightMoE(TableColumnLoopMoE):
    """Expert i's tokens (its column is non-zero) weighted by the next expert's column: not the routing."""

    def forward(self, x):
        gates = self.table(x)
        y = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            chosen = gates[:, i] > 0
            y[chosen] += gates[chosen, (i + 1) % EXPERTS, None] * expert(x[chosen])
        return y


class TruncatedTableMoE(TableColumnLoopMoE):
    """The table cast to integers after scaling: `(gates * 4).long()` is 0 below a weight of 0.25."""

    def forward(self, x):
        gates = self.table(x)
        quarters = (gates * 4).long()
        y = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            chosen = quarters[:, i] > 0
            y[chosen] += gates[chosen, i, None] * expert(x[chosen])
        return y


@pytest.mark.parametrize(("model_class", "named"), [
    (NextColumnWeightMoE, "not the routing weight of one expert"),
    (TruncatedTableMoE, "cast to integers"),
], ids=lambda v: v.__name__ if isinstance(v, type) else "")
@pytest.mark.parametrize("tokens", [TOKENS, 1])
def test_a_column_mask_the_probes_cannot_tell_from_the_routing_is_declined(model_class, named, tokens):
    """Probed with dense tables only, a column's mask selects every token and the next column's weight
    looked like a routing weight; probed with whole-number weights, a truncation never cut. Both were
    fused and wrong; routed probe tables and the cast check decline them."""
    torch.manual_seed(0)
    model = model_class().eval()
    inputs = (torch.randn(tokens, HIDDEN) * 8,)
    expected = eager_output(model, inputs)
    report, output, _ = run_hpu_moe(model, inputs)
    assert not report.fused and named in report.declined[0].reason, report.declined
    torch.testing.assert_close(output, expected)


def test_non_negative_is_proved_from_the_ops_that_made_a_value():
    """What lets a test of the sign through the probes: a softmax's top-k weights scattered (at any dim, of
    any positive number) are >= 0; raw top-k logits, a negative scale, a subtraction are not shown to be."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from moe_passes.passes.probe import non_negative

    def values(x):
        weights, ids = x.softmax(-1).topk(TOP_K, -1)
        table = torch.zeros(x.shape[0], EXPERTS).scatter(-1, ids, weights)
        return (table, torch.zeros(x.shape[0], EXPERTS).scatter(-1, ids, 1.0), table + 0.5,
                torch.zeros(x.shape[0], EXPERTS).scatter(-1, ids, -1.0), x.topk(TOP_K, -1).values, table * -1,
                table - 0.1)

    graph = make_fx(values)(torch.randn(3, EXPERTS)).graph
    outputs = next(iter(graph.find_nodes(op="output"))).args[0]
    assert [non_negative(node) for node in outputs] == [True, True, True, False, False, False, False]
