"""Slots gathered and sorted by expert before a loop that lives in another method (TensorRT-LLM's
`VanillaMoE`, written afresh): the forward boolean-gathers the ids of this rank's experts, argsorts them,
gathers the token rows and the `[token, slot]` weights in that order, and `run_experts` loops over the
rank's experts with `mask = sorted_ids == e`, `if not torch.any(mask): continue` and boolean-mask
gathers of the rows, token ids and weights.

The forward is traced with data-dependent shapes captured (it feeds an adapted loop), the skip goes
(the accumulation is at `tokens[mask]`, empty where the mask holds nowhere), and the finder reads the
expert's input `x[tokens][mask]` as `x[tokens[mask]]`.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_close_for_dtype, eager_output, run_hpu_moe
from tests.loop_models import GatedExpert


class SortedSlots(torch.nn.Module):
    def __init__(self, hidden=8, experts=4, top_k=2, first=0, last=4):
        super().__init__()
        self.top_k, self.first, self.last = top_k, first, last
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.experts = torch.nn.ModuleList(GatedExpert(hidden) for _ in range(experts))

    def run_experts(self, x, rows, scales, sorted_ids, tokens):
        out = torch.zeros(x.shape, dtype=x.dtype)
        for e in range(self.first, self.last):
            mask = sorted_ids == e
            if not torch.any(mask):
                continue
            token = tokens[mask]
            out[token] += self.experts[e](rows[mask]) * scales[mask]
        return out

    def gathered_rows(self, x, tokens):
        return x[tokens]

    def forward(self, x):
        logits, ids = torch.topk(self.router(x), self.top_k)
        weights = logits.softmax(-1)
        mine = (ids >= self.first) & (ids < self.last)
        order = torch.argsort(ids[mine])
        sorted_ids = ids[mine][order]
        tokens, slots = torch.where(mine)
        tokens, slots = tokens[order], slots[order]
        scales = weights[tokens, slots, None]
        return self.run_experts(x, self.gathered_rows(x, tokens), scales, sorted_ids, tokens)


class SortedSlotsInlineTokens(SortedSlots):
    """The tokens picked at the mask inside the accumulation, `out[tokens[mask]] += ...`."""

    def run_experts(self, x, rows, scales, sorted_ids, tokens):
        out = torch.zeros(x.shape, dtype=x.dtype)
        for e in range(self.first, self.last):
            mask = sorted_ids == e
            if not torch.any(mask):
                continue
            out[tokens[mask]] += self.experts[e](rows[mask]) * scales[mask]
        return out


class SortedSlotsOtherRows(SortedSlots):
    """The expert's rows are gathered in another order than the tokens they are added back to: kept."""

    def gathered_rows(self, x, tokens):
        return x[tokens.flip(0)]


@pytest.mark.parametrize("tokens", [6, 1], ids=["default", "decode"])
@pytest.mark.parametrize("experts", [(0, 4), (1, 3)], ids=["all", "rank-range"])
@pytest.mark.parametrize("cls", [SortedSlots, SortedSlotsInlineTokens], ids=lambda c: c.__name__)
def test_sorted_slots_are_fused_in_one_graph(tokens, experts, cls):
    torch.manual_seed(0)
    model = cls(first=experts[0], last=experts[1]).eval()
    inputs = (torch.randn(tokens, 8),)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert (report.graph_count, report.graph_break_count) == (1, 0), str(report)
    assert len(recorder.fused_nodes()) == 1, str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


def test_rows_gathered_in_another_order_are_declined():
    torch.manual_seed(0)
    model = SortedSlotsOtherRows().eval()
    inputs = (torch.randn(6, 8),)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert not recorder.fused_nodes(), str(report)
    assert [d.reason for d in report.declined] == [
        "an expert's input rows are not the hidden states at the tokens it adds back to"], str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))
