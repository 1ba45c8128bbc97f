"""The adapter for real vLLM (moe_passes/adapters/vllm.py) and its vLLM plugin entry point.

vLLM cannot be installed on the CPU machines, so most tests run the adapter on classes that mirror the
structure of vLLM's own, release by release (tests/vllm_mirrors.py names the files and releases). The
tests at the end need vLLM itself and skip when it is absent.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import sys
import types
from pathlib import Path

import pytest
import tomllib
import torch
from torch import nn
from torch._dynamo.utils import counters

import moe_passes
from moe_passes.adapters import vllm as vllm_adapter
from moe_passes.report import collecting
from tests import vllm_mirrors as mirrors
from tests.vllm_mirrors import OP_CALLS, FusedMoEConfig, build, run

ROOT = Path(__file__).resolve().parent.parent
PORTABLE_EAGER = {"inner": "eager", "target": "portable"}
RUNNER_MODULE = "vllm.model_executor.layers.fused_moe.runner.moe_runner"
DEFAULT_RUNNER_MODULE = "vllm.model_executor.layers.fused_moe.runner.default_moe_runner"
LAYER_MODULE = "vllm.model_executor.layers.fused_moe.layer"
LAYERS = 32


def loaded(runner_cls, layer_cls=None, runner_module=RUNNER_MODULE, runner_name="MoERunner"):
    """A `sys.modules`-like mapping holding the classes where vLLM keeps them."""
    modules = {runner_module: types.SimpleNamespace(**{runner_name: runner_cls})}
    if layer_cls is not None:
        modules[LAYER_MODULE] = types.SimpleNamespace(FusedMoE=layer_cls)
    return modules


def adapted_033():
    runner = mirrors.mirror_033()
    assert vllm_adapter.install_if_loaded(loaded(runner)) == [f"{RUNNER_MODULE}.MoERunner"]
    return runner, lambda name, registry, **config: runner(name, FusedMoEConfig(**config), registry)


def adapted_022():
    runner, layer = mirrors.mirror_022()
    assert vllm_adapter.install_if_loaded(loaded(runner, layer)) == [f"{RUNNER_MODULE}.MoERunner"]
    return runner, lambda name, registry, **config: layer(name, FusedMoEConfig(**config), registry)


def adapted_019():
    runner, layer = mirrors.mirror_019()
    modules = loaded(runner, layer, DEFAULT_RUNNER_MODULE, "DefaultMoERunner")
    assert vllm_adapter.install_if_loaded(modules) == [f"{DEFAULT_RUNNER_MODULE}.DefaultMoERunner"]
    return runner, lambda name, registry, **config: layer(name, FusedMoEConfig(**config), registry)


RELEASES = {"0.25-0.33": adapted_033, "0.20-0.22": adapted_022, "0.17-0.19": adapted_019}


@pytest.fixture(scope="module")
def adapted():
    """One adapted class set per mirrored release: {release: (runner class, make_experts)}."""
    return {release: adapt() for release, adapt in RELEASES.items()}


@pytest.fixture
def fresh():
    OP_CALLS["moe_forward"] = 0
    counters.clear()
    yield


def compile_each(model, **options):
    return [
        torch.compile(layer, backend="hpu_moe", options={**PORTABLE_EAGER, **options})
        for layer in model.layers
    ]


# --- which convention, and installing for it ---


def test_api_shapes_are_detected_by_feature():
    shape = vllm_adapter.detect_api_shape(mirrors.mirror_033())
    assert shape.name == vllm_adapter.RUNNER_MODULE
    assert shape.convention == vllm_adapter.Convention("_forward_entry", "_forward_impl", 4)
    runner, layer = mirrors.mirror_022()
    shape = vllm_adapter.detect_api_shape(runner, layer)
    assert shape.convention == vllm_adapter.Convention("_forward_entry", "_forward_impl", 4, "layer_init")
    orphan = vllm_adapter.detect_api_shape(runner)  # no FusedMoE class to learn the layer from
    assert not orphan.supported and "needs the layer that owns the runner" in orphan.reason
    runner, layer = mirrors.mirror_019()
    shape = vllm_adapter.detect_api_shape(runner, layer)
    assert shape.convention == vllm_adapter.Convention("moe_forward", "forward_impl", 3, "runner_init")
    layer_shape = vllm_adapter.detect_api_shape(mirrors.FusedMoE016)
    assert not layer_shape.supported and "forward_native" in layer_shape.reason


def test_replaced_and_unknown_forwards_are_declined():
    def replaced_forward(self, hidden_states, router_logits, input_ids=None):
        """Stands for vllm-gaudi's `_patched_default_moe_runner_forward` (another module's function)."""
        return self._forward_impl(hidden_states, router_logits, None, input_ids)

    base = mirrors.mirror_033()
    patched = type("MoERunner", (base,), {"forward": replaced_forward, "__module__": "vllm.fake"})
    replaced = vllm_adapter.detect_api_shape(patched)
    assert replaced.name == "forward replaced" and "replaced_forward" in replaced.reason
    unknown = type("Experts", (nn.Module,), {"forward": lambda self, x: x, "__module__": __name__})
    assert vllm_adapter.detect_api_shape(unknown).name == "unknown"
    method_entry = type("MoERunner", (base,), {"_forward_entry": lambda self, *args: None})
    declined = vllm_adapter.detect_api_shape(method_entry)
    assert not declined.supported and "defined on the class" in declined.reason


@pytest.mark.parametrize("release", ["0.10-0.16", "0.20-0.22 without FusedMoE"])
def test_declined_classes_are_left_untouched_with_one_log_line(release, caplog):
    cls = mirrors.FusedMoE016 if release == "0.10-0.16" else mirrors.mirror_022()[0]
    before = dict(vars(cls))
    with caplog.at_level(logging.INFO, logger="moe_passes"):
        assert vllm_adapter.install_if_loaded(loaded(cls)) == []
        assert vllm_adapter.install_if_loaded(loaded(cls)) == []  # logged once, not per compile
    assert dict(vars(cls)) == before
    (line,) = [r.getMessage() for r in caplog.records if "left as is" in r.getMessage()]
    assert line.startswith(f"vLLM adapter: {RUNNER_MODULE}.MoERunner left as is")


def test_install_is_recorded_and_done_once(adapted):
    runner, _ = adapted["0.25-0.33"]
    assert isinstance(vars(runner)["_forward_entry"], property)
    assert vllm_adapter.install_if_loaded(loaded(runner)) == []
    assert (
        moe_passes.adapters.adapted_classes()[f"{runner.__module__}.{runner.__qualname__}"]
        == vllm_adapter.NAME
    )


@pytest.mark.parametrize("release", RELEASES)
def test_adapted_classes_are_still_recognised(adapted, release):
    """What install_if_loaded (or a report) finds after installing is what it found before."""
    runner_cls, make_experts = adapted[release]
    layer_cls = type(make_experts("experts", {}))
    again = vllm_adapter.detect_api_shape(runner_cls, None if layer_cls is runner_cls else layer_cls)
    assert again.supported and again.convention.entry in vars(runner_cls)


def test_the_recorded_layer_stays_out_of_the_module_tree(adapted):
    _, make_experts = adapted["0.20-0.22"]
    layer = make_experts("experts", {})
    assert layer.runner._moe_passes_owner is layer
    assert [name for name, _ in layer.named_modules()] == ["", "experts", "runner"]
    assert all(not key.startswith("runner.") for key in layer.state_dict())


# --- what runs: vLLM's op in eager and other backends, the layer by reference under hpu_moe ---


@pytest.mark.parametrize("release", RELEASES)
def test_eager_keeps_vllms_opaque_op_and_layer_name(adapted, release, fresh):
    runner_cls, make_experts = adapted[release]
    model, x = build(2, make_experts)
    experts = model.layers[0].experts
    runner = experts if isinstance(experts, runner_cls) else experts.runner
    assert runner._encode_layer_name() == "model.layers.0.mlp.experts"
    run(model.layers, model, x)
    assert OP_CALLS["moe_forward"] == 2


@pytest.mark.parametrize("release", RELEASES)
def test_each_layer_compiled_alone_shares_one_compile_under_hpu_moe(adapted, release, fresh):
    model, x = build(LAYERS, adapted[release][1])
    expected = run(model.layers, model, x)
    OP_CALLS["moe_forward"] = 0
    with collecting() as collector:
        out = run(compile_each(model), model, x)
    assert counters["frames"]["ok"] == 1 and counters["frames"]["total"] == 1, dict(counters["frames"])
    assert not counters["graph_break"] and not counters["recompiles"]
    (record,) = collector.records
    assert len(record.fused) == 1 and not record.declined and record.fallback is None
    assert OP_CALLS["moe_forward"] == 0  # every layer ran the op's body by reference, compiled
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


def test_other_backends_keep_the_opaque_op_and_recompile_per_layer(adapted, fresh):
    model, x = build(4, adapted["0.25-0.33"][1])
    expected = run(model.layers, model, x)
    OP_CALLS["moe_forward"] = 0
    out = run([torch.compile(layer, backend="eager") for layer in model.layers], model, x)
    assert OP_CALLS["moe_forward"] == 4  # the opaque op ran in every layer
    assert counters["frames"]["ok"] == 4, dict(counters["frames"])  # one compile per layer name
    torch.testing.assert_close(out, expected)


def test_adapter_option_off_keeps_the_opaque_op(adapted, fresh):
    model, x = build(3, adapted["0.25-0.33"][1])
    run(compile_each(model, adapters=False), model, x)
    assert OP_CALLS["moe_forward"] == 3


def test_a_layer_wrapped_by_lora_keeps_the_opaque_op(adapted, fresh):
    """vLLM's FusedMoEWithLoRA sets the routed experts' `lora_base_layer_prefix` to "base_layer." (it is ""
    without LoRA): its dual-stream path relies on the op boundary, so the op stays."""
    model, x = build(2, adapted["0.25-0.33"][1])
    for layer in model.layers:
        assert layer.experts.routed_experts.lora_base_layer_prefix == ""
        layer.experts.routed_experts.lora_base_layer_prefix = "base_layer."
    expected = run(model.layers, model, x)
    OP_CALLS["moe_forward"] = 0
    out = run(compile_each(model), model, x)
    assert OP_CALLS["moe_forward"] == 2
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("release", RELEASES)
def test_several_data_parallel_ranks_keep_the_opaque_op(adapted, release, fresh):
    """dp_size 2: dispatch/combine read the context's token counts, so the op (and the name) stay."""
    model, x = build(2, lambda name, registry: adapted[release][1](name, registry, dp_size=2))
    expected = run(model.layers, model, x, dp_ranks=2)
    OP_CALLS["moe_forward"] = 0
    out = run(compile_each(model), model, x, dp_ranks=2)
    assert OP_CALLS["moe_forward"] == 2
    torch.testing.assert_close(out, expected)


