"""The catalog's own contract: every form builds, runs, compiles whole, honours overrides, states EXPECTED.

The rewrite tests trust these properties, so they are checked here against plain eager/compiled runs,
without the hpu_moe backend.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import form_catalog
from form_catalog import Expected, catalog, dynamo_config
from form_catalog._common import Router
from form_catalog._gpt_oss4 import GptOss4Router
from form_catalog.aria4_offset_segments import OffsetRouter
from form_catalog.granite4_segments import SegmentGate
from form_catalog.near_miss_llama4_dense_bmm import Llama4Router
from tests.helpers import dynamo_breaks_on_tolist

FORMS = catalog()
NAMES = list(FORMS)
NOT_BFLOAT16_BY_DEFAULT = [name for name in NAMES if FORMS[name].build()[1][0].dtype != torch.bfloat16]
SOURCE_PATH = re.compile(r"\b[\w.-]+(/[\w.-]+)*/\w+\.py\b")
VERSION_OR_COMMIT = re.compile(r"\b(\d+\.\d+(\.\d+)?|[0-9a-f]{7,40})\b")


def run(model, inputs):
    with torch.no_grad():
        return model(*inputs)


def experts_held(model) -> set[int]:
    """Experts per MoE layer, read from the parameters: stacked [E, ., .] weights or ModuleList length."""
    stacked = {p.shape[0] for p in model.parameters() if p.dim() == 3}
    return stacked or {len(moe.experts) for moe in model.moes}


def routing_of(model, inputs) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(weights, ids) every router produced during one forward (Llama4's dense scores read as top-k)."""
    seen = []

    def record(module, _inputs, out):
        if isinstance(module, Llama4Router):  # [T, E] scores, zero where an expert was not chosen
            weights, ids = out.topk(module.top_k, dim=-1)
            assert bool((out > 0).sum(-1).eq(module.top_k).all())
            out = (weights, ids)
        if isinstance(module, GptOss4Router):  # ([T, E] score table, ids)
            table, ids = out
            out = (table.gather(1, ids), ids)
        if isinstance(module, SegmentGate):  # returns slots in expert order: read its top-k from its input
            values, ids = module.layer(_inputs[0]).float().topk(module.top_k, dim=1)
            out = (values.softmax(dim=1), ids)
        seen.append(out)

    routers = (Router, Llama4Router, GptOss4Router, SegmentGate, OffsetRouter)
    hooks = [m.register_forward_hook(record) for m in model.modules() if isinstance(m, routers)]
    run(model, inputs)
    for hook in hooks:
        hook.remove()
    return seen


def accepts(form, key: str, value="silu") -> bool:
    try:
        form.build(**{key: value})
    except TypeError:
        return False
    return True


