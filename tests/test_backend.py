"""The backend's contract: entry point, options, fallbacks, inner backends, verification."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import moe_passes
from form_catalog import catalog
from moe_passes import lowering
from moe_passes.options import Options
from moe_passes.report import collecting
from tests.helpers import RecordingInner, assert_close_for_dtype, eager_output, run_hpu_moe


def _form(name="hf_grouped_mm", **overrides):
    return catalog()[name].build(**overrides)


def test_entry_point_works_in_a_fresh_interpreter_without_importing_the_package():
    script = textwrap.dedent(
        """
        import sys, torch
        assert "moe_passes" not in sys.modules
        def f(x):
            return torch.relu(x) + 1
        with torch.no_grad():
            out = torch.compile(f, backend="hpu_moe", options={"inner": "eager"})(torch.ones(3))
        assert torch.equal(out, torch.full((3,), 2.0))
        assert "moe_passes" in sys.modules
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")


def test_backend_is_listed_by_dynamo():
    from torch._dynamo.backends.registry import list_backends

    assert "hpu_moe" in list_backends(exclude_tags=())


@pytest.mark.parametrize(
    "options, error",
    [
        ({"bogus": 1}, "unknown hpu_moe option"),
        ({"target": "tpu"}, "target must be one of"),
        ({"inner": 3}, "inner must be a backend name or a callable"),
        ({"verify": "yes"}, "must be a bool"),
    ],
)
def test_bad_options_get_a_clear_error(options, error):
    with pytest.raises((ValueError, TypeError), match=error):
        Options.parse(options)


def test_bad_options_fail_the_compile_with_the_message():
    with pytest.raises(Exception, match="unknown hpu_moe option"):
        torch.compile(lambda x: x + 1, backend="hpu_moe", options={"bogus": 1})(torch.ones(2))


def test_target_hpu_without_the_bridge_is_an_error():
    if lowering.hpu_op_available():
        pytest.skip("an hpu op library is registered in this process")
    with pytest.raises(RuntimeError, match="Gaudi bridge"):
        lowering.resolve_target("hpu")
    assert lowering.resolve_target("auto") == "portable"


def test_explain_rejects_non_callables():
    with pytest.raises(TypeError, match="module or a function"):
        moe_passes.explain(42)


@pytest.mark.parametrize("inner", ["eager", "aot_eager", "inductor"])
def test_inner_backends_compose_with_the_rewrite(inner):
    model, inputs = _form()
    report, output, recorder = run_hpu_moe(model, inputs, inner=inner)
    assert len(report.fused) == 2 and len(recorder.fused_nodes()) == 2
    assert report.inner.startswith("recording")
    assert_close_for_dtype(output, eager_output(model, inputs))