def test_shared_experts_flow_through_vllms_own_combine(adapted, fresh):
    """moe_forward_shared's path: `_forward_impl` returns (shared, routed); forward adds them."""
    runner_cls, _ = adapted["0.25-0.33"]

    def make_experts(name, registry):
        shared = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        return runner_cls(name, FusedMoEConfig(), registry, shared_experts=shared)

    model, x = build(4, make_experts)
    expected = run(model.layers, model, x)
    OP_CALLS["moe_forward"] = 0
    out = run(compile_each(model), model, x)
    assert OP_CALLS["moe_forward"] == 0 and counters["frames"]["ok"] == 1 and not counters["graph_break"]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


def test_padding_and_truncation_stay_vllms(adapted, fresh):
    """forward's own pre/post-processing runs under the adapter: hidden 16 padded to 24 and cut back."""
    runner_cls, _ = adapted["0.25-0.33"]
    registry: dict[str, nn.Module] = {}
    runner = runner_cls("experts", FusedMoEConfig(hidden_dim=24), registry, hidden=24)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in runner.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    x, logits = torch.randn(7, 16, generator=generator), torch.randn(7, 4, generator=generator)
    compiled = torch.compile(runner, backend="hpu_moe", options=PORTABLE_EAGER)
    holder = types.SimpleNamespace(static_forward_context=registry)
    with torch.no_grad(), mirrors.forward_context(holder), collecting() as collector:
        expected = runner(x, logits)
        out = compiled(x, logits)
    assert out.shape == (7, 16) and OP_CALLS["moe_forward"] == 1  # the eager call only
    assert len(collector.records[0].fused) == 1
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("release", RELEASES)
def test_layers_found_by_counting_keep_the_opaque_op(adapted, release, fresh):
    """fast_moe_cold_start: the n-th op call runs the n-th layer, so no layer may skip the op."""
    model, x = build(3, adapted[release][1])
    expected = run(model.layers, model, x)
    OP_CALLS["moe_forward"] = 0
    out = run(compile_each(model), model, x, count_layers=True)
    assert OP_CALLS["moe_forward"] == 3
    torch.testing.assert_close(out, expected)


