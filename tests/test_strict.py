"""Strict mode: matches whose rewrite could differ from the layer as written are declined, with the reason:
a rounding of a value the model keeps wider, and a layer that runs every expert on every token (where a NaN
or inf in an expert no token is routed to reaches eager's output, never the fused call's)."""

from __future__ import annotations

import pytest
import torch

from form_catalog import catalog
from moe_passes.options import Options
from tests.helpers import assert_close_for_dtype, eager_output, run_hpu_moe

FORMS = catalog()


def test_strict_declines_float32_router_weights_under_bfloat16_experts():
    """DeepSeek-V3 keeps its routing weights in float32 and scales bfloat16 expert outputs with them."""
    model, inputs = FORMS["deepseek_v3_routing"].build(dtype=torch.bfloat16, layers=1)
    report, output, recorder = run_hpu_moe(model, inputs, strict=True)
    assert not report.fused and not recorder.fused_nodes(), str(report)
    (declined,) = report.declined
    assert declined.reason.startswith("strict: the router weights are used in float32"), declined.reason
    assert torch.equal(output, eager_output(model, inputs))  # untouched: bit for bit
    tolerant, output, _ = run_hpu_moe(model, inputs)
    assert len(tolerant.fused) == 1, str(tolerant)  # the default mode tolerates the rounding
    assert_close_for_dtype(output, eager_output(model, inputs))


@pytest.mark.parametrize("name", ["hf_batched_mm", "hf_grouped_mm", "hf4_sparse_loop"])
def test_strict_fuses_when_the_model_itself_rounds_the_weights_first(name):
    """A router that casts its float32 weights to the hidden dtype (as transformers' do) needs no rounding."""
    form = FORMS[name]
    model, inputs = form.build(dtype=torch.bfloat16, router_fp32=True, layers=1)
    with torch._dynamo.config.patch(**getattr(form, "DYNAMO_CONFIG", {})):
        report, output, _ = run_hpu_moe(model, inputs, strict=True)
    assert len(report.fused) == 1 and not report.declined, str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


def test_strict_fuses_float32_models():
    model, inputs = FORMS["deepseek_v3_routing"].build(layers=1)
    report, _, _ = run_hpu_moe(model, inputs, strict=True)
    assert len(report.fused) == 1, str(report)


@pytest.mark.parametrize("name", ["static_dense_loop", "modulelist_dense_mask", "gpt_oss4_dense_bmm"])
def test_strict_declines_layers_that_run_every_expert_on_every_token(name):
    form = FORMS[name]
    model, inputs = form.build(layers=1)
    with torch._dynamo.config.patch(**getattr(form, "DYNAMO_CONFIG", {})):
        report, output, _ = run_hpu_moe(model, inputs, strict=True)
        tolerant, _, _ = run_hpu_moe(model, inputs)
    assert not report.fused and len(tolerant.fused) == 1, str(report)
    (declined,) = report.declined
    assert declined.reason.startswith("strict: the layer as written runs every expert on every token"), declined.reason
    assert torch.equal(output, eager_output(model, inputs))


def test_an_unrouted_expert_with_nan_weights_gives_eager_nan_and_a_finite_fused_result():
    """The documented difference the strict decline above exists for, shown on a dense loop."""
    model, inputs = FORMS["modulelist_dense_mask"].build(layers=1, num_experts=8, top_k=1)
    chosen = []
    model.moes[0].router.register_forward_hook(lambda module, args, out: chosen.append(out[1]))
    eager_output(model, inputs)
    unrouted = next(e for e in range(8) if e not in set(chosen[0].flatten().tolist()))
    with torch.no_grad():
        model.moes[0].experts[unrouted].gate_proj.weight.fill_(float("nan"))
    report, output, _ = run_hpu_moe(model, inputs)
    assert len(report.fused) == 1, str(report)
    assert torch.isnan(eager_output(model, inputs)).all() and torch.isfinite(output).all()


def test_strict_must_be_a_bool():
    assert Options.parse({"strict": True}).strict and not Options.parse(None).strict
    with pytest.raises(TypeError, match="strict must be a bool"):
        Options.parse({"strict": "yes"})
