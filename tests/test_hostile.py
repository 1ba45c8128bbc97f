"""Hostile inputs and faults: the backend is never wrong and never in the way.

tests/test_backend.py covers the basic contract (grad-enabled graphs left unrewritten, an internal
error falls back with a warning, unknown options rejected). Here: backward through a compiled model is
unchanged, no_grad and inference_mode, non-contiguous and transposed weights and inputs, mixed dtypes,
empty batches, symbolic and unbacked token counts, faults injected in each stage of the pass (exactly
one warning, the captured graph runs), and every malformed option failing the compile clearly.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from torch import nn

import moe_passes
from form_catalog import catalog, dynamo_config
from moe_passes.report import collecting
from tests.helpers import RecordingInner, assert_close_for_dtype, eager_output, run_hpu_moe
from tests.loop_models import H, SeparateGatedExpert

FORMS = catalog()


def build(name="hf_batched_mm", **overrides):
    return FORMS[name].build(layers=1, **overrides)


def compile_with(model, recorder, **compile_kwargs):
    options = {"inner": recorder, "target": "portable"}
    return torch.compile(model, backend="hpu_moe", options=options, **compile_kwargs)


# ---------------------------------------------------------------------------------------------------
# Gradients, no_grad, inference_mode


def test_training_graphs_are_fused_and_backward_is_unchanged():
    model, (x,) = build("modulelist_dense_mask")
    x = x.clone().requires_grad_(True)
    expected = model(x)
    expected.square().sum().backward()
    want = {name: p.grad.clone() for name, p in model.named_parameters()}
    want_x = x.grad.clone()
    model.zero_grad()
    x.grad = None
    recorder = RecordingInner("aot_eager")
    with collecting() as collector:
        out = compile_with(model, recorder)(x)
    out.square().sum().backward()
    assert len(recorder.fused_nodes()) == 1
    assert all(r.fallback is None and all(f.training for f in r.fused) for r in collector.records)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(x.grad, want_x)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], msg=name)


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_no_grad_and_inference_mode_are_fused_and_equal(context):
    model, inputs = build()
    recorder = RecordingInner()
    with context():
        expected = model(*inputs)
        out = compile_with(model, recorder)(*inputs)
    assert len(recorder.fused_nodes()) == 1
    assert_close_for_dtype(out, expected)


def test_parameters_frozen_with_grad_enabled_are_fused():
    """requires_grad=False everywhere: nothing can need a gradient, so the rewrite applies."""
    model, inputs = build()
    model.requires_grad_(False)
    recorder = RecordingInner()
    out = compile_with(model, recorder)(*inputs)
    assert len(recorder.fused_nodes()) == 1
    assert_close_for_dtype(out, eager_output(model, inputs))


# ---------------------------------------------------------------------------------------------------
# Layouts and dtypes


def _non_contiguous(tensor: torch.Tensor) -> nn.Parameter:
    """The same values, stored transposed in memory (a non-contiguous view of the transpose)."""
    return nn.Parameter(tensor.detach().transpose(-2, -1).contiguous().transpose(-2, -1))


@pytest.mark.parametrize("name", ["hf_batched_mm", "static_dense_loop", "modulelist_dense_mask"])
def test_non_contiguous_weights_are_fused_and_equal(name):
    model, inputs = build(name)
    with torch.no_grad():
        for module in model.modules():
            for attr, param in list(module.named_parameters(recurse=False)):
                if param.dim() >= 2:
                    setattr(module, attr, _non_contiguous(param))
    assert any(not p.is_contiguous() for p in model.parameters())
    report, output, recorder = run_hpu_moe(model, inputs)
    assert len(recorder.fused_nodes()) == 1, str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


def test_non_contiguous_and_transposed_inputs_are_fused_and_equal():
    model, (x,) = build(tokens=7)
    strided = torch.stack([x, x], dim=-1).flatten(-2)[..., ::2]  # x's values, hidden stride 2
    assert not strided.is_contiguous() and torch.equal(strided, x)
    report, output, recorder = run_hpu_moe(model, (strided,))
    assert len(recorder.fused_nodes()) == 1, str(report)
    assert_close_for_dtype(output, eager_output(model, (x,)))
    hidden_major = x[0].t().contiguous().t().unsqueeze(0)  # column-major [T, H]
    assert not hidden_major.is_contiguous()
    report, output, _ = run_hpu_moe(model, (hidden_major,))
    assert len(report.fused) == 1, str(report)
    assert_close_for_dtype(output, eager_output(model, (x,)))


def test_one_expert_in_another_dtype_is_declined_and_equal():
    model, inputs = build("modulelist_dense_mask", dtype=torch.bfloat16)
    odd = model.moes[0].experts[1]
    odd.float()
    forward = odd.forward
    odd.forward = lambda x: forward(x.float()).to(x.dtype)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert not recorder.fused_nodes(), str(report)
    assert report.declined, str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


def test_float32_router_over_bfloat16_experts_is_fused_and_equal():
    model, inputs = build("hf_batched_mm", dtype=torch.bfloat16)
    moe = model.moes[0]
    moe.gate.float()
    route = moe.gate.forward
    moe.gate.forward = lambda x: route(x.float())
    report, output, recorder = run_hpu_moe(model, inputs)
    assert len(recorder.fused_nodes()) == 1, str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


# ---------------------------------------------------------------------------------------------------
# Empty batches, symbolic and unbacked sizes


EMPTY_BATCH_CHECK = "the batch is empty at compile time, so which expert takes which weight cannot be checked"


@pytest.mark.parametrize(
    "name, fused",
    [("hf_batched_mm", 1), ("modulelist_dense_mask", 0), ("hf4_sparse_loop", 0)],
)
def test_empty_batches_run_and_are_equal(name, fused):
    """A GEMM form needs no tokens to be read; a loop's expert-to-weight check does, and says so."""
    form = FORMS[name]
    model, (x,) = build(name)
    empty = x[:, :0]
    with dynamo_config(form):
        report, output, recorder = run_hpu_moe(model, (empty,))
    assert output.shape == empty.shape
    assert len(report.fused) == fused, str(report)
    assert [d.reason for d in report.declined] == ([] if fused else [EMPTY_BATCH_CHECK]), str(report)
    assert not report.fallbacks, str(report)


