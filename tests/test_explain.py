"""explain(): compiles, recompiles with the guards that failed, graph breaks with the user stack, declines
with the node where matching stopped; and the trail left for TORCH_LOGS and TORCH_TRACE.

The vLLM-style catalog model shows both problems explain() must make visible: compiled one decoder
layer at a time without the adapters, the `layer_name` string becomes a guard (one recompile per layer
until the recompile limit), and the sequence-parallel context access breaks the graph.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import form_catalog
import moe_passes
from form_catalog import static_dense_loop, vllm_fused_moe
from moe_passes.report import Report
from tests.helpers import skip_unless_the_dp_context_breaks

ROOT = Path(__file__).resolve().parent.parent
VLLM_FILE = str(ROOT / "form_catalog" / "vllm_fused_moe.py")


def run_each_layer(options: dict, num_layers: int, dp_metadata: bool = False) -> Report:
    model, (x,) = vllm_fused_moe.build(num_layers=num_layers)
    tokens = {"num_tokens_across_dp": [x.shape[1]]} if dp_metadata else {}
    with moe_passes.explaining(options) as session:
        layers = [session.compile(layer) for layer in model.layers]
        with torch.no_grad(), vllm_fused_moe.set_forward_context(model, **tokens):
            for layer in layers:
                x = layer(x)
    return session.report


def test_per_layer_recompiles_name_the_layer_name_guard_under_plain_inductor():
    limit = torch._dynamo.config.recompile_limit
    report = run_each_layer({"inner": "inductor", "adapters": False, "target": "portable"}, limit + 2)
    assert report.recompile_count == limit, str(report)  # compiles 0/1 .. 0/limit; 0/limit is refused
    for recompile in report.recompiles:
        assert recompile.function == "forward" and recompile.location.startswith(VLLM_FILE)
        assert ".layer_name == 'model.layers." in recompile.guard_failures[0], recompile
        assert recompile.user_stack and recompile.user_stack[-1].file == VLLM_FILE
        assert "self.layer_name" in recompile.user_stack[-1].code
    assert report.compile_count == limit and report.recompile_limit_hits, str(report)
    assert any(c.failure and "recompile limit" in c.failure.lower().replace("_", " ") for c in report.compiles)
    assert not report.fused and not report.graph_breaks
    assert any("layer's name string" in advice for advice in report.advice)
    assert any("recompile limit" in advice for advice in report.advice)


def test_graph_breaks_carry_the_user_stack_into_the_model_source():
    report = run_each_layer({"inner": "eager", "adapters": False, "target": "portable"}, 3, dp_metadata=True)
    skip_unless_the_dp_context_breaks(report.graph_break_count > 0)
    assert report.graph_break_count == len(report.graph_breaks) > 0, str(report)
    # torch 2.11+ breaks at `.tolist()` inside the DP context; torch 2.10 already at entering it (dynamo
    # does not inline the generator context manager's __enter__): both are the context access
    at_tolist = f"{VLLM_FILE}:{_line_of('.repeat_interleave(sequence_parallel_size).tolist()')}"
    at_with = f"{VLLM_FILE}:{_line_of('with self._sequence_parallel_context():')}"
    for graph_break in report.graph_breaks:
        assert graph_break.location in (at_tolist, at_with), graph_break
        innermost = graph_break.user_stack[-1]
        if graph_break.location == at_tolist:
            assert "_local_scalar_dense" in graph_break.reason
            assert (innermost.file, innermost.function) == (VLLM_FILE, "sp_local_sizes")
        else:
            assert "__enter__" in graph_break.reason
            assert (innermost.file, innermost.function) == (VLLM_FILE, "forward")
        assert any(
            f.function == "forward" and "_sequence_parallel_context" in f.code for f in graph_break.user_stack
        )
        torch_dir = os.path.dirname(torch.__file__)
        assert not any(f.file.startswith(torch_dir) for f in graph_break.user_stack)  # user frames only


class SkipsOnItsData(torch.nn.Module):
    def forward(self, x):
        if torch.isnan(x).any():
            x = torch.nan_to_num(x)
        return x * 2


def test_a_break_is_printed_with_the_source_line_that_made_it():
    x = torch.ones(3)
    report = moe_passes.explain(SkipsOnItsData(), x)
    assert report.graph_break_count > 0, str(report)
    assert "(forward): if torch.isnan(x).any():" in str(report), str(report)


def test_the_fix_one_compile_no_break_no_recompile_and_the_experts_fused():
    report = run_each_layer({"inner": "eager", "target": "portable"}, 10, dp_metadata=True)
    assert (report.compile_count, report.recompile_count, report.graph_break_count) == (1, 0, 0), str(report)
    assert [c.compile_id for c in report.compiles] == ["0/0"]
    assert len(report.fused) == 1 and not report.advice


def _line_of(snippet: str) -> int:
    lines = Path(VLLM_FILE).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if snippet in line)


@pytest.mark.parametrize(
    ("name", "stopped_op"),
    [
        ("near_miss_input_scaled", " = aten.mul.Tensor("),  # the routing weight times the expert input
        ("near_miss_exact_gelu", " = aten.gelu("),  # the activation the kernel lacks
        ("near_miss_mixed_activation", " = aten.silu("),  # the first expert unlike the others
    ],
)
def test_declines_name_the_node_where_matching_stopped(name, stopped_op):
    form = form_catalog.catalog()[name]
    model, inputs = form.build(layers=1)
    with form_catalog.dynamo_config(form):
        report = moe_passes.explain(model, *inputs, options={"inner": "eager", "target": "portable"})
    (declined,) = report.declined
    (graph,) = report.graphs
    line = declined.stopped_at.split("  [", 1)[0]
    assert line.startswith("%") and stopped_op in line, declined.stopped_at
    assert line in [row.strip() for row in graph.captured.splitlines()]  # as the captured graph prints it
    assert declined.stopped_at.endswith(" in forward]")  # with the user source line


def test_report_keeps_graphs_timings_and_verified_error_and_round_trips_through_json():
    model, inputs = static_dense_loop.build()
    report = moe_passes.explain(
        model, *inputs, options={"inner": "eager", "target": "portable", "verify": True}
    )
    (graph,) = report.graphs
    assert graph.compile_id == "0/0" and "mixture_of_experts" in graph.rewritten
    assert "mixture_of_experts" not in graph.captured
    assert set(report.pass_seconds) == {"canonicalize", "find", "rewrite", "verify", "fuse routing", "stack weights",
                                        "inner compile"}
    assert all(f.max_error is not None and f.max_error < 1e-4 for f in report.fused)
    assert Report.from_dict(json.loads(report.to_json())) == report
    with pytest.raises(ValueError, match="not a moe_passes report"):
        Report.from_dict({"fused": []})


def test_explaining_reports_other_backends_too():
    model, inputs = static_dense_loop.build()
    with moe_passes.explaining() as session, torch.no_grad():
        torch.compile(model, backend="eager")(*inputs)
    report = session.report
    assert report.compile_count == 1 and report.graph_count == 1 and not report.fused and not report.graphs


def _run(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        timeout=600,
    )


EXPLAIN_ONE_FORM = """
    import moe_passes
    from form_catalog import near_miss_input_scaled, static_dense_loop
    for form in (static_dense_loop, near_miss_input_scaled):
        model, inputs = form.build(layers=1)
        moe_passes.explain(model, *inputs, options={"inner": "eager", "target": "portable"})