def test_the_catalog_discovers_every_form_module_in_name_order():
    modules = sorted(p.stem for p in Path(form_catalog.__file__).parent.glob("[!_]*.py"))
    assert NAMES == sorted(NAMES) == [m for m in modules if m != "vllm_fused_moe"]
    assert len(NAMES) > 30 and {"static_dense_loop", "hf_grouped_mm", "near_miss_deepspeed_capacity"} <= set(NAMES)
    assert all(FORMS[name].__name__ == f"form_catalog.{name}" for name in NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_form_states_its_expectation_and_cites_its_source(name):
    form = FORMS[name]
    assert isinstance(form.EXPECTED, Expected)
    assert (form.EXPECTED.fused == 0) == name.startswith("near_miss_")
    assert form.__doc__, "a form's docstring says what it mirrors and what the rewrite must do"
    assert SOURCE_PATH.search(form.__doc__), "the docstring must cite the source file it mirrors"
    assert VERSION_OR_COMMIT.search(form.__doc__), "the docstring must name the version or commit read"


@pytest.mark.parametrize("name", NAMES)
def test_default_build_runs_and_compiles_as_its_docstring_says(name):
    form = FORMS[name]
    model, inputs = form.build()
    assert not model.training
    assert isinstance(inputs, tuple) and len(inputs) == 1
    out = run(model, inputs)
    assert out.shape == inputs[0].shape and out.dtype == inputs[0].dtype
    assert torch.isfinite(out).all()
    assert 0.1 < out.float().std() < 10, "weights are scaled so outputs stay O(1)"
    torch._dynamo.reset()
    with torch.no_grad(), dynamo_config(form):
        explanation = torch._dynamo.explain(model)(*inputs)
        if form.EXPECTED.graph_breaks or getattr(form, "ADAPTER", None):
            # an adapted form breaks plain dynamo: the adapter is needed, not decorative
            if name == "granite4_segments" and not dynamo_breaks_on_tolist():
                pytest.skip(f"torch {torch.__version__}'s dynamo keeps `.tolist()` in the graph")
            assert explanation.graph_break_count > 0
            return
        compiled = torch.compile(model, backend="eager", fullgraph=True)(*inputs)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons
    torch.testing.assert_close(compiled, out)


@pytest.mark.parametrize("name", [n for n in NAMES if getattr(FORMS[n], "DYNAMO_CONFIG", None)])
def test_forms_that_need_a_dynamo_setting_break_without_it(name):
    """`DYNAMO_CONFIG` is needed, not decorative: without it the form does not compile whole."""
    model, inputs = FORMS[name].build()
    torch._dynamo.reset()
    with torch.no_grad():
        explanation = torch._dynamo.explain(model)(*inputs)
    assert explanation.graph_break_count > 0


@pytest.mark.parametrize("name", NAMES)
def test_builds_are_deterministic_and_seeded(name):
    form = FORMS[name]
    (a, x), (b, y), (c, _) = form.build(), form.build(), form.build(seed=7)
    torch.testing.assert_close(x, y, rtol=0, atol=0)
    torch.testing.assert_close(run(a, x), run(b, y), rtol=0, atol=0)
    assert not torch.equal(run(a, x), run(c, x))


@pytest.mark.parametrize("name", NOT_BFLOAT16_BY_DEFAULT)
def test_dtype_override_casts_weights_inputs_and_output(name):
    model, inputs = FORMS[name].build(dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    out = run(model, inputs)
    assert inputs[0].dtype == out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()


def test_grouped_mm_refuses_builds_it_cannot_compile():
    form = FORMS["hf_grouped_mm"]
    assert form.build()[1][0].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="bfloat16"):
        form.build(dtype=torch.float32)
    with pytest.raises(ValueError, match="multiple of 8"):
        form.build(intermediate=12)


@pytest.mark.parametrize("name", NAMES)
def test_size_overrides_take_effect(name):
    model, inputs = FORMS[name].build(num_experts=6, top_k=3, layers=3, tokens=5, hidden=24, intermediate=16)
    assert experts_held(model) == {6}
    assert len(model.moes) == 3
    assert inputs[0].shape == (1, 5, 24)
    routing = routing_of(model, inputs)
    assert len(routing) == 3
    assert all(ids.shape == (5, 3) and int(ids.max()) < 6 for _, ids in routing)
    assert run(model, inputs).shape == (1, 5, 24)


@pytest.mark.parametrize("name", NAMES)
def test_routing_overrides_take_effect(name):
    form = FORMS[name]
    if not accepts(form, "routing", "softmax_topk"):  # a form that routes its own way refuses them
        with pytest.raises(TypeError, match="unknown override"):
            form.build(router_fp32=False)
        return

    def first_router_weights(**overrides):
        model, inputs = form.build(**overrides)
        weights, _ = routing_of(model, inputs)[0]
        return weights.float()

    renormalised = first_router_weights(routing="softmax_topk_renorm")
    plain = first_router_weights(routing="softmax_topk")
    topk_first = first_router_weights(routing="topk_softmax")
    half_precision_softmax = first_router_weights(router_fp32=False)
    ones = torch.ones(renormalised.shape[0])
    within_bfloat16 = dict(atol=2e-2, rtol=0)  # hf_grouped_mm routes in float32, then casts to bfloat16
    torch.testing.assert_close(renormalised.sum(-1), ones, **within_bfloat16)
    assert (plain.sum(-1) < 0.98).all(), "without renormalisation the top-k share is below one"
    torch.testing.assert_close(topk_first, renormalised, **within_bfloat16)  # softmax over k == renormalised
    torch.testing.assert_close(half_precision_softmax.sum(-1), ones, **within_bfloat16)
    with pytest.raises(ValueError, match="routing"):
        form.build(routing="sigmoid")


@pytest.mark.parametrize("name", NAMES)
def test_activation_override_takes_effect_where_the_source_allows_it(name):
    form = FORMS[name]
    fixed_by_source = (
        "static_dense_loop",
        "near_miss_mixed_activation",
        "gpt_oss_experts",
        "gpt_oss4_hit_loop",
        "gpt_oss4_dense_bmm",
    )
    if name in (*fixed_by_source, "near_miss_concatenated_swiglu"):
        assert not accepts(form, "activation")
        return
    model, inputs = form.build()
    reference = run(model, inputs)
    for activation in ("gelu", "relu"):
        other, _ = form.build(activation=activation)
        assert not torch.allclose(run(other, inputs), reference)


@pytest.mark.parametrize("name", NAMES)
def test_bad_overrides_are_errors(name):
    form = FORMS[name]
    with pytest.raises(TypeError, match="unknown override"):
        form.build(not_an_option=1)
    with pytest.raises(ValueError, match="top_k"):
        form.build(top_k=5)
    with pytest.raises(ValueError, match="num_experts"):
        form.build(num_experts=0)


def test_clamped_swiglu_near_miss_clamps_for_real(monkeypatch):
    """The clamps must change the numbers, or declining them would be a test that cannot fail."""
    form = FORMS["near_miss_clamped_swiglu"]
    model, inputs = form.build()
    clamped = run(model, inputs)
    monkeypatch.setattr(form, "SWIGLU_LIMIT", float("inf"))
    assert (run(model, inputs) - clamped).abs().max() > 1e-3


def test_the_old_catalog_name_still_imports_and_names_the_new_one_for_modules():
    import subprocess
    import sys

    code = """
import sys, warnings
sys.path.insert(0, ".")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from patterns import catalog
assert "form_catalog" in str(caught[0].message) and len(catalog()) > 30
for statement in ("import patterns.hf_grouped_mm", "from patterns import hf_grouped_mm"):
    try:
        exec(statement)
    except ImportError as error:
        assert "import form_catalog.hf_grouped_mm" in str(error), error
    else:
        raise AssertionError(statement)
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
