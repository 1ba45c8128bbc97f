"""Loops over per-expert counts that skip experts with no rows (`if n == 0: continue`, DeepSeek-V2 4.x).

The catalog's `deepseek_v2_count_loop` mirrors the 4.x block (fused end to end in tests/test_catalog_*
and, on real 4.55 / 4.57 models, in tests/test_transformers4.py). Here: the equivalence cases (top-1,
experts no token chose, one token) and the source constructs that keep the guard, each named.
"""

from __future__ import annotations

import pytest
import torch

from form_catalog import catalog
from form_catalog.aria4_offset_segments import OffsetExperts, offset_matmul
from form_catalog.deepseek_v2_count_loop import CountLoopMoE
from moe_passes.adapters import hit_expert_loops
from tests.helpers import (
    assert_close_for_dtype,
    eager_output,
    run_hpu_moe,
    skip_unless_dynamo_slices_for,
)

FORM = catalog()["deepseek_v2_count_loop"]


@pytest.mark.parametrize(
    "overrides",
    [dict(top_k=1), dict(tokens=1, num_experts=8), dict(tokens=1, top_k=1, num_experts=6)],
    ids=["top1", "one_token_unchosen_experts", "one_token_top1"],
)
def test_guard_removed_fused_and_equal(overrides):
    skip_unless_dynamo_slices_for("deepseek_v2_count_loop")
    model, inputs = FORM.build(**overrides)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert (report.graph_count, report.graph_break_count) == (1, 0), str(report)
    assert len(recorder.fused_nodes()) == 2, str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))
    assert not torch._dynamo.config.capture_scalar_outputs  # switched on for the hpu_moe compile only


class OffsetSkipsARow(CountLoopMoE):
    def segments(self, hidden_states, ids, weights):
        per_expert = ids.new_zeros((ids.shape[0], len(self.experts))).scatter_(1, ids, 1).sum(dim=0)
        order = ids.view(-1).argsort()
        rows = hidden_states[order // ids.shape[1]]
        outputs, start = [], 0
        for i, count in enumerate(per_expert):
            if count == 0:
                continue
            end = start + count
            outputs.append(self.experts[i](rows[start:end]))
            start = end + 1
        return torch.cat(outputs)


class CountsCalls(CountLoopMoE):
    def segments(self, hidden_states, ids, weights):
        per_expert = ids.new_zeros((ids.shape[0], len(self.experts))).scatter_(1, ids, 1).sum(dim=0)
        order = ids.view(-1).argsort()
        rows = hidden_states[order // ids.shape[1]]
        outputs, start = [], 0
        for i, count in enumerate(per_expert):
            if count == 0:
                continue
            end = start + count
            outputs.append(self.experts[i](rows[start:end]))
            self.calls += 1
            start = end
        return torch.cat(outputs)


class AppendsABias(CountLoopMoE):
    def segments(self, hidden_states, ids, weights):
        per_expert = ids.new_zeros((ids.shape[0], len(self.experts))).scatter_(1, ids, 1).sum(dim=0)
        outputs, start = [], 0
        for i, count in enumerate(per_expert):
            if count == 0:
                continue
            end = start + count
            outputs.append(self.experts[i].down_proj.weight.sum(1))
            start = end
        return torch.cat(outputs)


class CountsTheOutputs(CountLoopMoE):
    """Reads how many experts ran: an expert with no rows would now count."""

    def segments(self, hidden_states, ids, weights):
        per_expert = ids.new_zeros((ids.shape[0], len(self.experts))).scatter_(1, ids, 1).sum(dim=0)
        order = ids.view(-1).argsort()
        rows = hidden_states[order // ids.shape[1]]
        outputs, start = [], 0
        for i, count in enumerate(per_expert):
            if count == 0:
                continue
            end = start + count
            outputs.append(self.experts[i](rows[start:end]))
            start = end
        joined = torch.cat(outputs, dim=0) / len(outputs)
        unsorted = torch.empty_like(joined)
        unsorted[order] = joined
        return unsorted.view(*ids.shape, -1).mul(weights.unsqueeze(-1)).sum(dim=1)


KEPT = {
    OffsetSkipsARow: "does not move by the count alone",
    CountsCalls: "`self.calls += 1` in the loop over the counts may act for an expert with no rows",
    AppendsABias: "what is appended to outputs is not computed from the rows cut",
    CountsTheOutputs: "the list outputs is read other than by torch.cat",
}


@pytest.mark.parametrize("cls", list(KEPT), ids=lambda c: c.__name__)
def test_guard_kept_with_the_construct_named(cls):
    _, _, plan = hit_expert_loops.analyse(cls.segments)
    assert not plan.guards and len(plan.kept_guards) == 1
    assert KEPT[cls] in plan.kept_guards[0], plan.kept_guards


def test_kept_guard_is_reported_at_its_graph_break():
    model, inputs = FORM.build(layers=1)
    model.moes[0].__class__ = CountsTheOutputs
    report, output, recorder = run_hpu_moe(model, inputs)
    assert report.graph_break_count > 0 and not recorder.fused_nodes(), str(report)
    assert any("read other than by torch.cat" in advice for advice in report.advice), str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


class UngatedOffsetExperts(OffsetExperts):
    """fc1's whole output through the activation: not a gated MLP, so the block is declined."""

    def forward(self, rows, counts):
        hidden = offset_matmul(rows, self.fc1, counts)
        return offset_matmul(self.activation(hidden[:, : self.fc2.shape[1]]), self.fc2, counts)


def test_counts_handed_to_the_experts_are_captured_and_a_declined_block_still_compiles():
    """Aria-style: the counts go to a submodule that slices at their offsets. The adapter has them kept
    symbolic (one graph); when the block is then declined, inductor gets a graph with data-dependent
    slices, and the user's compile must still give eager's numbers (compiled, or run uncompiled)."""
    skip_unless_dynamo_slices_for("aria4_offset_segments")
    model, inputs = catalog()["aria4_offset_segments"].build(layers=1)
    model.moes[0].experts.__class__ = UngatedOffsetExperts
    report, output, recorder = run_hpu_moe(model, inputs, inner="inductor")
    assert report.graph_break_count == 0 and not report.fused, str(report)
    assert len(report.declined) == 1, str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))
    assert not torch._dynamo.config.capture_scalar_outputs