"""


def test_torch_logs_shows_the_moe_passes_logger():
    result = _run(EXPLAIN_ONE_FORM, {"TORCH_LOGS": "+moe_passes"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "graph 0 before the MoE rewrite:" in result.stderr
    assert "graph 0 after the MoE rewrite:" in result.stderr and "mixture_of_experts" in result.stderr
    assert "fused moes.0 (dense_loop" in result.stderr and "declined moes.0" in result.stderr


def test_torch_trace_holds_each_pass_graph_and_the_report(tmp_path):
    result = _run(EXPLAIN_ONE_FORM, {"TORCH_TRACE": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-3000:]
    artifacts: dict[str, list[str]] = {}
    for trace in tmp_path.glob("*.log"):
        lines = trace.read_text().splitlines()
        for i, line in enumerate(lines):
            # glog prefix, then the JSON metadata; a payload follows as tab-indented lines
            start = line.find("{")
            if start < 0 or '"artifact"' not in line:
                continue
            name = json.loads(line[start:])["artifact"]["name"]
            payload = []
            for follow in lines[i + 1 :]:
                if not follow.startswith("\t"):
                    break
                payload.append(follow[1:])
            artifacts.setdefault(name, []).append("\n".join(payload))
    for name in ("moe_passes_graph_0_before", "moe_passes_graph_0_after", "moe_passes_graph_0_decisions"):
        assert name in artifacts, sorted(artifacts)
    assert any("mixture_of_experts" in p for p in artifacts["moe_passes_graph_0_after"])
    assert not any("mixture_of_experts" in p for p in artifacts["moe_passes_graph_0_before"])
    reports = [Report.from_dict(json.loads(p)) for p in artifacts["moe_passes_report"]]
    assert [len(r.fused) for r in reports] == [1, 0] and [len(r.declined) for r in reports] == [0, 1]


_keyed = torch.library.Library("moe_passes_explain_test", "DEF")  # noqa: TOR901 - a test op, defined once
_keyed.define("scale_by_key(int key, Tensor x) -> Tensor")
_keyed.impl("scale_by_key", lambda key, x: x * 2, "CompositeExplicitAutograd")
_keyed.impl("scale_by_key", lambda key, x: torch.empty_like(x), "Meta")


class KeyedByIdentity(torch.nn.Module):
    """An opaque op that finds its layer by `id(layer)` (vLLM 0.17-0.23's CPU MoE fallback does this)."""

    def forward(self, x):
        layer_id = id(self)
        return torch.ops.moe_passes_explain_test.scale_by_key(layer_id, x)


def test_a_layer_keyed_by_its_identity_is_named_in_the_advice():
    layers, x = [KeyedByIdentity() for _ in range(3)], torch.randn(2, 4)
    with moe_passes.explaining({"inner": "eager", "target": "portable"}) as session:
        for layer in layers:
            session.compile(layer)(x)
    report = session.report
    assert report.compile_count == 3, str(report)
    (advice,) = [a for a in report.advice if "identity" in a]
    assert re.search(r"\(`layer_id = id\(self\)` at \S*test_explain\.py:\d+\)", advice), advice


class ExcludedExperts(torch.nn.Module):
    """Stacked SwiGLU experts whose per-expert loop its authors excluded from compilation (as OLMo-core's
    grouped-GEMM fallback is)."""

    def __init__(self, experts=4, hidden=8, inner=6):
        super().__init__()
        self.gate = torch.nn.Linear(hidden, experts, bias=False)
        self.w_gate = torch.nn.Parameter(torch.randn(experts, inner, hidden) / hidden**0.5)
        self.w_up = torch.nn.Parameter(torch.randn(experts, inner, hidden) / hidden**0.5)
        self.w_down = torch.nn.Parameter(torch.randn(experts, hidden, inner) / inner**0.5)

    @torch.compiler.disable()
    def expert_outputs(self, x, ids):
        return torch.stack([
            self.w_down[e] @ (torch.nn.functional.silu(self.w_gate[e] @ x[t]) * (self.w_up[e] @ x[t]))
            for t, e in enumerate(ids.tolist())
        ])

    def forward(self, x):
        weights, ids = self.gate(x).softmax(-1).topk(1, dim=-1)
        return self.expert_outputs(x, ids[:, 0]) * weights


class TwoExcludedLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(ExcludedExperts() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_code_excluded_from_compilation_is_named_as_the_reason_not_data_dependence():
    """The break at a `torch.compiler.disable`d function is the cause; the "graph break in loop" dynamo
    chains to it (the loop over layers is skipped) is not a data-dependent construct."""
    model, x = TwoExcludedLayers(), torch.randn(5, 8)
    report = moe_passes.explain(model, x, options={"inner": "eager", "target": "portable"})
    assert not report.fused and report.graph_break_count, str(report)
    excluded, *rest = report.advice
    assert "`ExcludedExperts.expert_outputs` is excluded from compilation by its authors" in excluded, excluded
    assert re.search(r"called at \S*test_explain\.py:\d+", excluded), excluded
    assert not any("data-dependent" in advice for advice in rest), report.advice


class GroupedOutsideTheGraph(torch.nn.Module):
    """Per-expert token lists built by a `torch._dynamo.disable`d function (torchao's Mixtral), then a
    gated expert per list: the graph after the break receives the lists as inputs."""

    def __init__(self, hidden=8, experts=4):
        super().__init__()
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.w1 = torch.nn.Parameter(torch.randn(experts, 2 * hidden, hidden) / hidden**0.5)
        self.w3 = torch.nn.Parameter(torch.randn(experts, 2 * hidden, hidden) / hidden**0.5)
        self.w2 = torch.nn.Parameter(torch.randn(experts, hidden, 2 * hidden) / hidden**0.5)

    def forward(self, x):
        weights, ids = torch.topk(self.router(x).softmax(-1), 2)
        order = ids.view(-1).argsort(stable=True)
        ends = torch.bincount(ids.view(-1), minlength=len(self.w1)).cumsum(0)

        @torch._dynamo.disable()
        def group(order, ends):
            return [order[(ends[e - 1] if e else 0):ends[e]] for e in range(len(ends))]

        groups = group(order, ends)
        out = torch.zeros_like(x)
        for e, slots in enumerate(groups):
            rows = slots // 2
            h = x[rows]
            y = F.linear(F.silu(F.linear(h, self.w1[e])) * F.linear(h, self.w3[e]), self.w2[e])
            out.index_add_(0, rows, y * weights.view(-1)[slots, None])
        return out


def test_experts_fed_by_a_disabled_function_name_it_in_the_advice():
    """dynamo quotes a called (not inlined) disabled function in backticks: the advice still names it."""
    report = moe_passes.explain(GroupedOutsideTheGraph(), torch.randn(6, 8),
                                options={"inner": "eager", "target": "portable"})
    assert not report.fused, str(report)
    assert "`GroupedOutsideTheGraph.forward.<locals>.group` is excluded from compilation" in report.advice[0], report


def test_segments_indexed_by_graph_inputs_are_declined_as_such():
    """torchao's Mixtral groups token indices per expert in a `torch._dynamo.disable`d function: the graph
    after it receives the index lists as inputs, which the decline says (not "not a segment")."""
    from form_catalog.corpus import torchao_mixtral_moe

    model, inputs = torchao_mixtral_moe.build()
    report = moe_passes.explain(model, *inputs, options={"inner": "eager", "target": "portable"})
    assert not report.fused, str(report)
    assert any("picked by indices this graph receives as an input" in d.reason for d in report.declined), str(report)
    assert "group_tokens_by_expert` is excluded from compilation" in report.advice[0], report
