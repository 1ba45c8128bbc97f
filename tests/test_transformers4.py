"""Real transformers 4.x models: the loops over the hit experts (4.45+) and range(E) loops are fused.

Runs when the installed transformers is a 4.x release (it skips under 5.x, which the rest of the suite
covers). With the 4.x wheels beside the development environment:

    pip install --target /tmp/tf455 transformers==4.55.4
    PYTHONPATH=/tmp/tf455 .venv/bin/python -m pytest -q tests/test_transformers4.py
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not transformers.__version__.startswith("4."):
    pytest.skip(f"transformers {transformers.__version__} is not a 4.x release", allow_module_level=True)

from moe_passes.tiny_models import inputs, moe_families, tiny_model  # noqa: E402
from tests.helpers import (  # noqa: E402
    assert_close_for_dtype,
    eager_output,
    run_hpu_moe,
    skip_unless_dynamo_slices_for,
)

# Hit-expert loops (`for expert_idx in expert_hit`), range(E) loops with torch.where (OLMoE, FlexOlmo),
# and range(E) loops in a `moe` method with an `if token_indices.numel() > 0:` guard (DeepSeek-V3,
# GLM-4-MoE, dots1). Families a release lacks are skipped.
HIT_LOOP_FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "minimax", "ernie4_5_moe", "hunyuan_v1_moe"]
RANGE_LOOP_FAMILIES = ["olmoe", "flex_olmo", "deepseek_v3", "glm4_moe", "dots1"]
# GPT-OSS: 4.57 on CPU loops over the hit experts (`expert_idx = expert_idx[0]`, a sentinel class skipped
# by `continue`); 4.55 (and 4.57 off CPU) runs every token through every expert with repeat + bmm.
GPT_OSS = ["gpt_oss"]
# Sorted rows cut into per-expert segments with sizes from `.tolist()` (scalar capture switched on by the
# adapter); JetMoE's mixture-of-attention-heads experts are not gated MLPs and stay declined.
# DeepSeek-V2: a loop over the counts with `if n == 0: continue` (removed by the adapter), tensor-bounded
# slices. Aria: cumsum offsets in a submodule, outputs written over their rows (slice_scatter).
SEGMENT_FAMILIES = ["granitemoe", "granitemoeshared", "jetmoe", "deepseek_v2", "aria"]
# 4.57 text models of multimodal families (their tiny configs need 4.x M-RoPE sections).
MULTIMODAL_TEXT_FAMILIES = ["qwen3_vl_moe", "qwen3_omni_moe"]


def _run(family: str):
    if family not in moe_families():
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    if family == "aria":  # slices at tensor offsets in a module-level function, as the catalog form does
        skip_unless_dynamo_slices_for("aria4_offset_segments")
    torch.manual_seed(0)
    model = tiny_model(family, None)
    args, _ = inputs(model)
    report, output, recorder = run_hpu_moe(model, args)
    return model, args, report, output, recorder


# Range loops with `if top_x.shape[0] == 0: continue`, in models whose attention or rotary code breaks
# the graph elsewhere (mask updates, a seq_len item): every MoE layer fused all the same.
BREAKS_ELSEWHERE_FAMILIES = ["jamba", "phimoe", "granitemoehybrid"]


def _moe_forward_lines(model) -> set[str]:
    """"file:line" of every line of the sparse MoE blocks' forward (the modules holding the experts: a
    ModuleList, or GraniteMoE-Hybrid's segmented `input_linear`)."""
    lines = set()
    for module in model.modules():
        if isinstance(getattr(module, "experts", None), torch.nn.ModuleList) or hasattr(module, "input_linear"):
            forward = getattr(type(module).forward, "__moe_passes_original__", type(module).forward)
            code = forward.__code__
            lines |= {f"{code.co_filename}:{line}" for _, _, line in code.co_lines() if line is not None}
    return lines


@pytest.mark.parametrize("family", BREAKS_ELSEWHERE_FAMILIES)
def test_moe_layers_fuse_in_models_that_break_elsewhere(family):
    model, args, report, output, recorder = _run(family)
    assert len(report.fused) == 2 and not report.declined, str(report)
    moe_lines = _moe_forward_lines(model)
    assert moe_lines and not any(b.location in moe_lines for b in report.graph_breaks), str(report)
    assert_close_for_dtype(output, eager_output(model, args))


@pytest.mark.parametrize(
    "family", HIT_LOOP_FAMILIES + RANGE_LOOP_FAMILIES + GPT_OSS + SEGMENT_FAMILIES + MULTIMODAL_TEXT_FAMILIES
)
def test_every_moe_layer_is_one_fused_call_in_one_graph(family):
    model, args, report, output, recorder = _run(family)
    assert (report.graph_count, report.graph_break_count) == (1, 0), str(report)
    assert len(recorder.fused_nodes()) == 2, str(report)
    if family == "jetmoe":
        assert all("mixture of attention heads" in d.reason for d in report.declined), str(report)
    else:
        assert not report.declined, str(report)
    if family in GPT_OSS:
        assert all(f.overload.endswith(".bias_fused_weights") for f in report.fused), str(report)
    assert_close_for_dtype(output, eager_output(model, args))


def test_mixtral_top1_routing():
    """Top-1: the hit loop indexes with [1]-shaped tensors, whose shapes differ from int indexing."""
    torch.manual_seed(0)
    model = tiny_model("mixtral", None)
    for layer in model.model.layers:
        layer.block_sparse_moe.top_k = 1
    args, _ = inputs(model)
    report, output, recorder = run_hpu_moe(model, args)
    assert len(recorder.fused_nodes()) == 2 and report.graph_break_count == 0, str(report)
    assert all(f.top_k == 1 for f in report.fused)
    assert_close_for_dtype(output, eager_output(model, args))


def test_switch_transformers_hit_list_over_mask_columns_is_captured_and_declined_as_ungated():
    """4.x Switch Transformers: `idx_mask = torch.nonzero(router_mask.reshape(b * s, E).sum(0), as_tuple=True)[0]
    .tolist()` over a [B, S, E] boolean mask, rows `router_mask[:, :, idx]`, experts `getattr(self.experts,
    f"expert_{idx}")`, stores into a [B, S, H] buffer. Captured in the experts' graph (the router breaks
    the graph earlier, at its `self.classifier = self.classifier.to(dtype)`); its experts, relu MLPs without
    a gate, are declined for that."""
    config = transformers.SwitchTransformersConfig(
        vocab_size=64, d_model=16, d_ff=8, d_kv=8, num_heads=2, num_layers=2, num_sparse_encoder_layers=1,
        num_experts=4, expert_capacity=64)
    torch.manual_seed(0)
    model = transformers.SwitchTransformersEncoderModel(config).eval()
    args = (torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(1)),)
    report, output, recorder = run_hpu_moe(model, args)
    assert len(report.declined) == 1 and not recorder.fused_nodes(), str(report)
    assert "an ungated MLP, down(relu(up(x)))" in report.declined[0].reason, str(report)
    assert not any("tolist" in b.reason or "nonzero" in b.reason for b in report.graph_breaks), str(report)
    assert_close_for_dtype(output[0], eager_output(model, args)[0])
