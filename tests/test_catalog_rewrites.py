"""Every catalog form gets exactly the rewrite its EXPECTED states, with unchanged numbers."""

from __future__ import annotations

import pytest
import torch

from patterns import catalog
from tests.helpers import assert_close_for_dtype, eager_output, run_hpu_moe

FORMS = catalog()


def _layers(module) -> int:
    return module.EXPECTED.fused or module.EXPECTED.declined


@pytest.mark.parametrize("name", sorted(FORMS))
@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_catalog_form_rewrite(name, inner):
    form = FORMS[name]
    expected = form.EXPECTED
    model, inputs = form.build()
    report, output, recorder = run_hpu_moe(model, inputs, inner=inner)
    assert report.graph_count == 1 and report.graph_break_count == 0 and report.compile_count == 1, str(
        report
    )
    assert len(report.fused) == expected.fused, str(report)
    assert len(recorder.fused_nodes()) == expected.fused
    if expected.fused:
        assert {f.overload for f in report.fused} == {f"moe_passes::mixture_of_experts.{expected.overload}"}
        assert {str(n.target) for n in recorder.fused_nodes()} == {
            f"moe_passes.mixture_of_experts.{expected.overload}"
        }
    assert len(report.declined) == expected.declined, str(report)
    for declined in report.declined:
        assert expected.reason in declined.reason, str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


@pytest.mark.parametrize("name", sorted(n for n, f in FORMS.items() if f.EXPECTED.fused))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_catalog_form_low_precision(name, dtype):
    form = FORMS[name]
    try:
        model, inputs = form.build(dtype=dtype)
    except ValueError as why:  # a form that only exists in some dtypes says so
        pytest.skip(str(why))
    report, output, recorder = run_hpu_moe(model, inputs)
    assert len(report.fused) == form.EXPECTED.fused, str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


ROUTINGS = ["softmax_topk_renorm", "softmax_topk", "topk_softmax"]


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("router_fp32", [True, False])
@pytest.mark.parametrize("name", sorted(n for n, f in FORMS.items() if f.EXPECTED.fused))
def test_routing_variants_are_fused(name, routing, router_fp32):
    form = FORMS[name]
    model, inputs = form.build(routing=routing, router_fp32=router_fp32)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert len(report.fused) == form.EXPECTED.fused, str(report)
    kind = "topk_softmax" if routing == "topk_softmax" else "softmax_topk"
    assert all(f.routing.startswith(kind) for f in report.fused), str(report)
    if routing != "topk_softmax":
        renormalised = routing == "softmax_topk_renorm"
        assert all(("not renormalised" not in f.routing) == renormalised for f in report.fused), str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


@pytest.mark.parametrize("name", sorted(n for n, f in FORMS.items() if f.EXPECTED.fused))
@pytest.mark.parametrize("num_experts, top_k", [(2, 1), (8, 8), (16, 3)])
def test_expert_counts(name, num_experts, top_k):
    form = FORMS[name]
    model, inputs = form.build(num_experts=num_experts, top_k=top_k)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert [f.num_experts for f in report.fused] == [num_experts] * form.EXPECTED.fused, str(report)
    assert [f.top_k for f in report.fused] == [top_k] * form.EXPECTED.fused
    assert_close_for_dtype(output, eager_output(model, inputs))