def test_callable_inner_and_string_inner_by_name():
    model, inputs = _form()
    seen = []

    def inner(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    report = moe_passes.explain(model, *inputs, options={"inner": inner, "target": "portable"})
    assert report.inner == "inner" and len(seen) == 1 and len(report.fused) == 2


def test_default_inner_is_inductor_off_gaudi():
    from moe_passes.backend import default_inner

    assert default_inner() == "inductor"


def test_gradients_enabled_fuse_for_training():
    model, inputs = _form()
    recorder = RecordingInner("aot_eager")
    with collecting() as collector:
        out = torch.compile(model, backend="hpu_moe", options={"inner": recorder, "target": "portable"})(
            *inputs
        )
    assert len(recorder.fused_nodes()) == 2
    assert collector.records[0].fallback is None
    assert all(f.training for f in collector.records[0].fused)
    assert out.requires_grad


def test_disabled_option_leaves_the_graph_unrewritten():
    model, inputs = _form()
    report, output, recorder = run_hpu_moe(model, inputs, enabled=False)
    assert not report.fused and not recorder.fused_nodes()
    assert report.fallbacks == ["graph 0: disabled by options"]


def test_internal_error_falls_back_with_a_warning(monkeypatch):
    import moe_passes.backend_passes as backend_passes

    def broken(*args, **kwargs):
        raise KeyError("simulated bug")

    monkeypatch.setattr(backend_passes, "find_layers", broken)
    model, inputs = _form()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report, output, recorder = run_hpu_moe(model, inputs)
    assert any("simulated bug" in str(w.message) for w in caught)
    assert not recorder.fused_nodes() and not report.fused
    assert "KeyError" in report.fallbacks[0]
    assert_close_for_dtype(output, eager_output(model, inputs))


def test_verify_rejects_a_wrong_rewrite(monkeypatch):
    """A rewrite that computes something else (here: the wrong activation) must not survive verify."""
    import dataclasses

    import moe_passes.passes.pipeline as pipeline

    original = pipeline.rewrite_experts

    def wrong_activation(graph, match, target):
        return original(graph, dataclasses.replace(match, activation="relu"), target)

    monkeypatch.setattr(pipeline, "rewrite_experts", wrong_activation)
    model, inputs = _form()
    report, output, recorder = run_hpu_moe(model, inputs, verify=True)
    assert not report.fused and not recorder.fused_nodes()
    assert len(report.declined) == 2
    assert all("numerical verification failed" in d.reason for d in report.declined)
    assert_close_for_dtype(output, eager_output(model, inputs))


def test_verify_accepts_a_correct_rewrite():
    model, inputs = _form()
    report, output, recorder = run_hpu_moe(model, inputs, verify=True)
    assert len(report.fused) == 2 and not report.declined


def test_report_json_round_trips():
    import json

    model, inputs = _form()
    report, _, _ = run_hpu_moe(model, inputs)
    data = json.loads(report.to_json())
    assert data["graph_count"] == 1 and len(data["fused"]) == 2
    assert data["fused"][0]["overload"] == "moe_passes::mixture_of_experts.stacked_fused_weights"
    text = str(report)
    assert "fused MoE layers: 2" in text and "declined candidates: 0" in text


def test_dynamic_shapes_keep_one_fused_call_per_layer():
    model, inputs = _form("hf_batched_mm")  # float32: no bf16 rounding noise in the comparison
    generator = torch.Generator().manual_seed(0)
    recorder = RecordingInner()
    compiled = torch.compile(
        model, backend="hpu_moe", dynamic=True, options={"inner": recorder, "target": "portable"}
    )
    with torch.no_grad():
        for tokens in (3, 5, 9):
            x = torch.randn(1, tokens, inputs[0].shape[-1], generator=generator)
            assert_close_for_dtype(compiled(x), model(x))
    assert len(recorder.graphs) == 1 and len(recorder.fused_nodes()) == 2


def test_compile_mode_reaches_inductor(monkeypatch):
    import torch._inductor.compile_fx as compile_fx_module

    seen = []
    original = compile_fx_module.compile_fx

    def spy(gm, example_inputs, config_patches=None, **kwargs):
        seen.append(config_patches)
        return original(gm, example_inputs, config_patches=config_patches, **kwargs)

    monkeypatch.setattr(compile_fx_module, "compile_fx", spy)
    model, inputs = _form()
    with torch.no_grad():
        # torch.compile takes `mode` or `options`, not both: with mode alone the defaults apply.
        out = torch.compile(model, backend="hpu_moe", mode="max-autotune-no-cudagraphs")(*inputs)
    assert seen and seen[0].get("max_autotune") is True
    assert_close_for_dtype(out, eager_output(model, inputs))


def test_inner_failure_on_the_rewritten_graph_compiles_the_captured_one():
    """If the inner backend rejects the rewritten graph, the user still gets a compiled model."""
    from torch._dynamo.backends.registry import lookup_backend

    seen = []

    def picky_inner(gm, example_inputs):
        if any(n.op == "call_function" and "mixture_of_experts" in str(n.target) for n in gm.graph.nodes):
            raise RuntimeError("simulated inner backend failure")
        seen.append(gm)
        return lookup_backend("eager")(gm, example_inputs)

    model, inputs = _form()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report, output, _ = run_hpu_moe(model, inputs, inner=picky_inner)
    assert len(seen) == 1 and not report.fused
    assert len(report.declined) == 2 and "inner backend failed" in report.declined[0].reason
    assert any("simulated inner backend failure" in str(w.message) for w in caught)
    assert_close_for_dtype(output, eager_output(model, inputs))


class _UngatedWhereLoop(torch.nn.Module):
    """A loop over every expert selecting with `torch.where` (captured in one graph by the expert-loop
    adapter, which switches dynamo's capture of data-dependent shapes on for the loop and off after it),
    with ungated experts the finder declines: the captured graph reaches the inner backend as it is."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(8, 4, bias=False)
        self.experts = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)) for _ in range(4))

    def forward(self, x):
        weights, ids = torch.topk(self.gate(x).softmax(-1), 2)
        out = torch.zeros_like(x)
        for e in range(4):
            token, slot = torch.where(ids == e)
            out.index_add_(0, token, self.experts[e](x[token]) * weights[token, slot, None])
        return out


def test_an_inner_backend_that_cannot_compile_a_graph_the_adapter_captured_leaves_it_uncompiled():
    """The fallback of `_compile_captured` applies once the loop switched its setting off again."""

    def refusing_inner(gm, example_inputs):
        raise RuntimeError("simulated: no data-dependent shapes here")

    torch.manual_seed(0)
    model, inputs = _UngatedWhereLoop().eval(), (torch.randn(5, 8),)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report, output, _ = run_hpu_moe(model, inputs, inner=refusing_inner)
    assert report.graph_count == 1 and not report.fused and report.declined, str(report)
    assert any("capture_dynamic_output_shape_ops" in str(w.message) and "runs uncompiled" in str(w.message)
               for w in caught), [str(w.message) for w in caught]
    assert_close_for_dtype(output, eager_output(model, inputs))
