"""Strict mode: matches whose rewrite rounds a value the model keeps wider are declined, with the reason."""

from __future__ import annotations

import pytest
import torch

from moe_passes.options import Options
from patterns import catalog
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


@pytest.mark.parametrize("name", ["hf_batched_mm", "hf_grouped_mm", "static_dense_loop", "hf4_sparse_loop"])
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


def test_strict_must_be_a_bool():
    assert Options.parse({"strict": True}).strict and not Options.parse(None).strict
    with pytest.raises(TypeError, match="strict must be a bool"):
        Options.parse({"strict": "yes"})
