"""Real transformers 5.x MoE models from tiny random configs: every MoE layer becomes one fused call."""

from __future__ import annotations

import pytest
import torch
from packaging.version import Version

from tests.helpers import assert_close_for_dtype, eager_output, requires_transformers_5, run_hpu_moe

transformers = pytest.importorskip("transformers")
pytestmark = requires_transformers_5

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


def qwen2_moe(implementation: str, dtype: torch.dtype):
    """Qwen2-MoE: a sigmoid-gated shared expert stays beside the fused call."""
    config = transformers.Qwen2MoeConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=16,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
        experts_implementation=implementation,
    )
    return transformers.Qwen2MoeForCausalLM(config)


def olmoe(implementation: str, dtype: torch.dtype):
    """OLMoE: softmax → top-k without renormalisation (norm_topk_prob=False), no shared expert."""
    config = transformers.OlmoeConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=8,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        pad_token_id=1,
        eos_token_id=2,
        experts_implementation=implementation,
    )
    return transformers.OlmoeForCausalLM(config)


def deepseek_v3(implementation: str, dtype: torch.dtype):
    """DeepSeek-V3: sigmoid scores + correction bias + grouped top-k, routed scaling, shared experts."""
    config = transformers.DeepseekV3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=0,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        head_dim=16,
        n_shared_experts=1,
        experts_implementation=implementation,
    )
    return transformers.DeepseekV3ForCausalLM(config)


def gpt_oss(implementation: str, dtype: torch.dtype):
    """GPT-OSS: top-k on logits then softmax; interleaved gate/up with biases and a clamped swiglu."""
    config = transformers.GptOssConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["full_attention"] * LAYERS,
        experts_implementation=implementation,
    )
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():  # its init leaves expert weights at zero: give them values that matter
        for name, parameter in model.named_parameters():
            if ".experts." in name:
                parameter.normal_(std=0.2)
    return model


FAMILIES = {
    "mixtral": mixtral,
    "qwen3_moe": qwen3_moe,
    "qwen3_moe_plain_topk": qwen3_moe_not_renormalised,
    "qwen2_moe": qwen2_moe,
    "olmoe": olmoe,
    "deepseek_v3": deepseek_v3,
    "gpt_oss": gpt_oss,
}
OVERLOAD = {"gpt_oss": "bias_fused_weights"}  # the others: stacked_fused_weights (stacked parameters)


def build(family: str, implementation: str, dtype: torch.dtype):
    torch.manual_seed(0)
    model = FAMILIES[family](implementation, dtype).eval().to(dtype)
    input_ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    return model, (input_ids,)


@pytest.mark.parametrize("inner", ["eager", "inductor"])
@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_moe_layer_fused(family, implementation, inner):
    model, inputs = build(family, implementation, torch.float32)
    report, output, recorder = run_hpu_moe(model, inputs, inner=inner)
    assert report.graph_count == 1 and report.graph_break_count == 0 and report.compile_count == 1
    assert len(report.fused) == LAYERS, str(report)
    assert not report.declined, str(report)
    assert len(recorder.fused_nodes()) == LAYERS
    assert {f.form for f in report.fused} == {implementation}
    overload = OVERLOAD.get(family, "stacked_fused_weights")
    assert {f.overload for f in report.fused} == {f"moe_passes::mixture_of_experts.{overload}"}
    assert [f.layer for f in report.fused] == [f"model.layers.{i}.mlp" for i in range(LAYERS)]
    assert_close_for_dtype(output, eager_output(model, inputs))


def skip_where_transformers_breaks_bf16_grouped_mm(implementation: str) -> None:
    """transformers checks 16-byte alignment with `data_ptr() % 16` before a bfloat16 grouped_mm on CPU
    with torch <= 2.10 (integrations/moe.py, _can_use_grouped_mm): dynamo breaks the graph on that in
    transformers' own code. Weights on a Gaudi or CUDA device skip the check."""
    old_torch = Version(torch.__version__.split("+")[0]).release[:2] <= (2, 10)
    if implementation == "grouped_mm" and old_torch:
        pytest.skip("transformers' data_ptr alignment check for bf16 grouped_mm on CPU breaks the graph on torch <= 2.10")


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_bfloat16_under_inductor(family, implementation):
    skip_where_transformers_breaks_bf16_grouped_mm(implementation)
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
    model, inputs = build("olmoe", "batched_mm", torch.float32)
    report, _, _ = run_hpu_moe(model, inputs)
    assert {f.routing for f in report.fused} == {"softmax_topk, not renormalised, fp32 softmax"}
    model, inputs = build("deepseek_v3", "batched_mm", torch.float32)
    report, _, _ = run_hpu_moe(model, inputs)
    assert {f.routing for f in report.fused} == {
        "sigmoid_topk, bias-corrected, grouped, renormalised, scaled x2.5"
    }, str(report)
    model, inputs = build("gpt_oss", "batched_mm", torch.float32)
    report, _, _ = run_hpu_moe(model, inputs)
    assert {f.routing for f in report.fused} == {"topk_softmax, fp32 softmax"}, str(report)