def test_layer_name_objects_make_counting_irrelevant(adapted, fresh, monkeypatch):
    """With `_USE_LAYERNAME` (torch >= 2.11) vLLM never counts: the adapter applies."""
    monkeypatch.setattr(mirrors, "_USE_LAYERNAME", True)
    model, x = build(3, adapted["0.25-0.33"][1])
    expected = run(model.layers, model, x)
    OP_CALLS["moe_forward"] = 0
    out = run(compile_each(model), model, x, count_layers=True)
    assert OP_CALLS["moe_forward"] == 0 and counters["frames"]["ok"] == 1
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


def test_runners_built_before_the_adapter_keep_the_op_until_rebuilt(fresh):
    """A 0.17-0.22 runner learns its layer when built: one built earlier has none, so the op stays."""
    runner_cls, layer_cls = mirrors.mirror_022()
    make_experts = lambda name, registry: layer_cls(name, FusedMoEConfig(), registry)  # noqa: E731
    early, x = build(3, make_experts)
    assert vllm_adapter.install_if_loaded(loaded(runner_cls, layer_cls))
    expected = run(early.layers, early, x)
    OP_CALLS["moe_forward"] = 0
    torch.testing.assert_close(run(compile_each(early), early, x), expected)
    assert OP_CALLS["moe_forward"] == 3
    late, x = build(3, make_experts)
    OP_CALLS["moe_forward"] = 0
    torch.testing.assert_close(
        run(compile_each(late), late, x), run(late.layers, late, x), atol=1e-5, rtol=1e-4
    )
    assert OP_CALLS["moe_forward"] == 3  # the eager reference run only


