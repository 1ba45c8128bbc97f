"""Real transformers 5.x MoE models from tiny random configs: every MoE layer becomes one fused call."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_close_for_dtype, eager_output, run_hpu_moe

transformers = pytest.importorskip("transformers")

LAYERS = 3


def mixtral(implementation: str, dtype: torch.dtype):
    config = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=8,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        experts_implementation=implementation,
    )
    return transformers.MixtralForCausalLM(config)


def qwen3_moe(implementation: str, dtype: torch.dtype):
    config = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        experts_implementation=implementation,
    )
    return transformers.Qwen3MoeForCausalLM(config)


def qwen3_moe_not_renormalised(implementation: str, dtype: torch.dtype):
    model = qwen3_moe(implementation, dtype)
    for layer in model.model.layers:
        layer.mlp.gate.norm_topk_prob = False
    return model


FAMILIES = {"mixtral": mixtral, "qwen3_moe": qwen3_moe, "qwen3_moe_plain_topk": qwen3_moe_not_renormalised}


def build(family: str, implementation: str, dtype: torch.dtype):
    torch.manual_seed(0)
    model = FAMILIES[family](implementation, dtype).eval().to(dtype)
    input_ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    return model, (input_ids,)


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_moe_layer_fused_eager_inner(family, implementation):
    model, inputs = build(family, implementation, torch.float32)
    report, output, recorder = run_hpu_moe(model, inputs, inner="eager")
    assert report.graph_count == 1 and report.graph_break_count == 0 and report.compile_count == 1
    assert len(report.fused) == LAYERS, str(report)
    assert not report.declined, str(report)
    assert len(recorder.fused_nodes()) == LAYERS
    assert {f.form for f in report.fused} == {implementation}
    assert {f.overload for f in report.fused} == {"moe_passes::mixture_of_experts.fused_weights"}
    assert [f.layer for f in report.fused] == [f"model.layers.{i}.mlp" for i in range(LAYERS)]
    assert_close_for_dtype(output, eager_output(model, inputs))


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_bfloat16_under_inductor(family, implementation):
    model, inputs = build(family, implementation, torch.bfloat16)
    report, output, recorder = run_hpu_moe(model, inputs, inner="inductor")
    assert len(report.fused) == LAYERS and report.graph_break_count == 0, str(report)
    assert len(recorder.fused_nodes()) == LAYERS
    assert_close_for_dtype(output, eager_output(model, inputs))


def test_routing_is_reported():
    model, inputs = build("qwen3_moe_plain_topk", "grouped_mm", torch.float32)
    report, _, _ = run_hpu_moe(model, inputs)
    assert {f.routing for f in report.fused} == {"softmax_topk, not renormalised, fp32 softmax"}
    model, inputs = build("mixtral", "grouped_mm", torch.float32)
    report, _, _ = run_hpu_moe(model, inputs)
    assert {f.routing for f in report.fused} == {"softmax_topk, renormalised, fp32 softmax"}
