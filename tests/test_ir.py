"""The canonical ATen IR: graphs with torch.func transforms inside, and a failing trace that leaves no trace."""

from __future__ import annotations

import warnings

import pytest
import torch

from moe_passes import ir
from tests.helpers import assert_close_for_dtype, eager_output, requires_transformers_5, run_hpu_moe

transformers = pytest.importorskip("transformers")


def scan_then_mutate(x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """vmap inlined by dynamo (the `_vmap_increment_nesting` calls Mamba scans produce), plus an in-place
    update of an input buffer that functionalization must write back."""
    state.add_(x.sum(0))
    return torch.vmap(lambda row: row * 2 + row.sum())(x) + state


def captured(fn, *args) -> tuple[torch.fx.GraphModule, list]:
    graphs = []

    def keep(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=keep, fullgraph=True)(*args)
    return graphs[0]


def test_functorch_transforms_are_functionalized_in_python():
    gm, example_inputs = captured(scan_then_mutate, torch.randn(3, 4), torch.zeros(4))
    assert ir.uses_functorch_transforms(gm)
    canonical = ir.to_canonical_aten(gm, example_inputs)
    targets = {n.target for n in canonical.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.add_.Tensor not in targets  # the mutation became functional...
    assert torch.ops.aten.copy_.default in targets  # ...and is written back to the input once
    x, state, state_ref = torch.randn(3, 4), torch.ones(4), torch.ones(4)
    expected = scan_then_mutate(x, state_ref)
    assert [tuple(v.shape) for v in example_inputs] == [(4,), (3, 4)]  # dynamo's order: state, x
    torch.testing.assert_close(canonical(state, x)[0], expected)
    torch.testing.assert_close(state, state_ref)


def test_failed_trace_inside_a_transform_falls_back_and_keeps_the_frame_valid(monkeypatch):
    """functorch's C++ functionalize asserts under vmap levels; without undoing the levels it pushed,
    dynamo would reject its own frame ("Guard failed on the same frame") and the user's compile would fail."""
    monkeypatch.setattr(ir, "uses_functorch_transforms", lambda gm: False)  # force the C++ transform
    x, state = torch.randn(3, 4), torch.zeros(4)
    expected = scan_then_mutate(x, state.clone())
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(scan_then_mutate, backend="hpu_moe", options={"inner": "eager"})(x, state)
    torch.testing.assert_close(out, expected)
    assert sum("hpu_moe" in str(w.message) for w in caught) == 1
    assert torch._C._functorch.peek_interpreter_stack() is None


@requires_transformers_5
def test_jamba_with_its_associative_scan_is_fused():
    """Jamba's Mamba mixer runs `associative_scan` (vmap inside) in the same graph as its MoE layers."""
    config = transformers.JambaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
        expert_layer_period=1,
        expert_layer_offset=0,
        attn_layer_period=2,
        attn_layer_offset=1,
        mamba_d_state=4,
        mamba_d_conv=2,
        mamba_expand=2,
        mamba_dt_rank=4,
        use_mamba_kernels=False,
    )
    torch.manual_seed(0)
    model = transformers.JambaForCausalLM(config).eval()
    inputs = (torch.randint(0, 64, (1, 6)),)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert (report.graph_count, report.graph_break_count, report.fallbacks) == (1, 0, [])
    assert len(report.fused) == 2 and len(recorder.fused_nodes()) == 2
    assert_close_for_dtype(output, eager_output(model, inputs))


_lib = torch.library.Library("moe_passes_ir_test", "DEF")  # noqa: TOR901 - a test op, defined once
_lib.define("scale_into(Tensor(a!) out, Tensor x, float factor) -> ()")


def _scale_into(out, x, factor):
    out.copy_(x * factor)


_lib.impl("scale_into", _scale_into, "CompositeExplicitAutograd")
_lib.impl("scale_into", lambda out, x, factor: None, "Meta")


def write_through_a_kernel(x: torch.Tensor) -> torch.Tensor:
    """A library kernel that writes its result into an argument and returns nothing (vLLM's CPU MoE)."""
    out = torch.empty_like(x)
    torch.ops.moe_passes_ir_test.scale_into(out, x, 2.0)
    return out + 1


def test_custom_ops_that_write_into_an_argument_are_functionalized_in_python():
    gm, example_inputs = captured(write_through_a_kernel, torch.randn(3, 4))
    assert ir.mutates_through_custom_ops(gm) and not ir.uses_functorch_transforms(gm)
    canonical = ir.to_canonical_aten(gm, example_inputs)
    x = torch.randn(3, 4)
    torch.testing.assert_close(canonical(x)[0], write_through_a_kernel(x))
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "internal error" fallback warning
        out = torch.compile(write_through_a_kernel, backend="hpu_moe", options={"inner": "eager"})(x)
    torch.testing.assert_close(out, x * 2 + 1)
