"""The backend is a declared list of passes: each can be left out by name, a user's own pass runs on
the rewritten graph, and a pass that raises costs the rewrite, never the compile."""

from __future__ import annotations

import warnings

import pytest
import torch

import moe_passes
from form_catalog import catalog
from moe_passes.backend import DEFAULT_PASSES, rewrite_graph
from moe_passes.explain import explain_and_run
from moe_passes.printer import is_fused_moe
from moe_passes.report import GraphRecord
from tests.helpers import assert_close_for_dtype, eager_output


def _compile(options, name="hf_grouped_mm"):
    model, inputs = catalog()[name].build(layers=1)
    report, output = explain_and_run(model, *inputs, options={"inner": "eager", "target": "portable", **options})
    assert_close_for_dtype(output, eager_output(model, inputs))
    return report


def test_the_declared_passes_run_in_order_and_each_is_timed():
    assert [p.name for p in DEFAULT_PASSES] == [
        "canonicalize", "find", "rewrite", "verify", "fuse routing", "stack weights", "save activations",
        "inner compile",
    ]
    report = _compile({"fuse_routing": True})
    assert len(report.fused) == 1 and report.fused[0].routing_fused, str(report)
    assert list(report.pass_seconds) == ["canonicalize", "find", "rewrite", "fuse routing", "stack weights",
                                    "inner compile"]


def test_a_pass_left_out_by_name_does_not_run():
    report = _compile({"fuse_routing": True, "skip_passes": ["fuse routing"]})
    assert len(report.fused) == 1 and not report.fused[0].routing_fused, str(report)
    assert "fuse routing" not in report.pass_seconds


class CountFusedCalls(moe_passes.BackendPass):
    name = "count fused calls"

    def __init__(self):
        self.seen = []

    def run(self, state: moe_passes.GraphState) -> None:
        self.seen.append(sum(is_fused_moe(n) for n in state.graph.graph.nodes))


class Broken(moe_passes.BackendPass):
    name = "broken"

    def run(self, state: moe_passes.GraphState) -> None:
        raise RuntimeError("a user's pass broke")


def test_a_users_pass_sees_the_rewritten_graph_and_its_failure_keeps_the_captured_one():
    counting = CountFusedCalls()
    assert len(_compile({"custom_passes": [counting]}).fused) == 1
    assert counting.seen == [1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = _compile({"custom_passes": [Broken()]})
    assert not report.fused and "a user's pass broke" in report.fallbacks[0], str(report)
    assert [str(w.message) for w in caught if "a user's pass broke" in str(w.message)], caught


@pytest.mark.parametrize(
    "options, error",
    [({"skip_passes": ["no such pass"]}, "unknown pass(es) ['no such pass']; the passes are ['canonicalize'"),
     ({"skip_passes": ["inner compile"]}, "['inner compile'] cannot be skipped"),
     ({"skip_passes": "verify"}, "skip_passes must be a list"),
     ({"custom_passes": [print]}, "is not a pass")],
)
def test_bad_pass_options_are_refused_clearly(options, error):
    with pytest.raises((ValueError, TypeError)) as raised:
        _compile(options)
    assert error in str(raised.value)


def test_the_rewrite_passes_run_alone_without_compiling():
    model, inputs = catalog()["hf_grouped_mm"].build(layers=2)
    captured = []
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=lambda gm, example_inputs: captured.append((gm, example_inputs)) or gm.forward)(
            *inputs
        )
    (gm, example_inputs), = captured
    record = GraphRecord(index=0)
    rewritten = rewrite_graph(gm, example_inputs, moe_passes.Options.parse({"target": "portable"}), "portable", record)
    assert sum(is_fused_moe(n) for n in rewritten.graph.nodes) == 2 and len(record.fused) == 2
    assert "inner compile" not in record.seconds
