"""Every catalog form gets exactly the rewrite its EXPECTED states, with unchanged numbers."""

from __future__ import annotations

import operator

import pytest
import torch

from form_catalog import catalog, dynamo_config
from moe_passes import weight_stacks
from tests import loop_models
from tests.helpers import (
    assert_close_for_dtype,
    backward_like_eager,
    eager_output,
    run_hpu_moe,
    skip_unless_dynamo_slices_for,
)

FORMS = catalog()
FUSED = sorted(n for n, f in FORMS.items() if f.EXPECTED.fused)
# Forms whose routing is the catalog's Router (the routing overrides apply); the others route their own way
# (DeepSeek-V3's grouped sigmoid router, transformers 4.x GPT-OSS's [T, E] score table, GraniteMoE's gate).
OWN_ROUTERS = ("deepseek_v3_routing", "gpt_oss4_hit_loop", "gpt_oss4_dense_bmm", "granite4_segments",
              "aria4_offset_segments", "mistral_where_loop", "torchtitan_grouped_experts",
              "gpt_fast_gathered_einsum", "sglang_native_einsum", "megatron_sequential_mlp")
ROUTED_BY_CATALOG = [n for n in FUSED if n not in OWN_ROUTERS]


@pytest.fixture(autouse=True)
def _skip_forms_this_dynamo_cannot_capture(request):
    """Forms that slice at data-dependent offsets need a dynamo that captures such slices."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and isinstance(callspec.params.get("name"), str):
        skip_unless_dynamo_slices_for(callspec.params["name"])


def run_form(name: str, inner: str = "eager", **overrides):
    """(model, inputs, report, output, recorder) for one catalog form under its dynamo config."""
    form = FORMS[name]
    model, inputs = form.build(**overrides)
    with dynamo_config(form):
        report, output, recorder = run_hpu_moe(model, inputs, inner=inner)
    return model, inputs, report, output, recorder


def assert_portable_overload(node: torch.fx.Node, contract: str) -> None:
    """The fused call has the `contract` overload's semantics, in its stacked form exactly when the graph
    holds each weight role as one stacked tensor (per-expert lists only for separate per-expert inputs)."""
    overload = node.target._overloadname
    weights = [a for a in node.args if isinstance(a, torch.fx.Node | list | tuple)][3:]
    if overload == weight_stacks.stacked_overload("portable", contract):
        assert all(isinstance(w, torch.fx.Node) for w in weights), node.format_node()
    else:
        assert overload == contract, (overload, contract)
        stacked_twin = weight_stacks.stacked_overload("portable", contract)
        separate = all(isinstance(w, list | tuple) and all(e.target is not operator.getitem for e in w) for w in weights)
        assert stacked_twin is None or separate, node.format_node()


def _layers(module) -> int:
    return module.EXPECTED.fused or module.EXPECTED.declined


@pytest.mark.parametrize("name", sorted(FORMS))
@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_catalog_form_rewrite(name, inner):
    expected = FORMS[name].EXPECTED
    model, inputs, report, output, recorder = run_form(name, inner)
    if expected.graph_breaks:
        assert report.graph_break_count > 0 and report.graph_count > 1, str(report)
        assert any(expected.advice in advice for advice in report.advice), str(report)
    else:
        assert report.graph_count == 1 and report.graph_break_count == 0 and report.compile_count == 1, str(
            report
        )
        assert not report.advice, str(report)
    assert len(report.fused) == expected.fused, str(report)
    assert len(recorder.fused_nodes()) == expected.fused
    for node in recorder.fused_nodes():
        assert_portable_overload(node, expected.overload)
    assert {f.overload for f in report.fused} == {f"moe_passes::{n.target._schema.name.split('::')[1]}."
                                                  f"{n.target._overloadname}" for n in recorder.fused_nodes()}
    assert len(report.declined) == expected.declined, str(report)
    for declined in report.declined:
        assert expected.reason in declined.reason, str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


@pytest.mark.parametrize("name", FUSED)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_catalog_form_low_precision(name, dtype):
    try:
        model, inputs, report, output, recorder = run_form(name, dtype=dtype)
    except ValueError as why:  # a form that only exists in some dtypes says so
        pytest.skip(str(why))
    assert len(report.fused) == FORMS[name].EXPECTED.fused, str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


ROUTINGS = ["softmax_topk_renorm", "softmax_topk", "topk_softmax"]


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("router_fp32", [True, False])
@pytest.mark.parametrize("name", ROUTED_BY_CATALOG)
def test_routing_variants_are_fused(name, routing, router_fp32):
    model, inputs, report, output, recorder = run_form(name, routing=routing, router_fp32=router_fp32)
    assert len(report.fused) == FORMS[name].EXPECTED.fused, str(report)
    kind = "topk_softmax" if routing == "topk_softmax" else "softmax_topk"
    assert all(f.routing.startswith(kind) for f in report.fused), str(report)
    if routing != "topk_softmax":
        renormalised = routing == "softmax_topk_renorm"
        assert all(("not renormalised" not in f.routing) == renormalised for f in report.fused), str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


@pytest.mark.parametrize("name", FUSED)
@pytest.mark.parametrize("num_experts, top_k", [(2, 1), (8, 8), (16, 3)])
def test_expert_counts(name, num_experts, top_k):
    held = num_experts // getattr(FORMS[name], "WORLD_SIZE", 1)  # expert parallel: one rank's share
    if held < 2:
        pytest.skip("a rank holding one expert runs a plain MLP, not an expert loop")
    model, inputs, report, output, recorder = run_form(name, num_experts=num_experts, top_k=top_k)
    assert [f.num_experts for f in report.fused] == [held] * FORMS[name].EXPECTED.fused, str(report)
    assert [f.top_k for f in report.fused] == [top_k] * FORMS[name].EXPECTED.fused
    assert_close_for_dtype(output, eager_output(model, inputs))


FIXED_ACTIVATION = ("static_dense_loop", "gpt_oss_experts", "gpt_oss4_hit_loop", "gpt_oss4_dense_bmm")


@pytest.mark.parametrize("name", [n for n in FUSED if n not in FIXED_ACTIVATION])
@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_gelu_and_relu_experts_are_fused_with_their_activation(name, activation):
    model, inputs, report, output, recorder = run_form(name, activation=activation)
    assert len(report.fused) == FORMS[name].EXPECTED.fused, str(report)
    assert {f.activation for f in report.fused} == {activation}, str(report)  # gelu: the tanh GELU
    assert {activation_argument(n) for n in recorder.fused_nodes()} == {activation}
    assert_close_for_dtype(output, eager_output(model, inputs))


def activation_argument(node) -> str:
    """The `activation` a fused call passes, read by its schema position."""
    names = [a.name for a in node.target._schema.arguments]
    return node.args[names.index("activation")]


def test_deepseek_routing_is_reported_and_its_weights_reach_the_call_scaled():
    model, inputs, report, output, recorder = run_form("deepseek_v3_routing")
    assert {f.routing for f in report.fused} == {
        "sigmoid_topk, bias-corrected, grouped, renormalised, scaled x2.5"
    }, str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


class DenseLoopThenSharedThroughViews(torch.nn.Module):
    """optimum-habana's DeepSeek-V2 training branch: every expert on every token, weighted by a scattered
    [E, B, S, 1] table, the sum viewed back to [B, S, H], then a shared expert added on the input."""

    def __init__(self):
        super().__init__()
        self.router = torch.nn.Linear(loop_models.H, loop_models.E, bias=False)
        self.experts = torch.nn.ModuleList(loop_models.SeparateGatedExpert() for _ in range(loop_models.E))
        self.shared = loop_models.SeparateGatedExpert()

    def forward(self, x):
        b, s, h = x.shape
        flat = x.view(-1, h)
        weights, ids = self.router(flat).softmax(-1).topk(2)
        padded = torch.zeros(b * s, len(self.experts)).scatter(-1, ids, weights)
        padded = padded.reshape(-1, s, len(self.experts)).permute(2, 0, 1).unsqueeze(-1)
        out = torch.zeros(b, s, h)
        for i, expert in enumerate(self.experts):
            out = out + expert(flat).reshape(-1, s, h) * padded[i]
        return out.view(b, s, h) + self.shared(x)


def test_a_shared_expert_added_through_views_stays_beside_the_fused_dense_loop():
    torch.manual_seed(0)
    model, x = DenseLoopThenSharedThroughViews(), torch.randn(2, 3, loop_models.H)
    report, output, recorder = run_hpu_moe(model, (x,))
    assert len(recorder.fused_nodes()) == 1 and not report.declined, str(report)
    (graph,) = recorder.graphs
    assert len([n for n in graph.graph.nodes if n.target is torch.ops.aten.mm.default]) == 3 + 1, graph.code
    assert_close_for_dtype(output, eager_output(model, (x,)))
    training = backward_like_eager(model.train(), (x,))  # optimum-habana runs this branch in training
    assert len(training.fused) == 1, str(training)


class DenseLoopAddedTwice(DenseLoopThenSharedThroughViews):
    """The loop's sum added to itself: the region is the sum once, the doubling stays beside the call."""

    def forward(self, x):
        b, s, h = x.shape
        flat = x.view(-1, h)
        weights, ids = self.router(flat).softmax(-1).topk(2)
        padded = torch.zeros(b * s, len(self.experts)).scatter(-1, ids, weights)
        padded = padded.reshape(-1, s, len(self.experts)).permute(2, 0, 1).unsqueeze(-1)
        out = torch.zeros(b, s, h)
        for i, expert in enumerate(self.experts):
            out = out + expert(flat).reshape(-1, s, h) * padded[i]
        return out + out.view(b, s, h)


def test_a_dense_loop_sum_added_to_itself_counts_each_expert_once():
    torch.manual_seed(0)
    model, x = DenseLoopAddedTwice(), torch.randn(2, 3, loop_models.H)
    report, output, recorder = run_hpu_moe(model, (x,))
    assert_close_for_dtype(output, eager_output(model, (x,)))
    assert len(recorder.fused_nodes()) == 1, str(report)


def test_shared_experts_stay_beside_the_fused_call():
    """Qwen2-MoE's gated shared expert and DeepSeek's shared experts keep their own matmuls."""
    for name, shared_mms in (("qwen2_shared_expert", 4), ("deepseek_v3_routing", 3)):
        model, inputs, report, output, recorder = run_form(name, layers=1)
        (graph,) = recorder.graphs
        mms = [n for n in graph.graph.nodes if n.target is torch.ops.aten.mm.default]
        # qwen2: gate/up/down of the shared expert + its sigmoid gate; deepseek: gate/up/down. The router
        # matmul is the one more.
        assert len(mms) == shared_mms + 1, graph.code
        assert len(recorder.fused_nodes()) == 1
        assert_close_for_dtype(output, eager_output(model, inputs))