# --- the vLLM plugin entry point ---


def test_entry_point_is_declared_and_resolves():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    plugins = project["project"]["entry-points"]["vllm.general_plugins"]
    assert plugins == {"moe_passes": "moe_passes.adapters.vllm:register"}
    entry = importlib.metadata.EntryPoint("moe_passes", plugins["moe_passes"], "vllm.general_plugins")
    assert entry.load() is vllm_adapter.register
    installed = importlib.metadata.entry_points(group="vllm.general_plugins")
    if "moe_passes" in installed.names:  # the editable install is current
        assert installed["moe_passes"].value == plugins["moe_passes"]


def test_register_honours_the_environment_switch(monkeypatch, caplog):
    monkeypatch.setenv("MOE_PASSES_ADAPTERS", "0")
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setattr(importlib, "import_module", lambda name: pytest.fail(f"imported {name}"))
    with caplog.at_level(logging.INFO, logger="moe_passes"):
        vllm_adapter.register()
    assert "adapters are off" in caplog.text


def test_register_does_not_import_vllm_when_vllm_is_not_loading(monkeypatch, caplog):
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.setattr(importlib, "import_module", lambda name: pytest.fail(f"imported {name}"))
    with caplog.at_level(logging.INFO, logger="moe_passes"):
        vllm_adapter.register()
    assert "vLLM is not loaded" in caplog.text


def test_register_never_raises(monkeypatch, caplog):
    def broken(name):
        raise RuntimeError(f"cannot import {name}")

    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setattr(importlib, "import_module", broken)
    with caplog.at_level(logging.WARNING, logger="moe_passes"):
        vllm_adapter.register()
    assert "adapter not installed (RuntimeError: cannot import vllm.model_executor" in caplog.text


def test_register_adapts_the_loaded_runner(monkeypatch, caplog):
    cls = mirrors.mirror_033()
    cls.__module__ = RUNNER_MODULE
    module = types.ModuleType(RUNNER_MODULE)
    module.MoERunner = cls
    for name in [name for name in sys.modules if name == "vllm" or name.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)  # where real vLLM is installed, only the mirror is loaded
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, RUNNER_MODULE, module)
    with caplog.at_level(logging.INFO, logger="moe_passes"):
        vllm_adapter.register()
    assert f"moe-passes vLLM plugin: {RUNNER_MODULE}.MoERunner" in caplog.text
    assert cls._encode_layer_name.__moe_passes_original__ is not None