def test_batch_and_sequence_both_symbolic():
    model, (x,) = build()
    recorder = RecordingInner()
    compiled = compile_with(model, recorder, dynamic=True)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for batch, seq in ((2, 3), (3, 5), (4, 7)):
            y = torch.randn(batch, seq, x.shape[-1], generator=generator)
            assert_close_for_dtype(compiled(y), model(y))
    assert len(recorder.graphs) == 1 and len(recorder.fused_nodes()) == 1


@pytest.mark.parametrize("name", ["hf_batched_mm", "modulelist_dense_mask"])
def test_an_unbacked_token_count_is_handled(name):
    """Tokens selected by a boolean mask have a data-dependent (unbacked) count."""
    model, (x,) = build(name, tokens=9)
    moe = model.moes[0]

    def selected_tokens(x, keep):
        return moe(x[:, keep])

    keep = torch.tensor([True, False, True, True, False, True, True, False, True])
    recorder = RecordingInner()
    with (
        collecting() as collector,
        torch.no_grad(),
        torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True),
    ):
        out = torch.compile(selected_tokens, backend="hpu_moe", options={"inner": recorder})(x, keep)
    assert not any(r.fallback for r in collector.records), [r.fallback for r in collector.records]
    assert recorder.fused_nodes() or any(r.declined for r in collector.records)
    with torch.no_grad():
        assert_close_for_dtype(out, selected_tokens(x, keep))


# ---------------------------------------------------------------------------------------------------
# Faults inside the passes


def _boom(*args, **kwargs):
    raise RuntimeError("injected fault")


@pytest.mark.parametrize(
    "where",
    [
        "moe_passes.backend_passes.to_canonical_aten",
        "moe_passes.passes.pipeline.check",
        "moe_passes.passes.pipeline.rewrite_experts",
        "moe_passes.passes.rewrite.lowering.call_arguments",
    ],
)
def test_a_fault_in_any_stage_falls_back_with_exactly_one_warning(monkeypatch, where):
    monkeypatch.setattr(where, _boom)
    model, inputs = FORMS["hf_batched_mm"].build()  # two layers: a fault in the second is mid-rewrite
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report, output, recorder = run_hpu_moe(model, inputs)
    ours = [w for w in caught if "hpu_moe" in str(w.message)]
    assert len(ours) == 1 and issubclass(ours[0].category, RuntimeWarning), [str(w.message) for w in ours]
    assert "injected fault" in str(ours[0].message)
    assert not recorder.fused_nodes() and not report.fused
    assert len(report.fallbacks) == 1 and "internal error" in report.fallbacks[0]
    assert_close_for_dtype(output, eager_output(model, inputs))


def test_a_finder_that_raises_declines_its_layer_and_the_others_still_fuse(monkeypatch):
    """A bug in one finder costs the candidate it was reading, not the graph: one warning, one decline
    naming the form, every other layer fused."""
    import moe_passes.passes.experts_batched_mm as finder
    import moe_passes.passes.pipeline as pipeline

    original, calls = finder.match_at, []

    def first_raises(node):
        calls.append(node)
        if len(calls) == 1:
            raise RuntimeError("injected fault")
        return original(node)

    broken = dataclasses.replace(finder.FINDER, match=first_raises)
    monkeypatch.setattr(pipeline, "FINDERS", tuple(broken if f is finder.FINDER else f for f in pipeline.FINDERS))
    model, inputs = FORMS["hf_batched_mm"].build()  # two layers
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report, output, recorder = run_hpu_moe(model, inputs)
    ours = [w for w in caught if "hpu_moe" in str(w.message)]
    assert len(ours) == 1 and "injected fault" in str(ours[0].message), [str(w.message) for w in ours]
    assert len(recorder.fused_nodes()) == 1 and len(report.fused) == 1, str(report)
    assert [d.reason for d in report.declined] == ["internal error in batched_mm: RuntimeError: injected fault"]
    assert not report.fallbacks
    assert_close_for_dtype(output, eager_output(model, inputs))