def test_fused_calls_snapshot():
    """What feeds each fused call in a real model: routing, casts, the unbound stacked weights."""
    from expecttest import assert_expected_inline

    from moe_passes.printer import format_fused_calls

    skip_where_transformers_breaks_bf16_grouped_mm("grouped_mm")
    model, inputs = build("mixtral", "grouped_mm", torch.bfloat16)
    _, _, recorder = run_hpu_moe(model, inputs)
    assert_expected_inline(
        format_fused_calls(recorder.graphs[0], depth=1),
        """\
graph(in0, in1, in2, in3, in4, in5, in6, in7, in8, in9, in10, in11, in12, in13, in14):
  %0 = aten.reshape(in0, [-1, 16])
  %1 = getitem(in1, 1)
  %2 = aten._to_copy(in2, dtype=bfloat16)
  %3 = moe_passes.mixture_of_experts.stacked_fused_weights(%0, %1, %2, in3, in4, True, 'silu', 0, 3)
  %4 = aten.reshape(in5, [-1, 16])
  %5 = getitem(in6, 1)
  %6 = aten._to_copy(in7, dtype=bfloat16)
  %7 = moe_passes.mixture_of_experts.stacked_fused_weights(%4, %5, %6, in8, in9, True, 'silu', 0, 3)
  %8 = aten.reshape(in10, [-1, 16])
  %9 = getitem(in11, 1)
  %10 = aten._to_copy(in12, dtype=bfloat16)
  %11 = moe_passes.mixture_of_experts.stacked_fused_weights(%8, %9, %10, in13, in14, True, 'silu', 0, 3)""",
    )


def llama4_config(**kwargs):
    return transformers.Llama4TextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=16,
        intermediate_size_mlp=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=1,
        moe_layers=[0, 1],
        **kwargs,
    )


def test_llama4_refuses_grouped_mm():
    """Llama4's experts keep their own forward: transformers refuses experts_implementation='grouped_mm'."""
    with pytest.raises(ValueError, match="does not support setting experts implementation"):
        transformers.Llama4ForCausalLM(llama4_config(experts_implementation="grouped_mm"))


@pytest.mark.parametrize("implementation", [None, "batched_mm"])
def test_llama4_is_declined_with_the_reason(implementation):
    """Llama4 scales each expert's input by its routing weight: not the kernel's semantics.

    transformers accepts `batched_mm` for Llama4 but its experts keep their own dense bmm forward.
    """
    config = llama4_config(**({"experts_implementation": implementation} if implementation else {}))
    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(config).eval()
    inputs = (torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(1)),)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert report.graph_count == 1 and report.graph_break_count == 0, str(report)
    assert not report.fused and not recorder.fused_nodes()
    assert len(report.declined) == 2, str(report)
    assert all("scale each expert's input" in d.reason for d in report.declined)
    assert [d.candidate for d in report.declined] == [
        f"model.layers.{i}.feed_forward.experts" for i in range(2)
    ]
    assert_close_for_dtype(output, eager_output(model, inputs))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_eager_experts_loop_is_fused(family):
    """transformers' `eager` experts: the loop over the experts that were hit, in a forward that
    `@use_experts_implementation` wraps (it dispatches on the config): adapted under the wrapper."""
    model, inputs = build(family, "eager", torch.float32)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert (report.graph_count, report.graph_break_count) == (1, 0), str(report)
    assert len(report.fused) == LAYERS and len(recorder.fused_nodes()) == LAYERS, str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


@pytest.mark.parametrize(("family", "named"), [
    ("hy_v4", "gate and up are clamped before act(gate) * up"),
    ("nemotron_h", "an expert is an ungated MLP, down(relu²(up(x)))"),
])
def test_eager_experts_loop_declined_names_the_mlp(family, named):
    """The loop's decline names what the input of the down projection is, as the stacked finders do.
    NemotronH's loop iterates `nonzero().squeeze(-1)` and reads each element with `.item()`."""
    from tools import coverage

    model = coverage.tiny_model(family, "eager")
    inputs = (torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(1)),)
    report, output, _ = run_hpu_moe(model, inputs)
    assert report.graph_break_count == 0 and report.declined and not report.fused, str(report)
    assert all(named in d.reason for d in report.declined), str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
def test_zaya_router_that_reshapes_to_token_slots_last_is_fused(implementation):
    """ZAYA routes on [B, S, E] and reshapes ids and weights to (-1, k) only when it returns them (and
    masks its skip expert to id 0 with weight 0): the [T, k] tables sit part-way up a view chain."""
    from tools import coverage

    model = coverage.tiny_model("zaya", implementation)
    inputs = (torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(1)),)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert (report.graph_count, report.graph_break_count, report.declined) == (1, 0, []), str(report)
    assert len(report.fused) == len(recorder.fused_nodes()) == coverage.moe_layer_count(model)
    assert_close_for_dtype(output, eager_output(model, inputs))


def test_switch_transformers_experts_loop_is_captured_and_declined_as_ungated():
    """5.x Switch Transformers: a hit loop over a capacity-trimmed one-hot handed in by the router (not
    seen to be one-hot, so read gated by the hit test) and experts keyed `expert_{i}` in a ModuleDict by
    the formatted row. Captured in the layer's graph; its experts, relu MLPs without a gate, are declined."""
    config = transformers.SwitchTransformersConfig(
        vocab_size=64, d_model=16, d_ff=8, d_kv=8, num_heads=2, num_layers=2, num_sparse_encoder_layers=1,
        num_experts=4, expert_capacity=64)
    torch.manual_seed(0)
    model = transformers.SwitchTransformersEncoderModel(config).eval()
    inputs = (torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(1)),)
    report, output, recorder = run_hpu_moe(model, inputs)
    sparse = [name for name, module in model.named_modules() if type(module).__name__ == "SwitchTransformersExperts"]
    assert len(sparse) == 1 and len(report.declined) == 1, str(report)  # named from the block's own graph
    assert sparse[0].endswith(report.declined[0].candidate), str(report)
    assert all("an ungated MLP, down(relu(up(x)))" in d.reason for d in report.declined), str(report)
    assert not any("modeling_switch_transformers.py:17" in b.location for b in report.graph_breaks), str(report)
    assert not recorder.fused_nodes()
    assert_close_for_dtype(output, eager_output(model, inputs))