def test_a_fault_after_the_first_layer_is_rewritten_keeps_the_captured_graph(monkeypatch):
    """The rewrite edits the canonical copy in place; a fault half-way must not leak a half-rewritten graph."""
    import moe_passes.passes.pipeline as pipeline

    original, calls = pipeline.rewrite_experts, []

    def second_fails(graph, match, target):
        calls.append(match)
        if len(calls) == 2:
            raise RuntimeError("injected fault in layer 2")
        return original(graph, match, target)

    monkeypatch.setattr(pipeline, "rewrite_experts", second_fails)
    model, inputs = FORMS["modulelist_dense_mask"].build()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report, output, recorder = run_hpu_moe(model, inputs)
    assert len(calls) == 2 and len([w for w in caught if "hpu_moe" in str(w.message)]) == 1
    assert not recorder.fused_nodes()
    assert_close_for_dtype(output, eager_output(model, inputs))


# ---------------------------------------------------------------------------------------------------
# Malformed options


@pytest.mark.parametrize(
    "options, message",
    [
        ({"target": "gaudi"}, "target must be one of"),
        ({"inner": 3}, "inner must be a backend name or a callable"),
        ({"strict": 1}, "strict must be a bool"),
        ({"enabled": "no"}, "enabled must be a bool"),
        ({"verfy": True}, "unknown hpu_moe option"),
        ({"inner": "no_such_backend"}, r"option inner: no backend named 'no_such_backend' is registered; "
         r"registered backends: \[.*'inductor'"),
        ({"inner": "hpu_moe"}, "cannot be hpu_moe itself"),
        ({"forms": []}, r"option forms must name at least one form of \['grouped_mm'.*enabled=False"),
        ({"forms": ["nope"]}, r"option forms: unknown form\(s\) \['nope'\]; known forms"),
        ({"fuse_routing": "auto"}, "fuse_routing must be None"),
    ],
)
def test_malformed_options_fail_the_compile_with_a_clear_message(options, message):
    model, inputs = build()
    with pytest.raises(Exception, match=message):
        torch.compile(model, backend="hpu_moe", options=options)(*inputs)
    with pytest.raises(Exception, match=message):
        moe_passes.explain(model, *inputs, options=options)


def test_options_that_are_not_a_dict_are_rejected():
    model, inputs = build()
    with pytest.raises(Exception, match="options must be a dict"):
        moe_passes.explain(model, *inputs, options=[("inner", "eager")])


def test_values_read_as_numbers_in_the_graph_are_reported_not_warned_about(monkeypatch):
    """torch 2.9's dynamo keeps `.tolist()` in the graph without scalar capture; the canonical trace
    cannot follow it: a construct, reported as the fallback's reason, not an internal error."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    def reads_a_value(*_args, **_kwargs):
        raise DataDependentOutputException(torch.ops.aten._local_scalar_dense.default)

    monkeypatch.setattr("moe_passes.backend_passes.to_canonical_aten", reads_a_value)
    model, inputs = FORMS["hf_batched_mm"].build(layers=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report, output, recorder = run_hpu_moe(model, inputs)
    assert not [w for w in caught if "hpu_moe" in str(w.message)]
    assert len(report.fallbacks) == 1 and "`.item()` / `.tolist()`" in report.fallbacks[0], report.fallbacks
    assert_close_for_dtype(output, eager_output(model, inputs))


class _CapacityReadThenDenseLoop(nn.Module):
    """A number read on the host from the counts (a graph break), then a dense mask loop that scales each
    expert's output by that number: the finder cannot vary it under its probes."""

    def __init__(self, hidden=H, experts=4):
        super().__init__()
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(SeparateGatedExpert() for _ in range(experts))

    def forward(self, x):
        weights, ids = self.gate(x).softmax(-1).topk(2)
        capacity = int(torch.bincount(ids.flatten(), minlength=len(self.experts)).max().item())
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + expert(x) * (weights * (ids == e)).sum(-1, keepdim=True) * capacity
        return out


def test_an_expert_scaled_by_a_number_from_before_a_break_is_declined_not_an_internal_error():
    torch.manual_seed(0)
    model, inputs = _CapacityReadThenDenseLoop().eval(), (torch.randn(6, H),)
    report, output, _ = run_hpu_moe(model, inputs)
    assert not report.fused, str(report)
    reasons = [d.reason for d in report.declined]
    assert any("not made from the routing ids and weights" in r for r in reasons), str(report)
    assert not any("internal error" in r for r in reasons), str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))
