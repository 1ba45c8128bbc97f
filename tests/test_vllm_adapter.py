"""The adapter for real vLLM (moe_passes/adapters/vllm.py) and its vLLM plugin entry point.

vLLM cannot be installed on the CPU machines, so most tests run the adapter on small classes that
mirror the structure of vLLM's own (each names the vLLM file and release it mirrors): the methods and
calls the adapter detects and hooks are the real ones, the MoE compute is the catalog's. The tests
marked `real vLLM` need vLLM and skip when it is absent.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import logging
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

import moe_passes
from moe_passes.adapters import vllm as vllm_adapter
from moe_passes.report import collecting
from patterns import vllm_fused_moe

ROOT = Path(__file__).resolve().parent.parent
PORTABLE_EAGER = {"inner": "eager", "target": "portable"}
RUNNER_MODULE = "vllm.model_executor.layers.fused_moe.runner.moe_runner"
LAYERS = 32
HIDDEN, EXPERTS, INTERMEDIATE, TOP_K = 16, 4, 32, 2
OP_CALLS = {"moe_forward": 0}


# --- vLLM 0.33.0 `vllm/model_executor/layers/fused_moe/runner/moe_runner.py`: the supported shape ---


_USE_LAYERNAME = False  # vllm.utils.torch_utils: LayerName objects instead of strings (torch >= 2.11)


def is_forward_context_available() -> bool:
    return vllm_fused_moe._forward_context is not None


def get_forward_context():
    return vllm_fused_moe.get_forward_context()


def get_layer_from_name(layer_name: str):
    """`get_layer_from_name`: by name, or the next of `all_moe_layers` (`fast_moe_cold_start`)."""
    forward_context = get_forward_context()
    if layer_name == "from_forward_context":
        layer_name = forward_context.all_moe_layers[forward_context.moe_layer_index]
        forward_context.moe_layer_index += 1
    return forward_context.no_compile_layers[layer_name]


@torch.library.custom_op("vllm_033_mirror::moe_forward", mutates_args=())
def moe_forward(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    shared_experts_input: torch.Tensor | None,
    input_ids: torch.Tensor | None,
    layer_name: str,
    hidden_dim_unpadded: int,
) -> torch.Tensor:
    """`_moe_forward`: `get_layer_from_name(layer_name)._forward_impl(...)` through the forward context."""
    OP_CALLS["moe_forward"] += 1
    layer = get_layer_from_name(layer_name)
    return layer._forward_impl(hidden_states, router_logits, shared_experts_input, input_ids).clone()


@moe_forward.register_fake
def _(hidden_states, router_logits, shared_experts_input, input_ids, layer_name, hidden_dim_unpadded):
    return torch.empty_like(hidden_states)


@torch.library.custom_op("vllm_033_mirror::moe_forward_shared", mutates_args=())
def moe_forward_shared(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    shared_experts_input: torch.Tensor | None,
    input_ids: torch.Tensor | None,
    layer_name: str,
    hidden_dim_unpadded: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_moe_forward_shared`: the same lookup; (shared experts' output, routed experts' output)."""
    OP_CALLS["moe_forward"] += 1
    layer = get_layer_from_name(layer_name)
    shared, fused = layer._forward_impl(hidden_states, router_logits, shared_experts_input, input_ids)
    return shared.clone(), fused.clone()


@moe_forward_shared.register_fake
def _(hidden_states, router_logits, shared_experts_input, input_ids, layer_name, hidden_dim_unpadded):
    return torch.empty_like(hidden_states), torch.empty_like(hidden_states)


@dataclass
class FusedMoEConfig:
    """The fields of `fused_moe/config.py::FusedMoEConfig` the runner reads on its forward path."""

    hidden_dim: int
    dp_size: int = 1
    pcp_size: int = 1
    sp_size: int = 1
    is_sequence_parallel: bool = False


class _MoERunner033(nn.Module):
    """`MoERunner` (0.33.0): the layer, registered by name, run through `_forward_entry`.

    `routed_experts` (vLLM's `RoutedExperts`: stacked w13/w2 and the quant method) is the catalog's
    layer, whose `forward_impl` is vLLM's routing and the Gaudi static expert loop.
    """

    def __init__(
        self, layer_name: str, moe_config: FusedMoEConfig, static_forward_context: dict, shared=None
    ):
        nn.Module.__init__(self)  # not super(): mirror_033 copies these methods into fresh classes
        self._shared_experts = shared
        self.moe_config = moe_config
        self.enable_dbo = False
        cfg = {"num_experts": EXPERTS, "hidden": HIDDEN, "intermediate": INTERMEDIATE, "top_k": TOP_K}
        self.routed_experts = vllm_fused_moe.FusedMoE(cfg, layer_name, {})
        self.layer_name = layer_name
        self.dispatches = 0
        self._forward_entry = self._select_forward()
        static_forward_context[layer_name] = self  # register_layer_for_moe_forward_op

    def _select_forward(self):
        ops = torch.ops.vllm_033_mirror
        return ops.moe_forward if self._shared_experts is None else ops.moe_forward_shared

    def _encode_layer_name(self) -> str:
        if is_forward_context_available() and get_forward_context().all_moe_layers is not None:
            return "from_forward_context"
        return self.layer_name

    def _maybe_pad_hidden_states(self, shared_experts_input, hidden_states):
        transformed = hidden_states.shape[-1]
        if self.moe_config.hidden_dim != transformed:
            hidden_states = F.pad(hidden_states, (0, self.moe_config.hidden_dim - transformed))
        trunc = None if transformed == hidden_states.shape[-1] else transformed
        return hidden_states, None, trunc

    def forward(self, hidden_states, router_logits, input_ids=None, shared_experts_input=None):
        if shared_experts_input is None and self._shared_experts is not None:
            shared_experts_input = hidden_states  # apply_routed_input_transform without a transform
        hidden_states, _, og_hidden_dim_post_xform = self._maybe_pad_hidden_states(
            shared_experts_input, hidden_states
        )
        result = self._forward_entry(
            hidden_states, router_logits, shared_experts_input, input_ids, self._encode_layer_name(), 0
        )
        shared_output, fused_output = result if isinstance(result, tuple) else (None, result)  # _unpack
        if og_hidden_dim_post_xform is not None:
            fused_output = fused_output[..., :og_hidden_dim_post_xform]
        return fused_output if shared_output is None else shared_output + fused_output

    def _sequence_parallel_context(self):
        ctx = get_forward_context()
        return (
            ctx.dp_metadata.sp_local_sizes(self.moe_config.sp_size)
            if ctx.dp_metadata
            else contextlib.nullcontext()
        )

    @property
    def do_naive_dispatch_combine(self) -> bool:
        return self.moe_config.dp_size > 1 or self.moe_config.is_sequence_parallel

    def _maybe_dispatch(self, hidden_states, router_logits):
        if self.do_naive_dispatch_combine:
            self.dispatches += 1  # get_ep_group().dispatch_router_logits(...) with one rank
        return hidden_states, router_logits

    def _forward_impl(self, hidden_states, router_logits, shared_experts_input, input_ids=None):
        with self._sequence_parallel_context():
            hidden_states, router_logits = self._maybe_dispatch(hidden_states, router_logits)
            shared_output = (
                None if self._shared_experts is None else self._shared_experts(shared_experts_input)
            )
            fused = self.routed_experts.forward_impl(hidden_states, router_logits)
            return fused if shared_output is None else (shared_output, fused)  # _maybe_combine


def mirror_033(name: str = "MoERunner033", module: str = __name__) -> type:
    """A fresh, unadapted copy of the 0.33 runner mirror (the adapter hooks the class it is given)."""
    return type(
        name,
        (nn.Module,),
        {
            **{k: v for k, v in vars(_MoERunner033).items() if k != "__dict__"},
            "__module__": module,
            "__qualname__": name,
        },
    )


MoERunner033 = mirror_033()


class DecoderLayer(nn.Module):
    def __init__(self, index: int, moe_config: FusedMoEConfig, static_forward_context: dict, shared: bool):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        shared_experts = nn.Sequential(
            nn.Linear(HIDDEN, INTERMEDIATE), nn.SiLU(), nn.Linear(INTERMEDIATE, HIDDEN)
        )
        name = f"model.layers.{index}.mlp.experts"
        self.experts = MoERunner033(
            name, moe_config, static_forward_context, shared_experts if shared else None
        )

    def forward(self, hidden_states):
        shape = hidden_states.shape
        x = self.norm(hidden_states).reshape(-1, shape[-1])
        return hidden_states + self.experts(x, self.gate(x)).reshape(shape)


class Model(nn.Module):
    def __init__(self, layers: int, moe_config: FusedMoEConfig, shared: bool):
        super().__init__()
        self.static_forward_context: dict[str, nn.Module] = {}
        self.layers = nn.ModuleList(
            DecoderLayer(i, moe_config, self.static_forward_context, shared) for i in range(layers)
        )


def build(layers: int = LAYERS, shared: bool = False, **config):
    model = Model(layers, FusedMoEConfig(hidden_dim=HIDDEN, **config), shared)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) / parameter.shape[-1] ** 0.5)
    return model.eval(), torch.randn(1, 9, HIDDEN, generator=generator)


@contextlib.contextmanager
def forward_context(model, dp_ranks: int = 1, count_layers: bool = False, tokens: int = 9):
    """vLLM's model runner context; `count_layers` sets `all_moe_layers` (`fast_moe_cold_start`)."""
    across_dp = [tokens] * dp_ranks if dp_ranks > 1 else None
    with vllm_fused_moe.set_forward_context(model, num_tokens_across_dp=across_dp) as context:
        context.all_moe_layers = list(model.static_forward_context) if count_layers else None
        context.moe_layer_index = 0
        yield context


def run(layers, model, x, dp_ranks: int = 1, count_layers: bool = False):
    with torch.no_grad(), forward_context(model, dp_ranks, count_layers, x.shape[1]):
        for layer in layers:
            x = layer(x)
    return x


@pytest.fixture(scope="module", autouse=True)
def adapted_runner():
    modules = {RUNNER_MODULE: types.SimpleNamespace(MoERunner=MoERunner033)}
    vllm_adapter.install_if_loaded(modules)  # no-op when an earlier module run installed it
    return MoERunner033


@pytest.fixture
def fresh():
    OP_CALLS["moe_forward"] = 0
    counters.clear()
    yield


# --- vLLM 0.22.0 `runner/moe_runner.py`: `MoERunner._forward_impl(self, layer, ...)` ---


class MoERunner022(nn.Module):
    def forward(self, hidden_states, router_logits, input_ids=None):
        return self._forward_entry(
            hidden_states, router_logits, None, input_ids, self._encode_layer_name(), 0
        )

    def _encode_layer_name(self):
        return self.layer_name

    def _forward_impl(self, layer, hidden_states, router_logits, shared_experts_input, input_ids=None):
        raise AssertionError("not called in these tests")


# --- vLLM 0.16.0 `fused_moe/layer.py`: `FusedMoE(CustomOp)`, forward_native -> torch.ops.vllm.moe_forward ---


class CustomOp(nn.Module):
    """`vllm/model_executor/custom_op.py`: forward dispatches to the platform's forward_* method."""

    def forward(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)


class FusedMoE016(CustomOp):
    def forward_native(self, hidden_states, router_logits):
        return torch.ops.vllm_033_mirror.moe_forward(
            hidden_states, router_logits, None, None, self.layer_name, 0
        )

    def forward_impl(self, hidden_states, router_logits):
        raise AssertionError("not called in these tests")


def replaced_forward(self, hidden_states, router_logits, input_ids=None):
    """Stands for vllm-gaudi's `_patched_default_moe_runner_forward` (another module's function)."""
    return self._forward_impl(hidden_states, router_logits, None, input_ids)


# --- shape detection and installation (no vLLM needed) ---


def test_api_shapes_are_detected_by_feature():
    supported = vllm_adapter.detect_api_shape(MoERunner033)
    assert supported.supported and supported.name == vllm_adapter.RUNNER_MODULE
    with_layer = vllm_adapter.detect_api_shape(MoERunner022)
    assert not with_layer.supported and "_forward_impl(layer, ...)" in with_layer.reason
    layer_shape = vllm_adapter.detect_api_shape(FusedMoE016)
    assert not layer_shape.supported and "forward_native" in layer_shape.reason
    patched = type("MoERunner", (MoERunner033,), {"forward": replaced_forward, "__module__": "vllm.fake"})
    replaced = vllm_adapter.detect_api_shape(patched)
    assert replaced.name == "forward replaced" and "test_vllm_adapter.replaced_forward" in replaced.reason
    unknown = type("Experts", (nn.Module,), {"forward": lambda self, x: x, "__module__": __name__})
    assert vllm_adapter.detect_api_shape(unknown).name == "unknown"


@pytest.mark.parametrize("cls", [MoERunner022, FusedMoE016], ids=["0.22-runner", "0.16-layer"])
def test_declined_shapes_are_left_untouched_with_a_log_line(cls, caplog):
    before = dict(vars(cls))
    modules = {RUNNER_MODULE: types.SimpleNamespace(MoERunner=cls)}
    with caplog.at_level(logging.INFO, logger="moe_passes"):
        assert vllm_adapter.install_if_loaded(modules) == []
        assert vllm_adapter.install_if_loaded(modules) == []  # logged once, not per compile
    assert dict(vars(cls)) == before
    (line,) = [r.getMessage() for r in caplog.records if "left as is" in r.getMessage()]
    assert f"{RUNNER_MODULE}.MoERunner left as is" in line


def test_install_hooks_entry_and_name_encoding_once(adapted_runner):
    assert isinstance(vars(adapted_runner)["_forward_entry"], property)
    assert adapted_runner._encode_layer_name.__moe_passes_original__ is not None
    modules = {RUNNER_MODULE: types.SimpleNamespace(MoERunner=adapted_runner)}
    assert vllm_adapter.install_if_loaded(modules) == []
    assert moe_passes.adapters.adapted_classes()[f"{__name__}.MoERunner033"] == vllm_adapter.NAME


def test_eager_keeps_vllms_opaque_op_and_layer_name(fresh):
    model, x = build(layers=2)
    runner = model.layers[0].experts
    assert runner._forward_entry is torch.ops.vllm_033_mirror.moe_forward
    assert runner._encode_layer_name() == "model.layers.0.mlp.experts"
    run(model.layers, model, x)
    assert OP_CALLS["moe_forward"] == 2


# --- measured outcomes on the mirror: one compile for 32 layers under hpu_moe ---


def test_each_layer_compiled_alone_shares_one_compile_under_hpu_moe(fresh):
    model, x = build()
    expected = run(model.layers, model, x)
    OP_CALLS["moe_forward"] = 0
    layers = [torch.compile(layer, backend="hpu_moe", options=PORTABLE_EAGER) for layer in model.layers]
    with collecting() as collector:
        out = run(layers, model, x)
    assert counters["frames"]["ok"] == 1 and counters["frames"]["total"] == 1, dict(counters["frames"])
    assert not counters["graph_break"] and not counters["recompiles"]
    (record,) = collector.records
    assert len(record.fused) == 1 and not record.declined and record.fallback is None
    assert OP_CALLS["moe_forward"] == 0  # every layer ran its own _forward_impl inside the compiled graph
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


def test_other_backends_keep_the_opaque_op_and_recompile_per_layer(fresh):
    model, x = build(layers=4)
    expected = run(model.layers, model, x)
    OP_CALLS["moe_forward"] = 0
    out = run([torch.compile(layer, backend="eager") for layer in model.layers], model, x)
    assert OP_CALLS["moe_forward"] == 4  # the opaque op ran in every layer
    assert counters["frames"]["ok"] == 4, dict(counters["frames"])  # one compile per layer name
    torch.testing.assert_close(out, expected)


def test_adapter_option_off_keeps_the_opaque_op(fresh):
    model, x = build(layers=3)
    options = {**PORTABLE_EAGER, "adapters": False}
    run([torch.compile(layer, backend="hpu_moe", options=options) for layer in model.layers], model, x)
    assert OP_CALLS["moe_forward"] == 3


def test_several_data_parallel_ranks_keep_the_opaque_op(fresh):
    """dp_size 2: dispatch/combine read the context's token counts, so the op (and the name) stay."""
    model, x = build(layers=2, dp_size=2)
    expected = run(model.layers, model, x, dp_ranks=2)
    OP_CALLS["moe_forward"] = 0
    out = run(
        [torch.compile(layer, backend="hpu_moe", options=PORTABLE_EAGER) for layer in model.layers],
        model,
        x,
        2,
    )
    assert OP_CALLS["moe_forward"] == 2 and model.layers[0].experts.dispatches == 2
    torch.testing.assert_close(out, expected)


def test_shared_experts_flow_through_vllms_own_combine(fresh):
    """moe_forward_shared's path: `_forward_impl` returns (shared, routed); forward adds them."""
    model, x = build(layers=4, shared=True)
    expected = run(model.layers, model, x)
    OP_CALLS["moe_forward"] = 0
    compiled = [torch.compile(layer, backend="hpu_moe", options=PORTABLE_EAGER) for layer in model.layers]
    out = run(compiled, model, x)
    assert OP_CALLS["moe_forward"] == 0 and counters["frames"]["ok"] == 1 and not counters["graph_break"]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


def test_layers_found_by_counting_keep_the_opaque_op(fresh):
    """fast_moe_cold_start: the n-th op call runs the n-th layer, so no layer may skip the op."""
    model, x = build(layers=3)
    expected = run(model.layers, model, x)
    OP_CALLS["moe_forward"] = 0
    compiled = [torch.compile(layer, backend="hpu_moe", options=PORTABLE_EAGER) for layer in model.layers]
    out = run(compiled, model, x, count_layers=True)
    assert OP_CALLS["moe_forward"] == 3
    torch.testing.assert_close(out, expected)


def test_layer_name_objects_make_counting_irrelevant(fresh, monkeypatch):
    """With `_USE_LAYERNAME` (torch >= 2.11) vLLM never counts: the adapter applies."""
    monkeypatch.setattr(sys.modules[__name__], "_USE_LAYERNAME", True)
    model, x = build(layers=3)
    expected = run(model.layers, model, x)
    OP_CALLS["moe_forward"] = 0
    compiled = [torch.compile(layer, backend="hpu_moe", options=PORTABLE_EAGER) for layer in model.layers]
    out = run(compiled, model, x, count_layers=True)
    assert OP_CALLS["moe_forward"] == 0 and counters["frames"]["ok"] == 1
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


def test_padding_and_truncation_stay_vllms(fresh):
    """forward's own pre/post-processing runs under the adapter: hidden 16 padded to 24 and cut back."""
    registry: dict[str, nn.Module] = {}
    runner = MoERunner033("experts", FusedMoEConfig(hidden_dim=24), registry)
    wide = {"num_experts": EXPERTS, "hidden": 24, "intermediate": INTERMEDIATE, "top_k": TOP_K}
    runner.routed_experts = vllm_fused_moe.FusedMoE(wide, "experts", {})
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in runner.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    x, logits = torch.randn(7, HIDDEN, generator=generator), torch.randn(7, EXPERTS, generator=generator)
    holder = types.SimpleNamespace(static_forward_context=registry)
    compiled = torch.compile(runner, backend="hpu_moe", options=PORTABLE_EAGER)
    with torch.no_grad(), forward_context(holder), collecting() as collector:
        expected = runner(x, logits)
        out = compiled(x, logits)
    assert out.shape == (7, HIDDEN) and OP_CALLS["moe_forward"] == 1  # the eager call only
    assert len(collector.records[0].fused) == 1
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


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
    cls = mirror_033("MoERunner", RUNNER_MODULE)
    module = types.ModuleType(RUNNER_MODULE)
    module.MoERunner = cls
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, RUNNER_MODULE, module)
    with caplog.at_level(logging.INFO, logger="moe_passes"):
        vllm_adapter.register()
    assert f"moe-passes vLLM plugin: {RUNNER_MODULE}.MoERunner" in caplog.text
    assert cls._encode_layer_name.__moe_passes_original__ is not None


# --- real vLLM (skipped when vLLM is not installed) ---


@pytest.fixture(scope="module")
def vllm_runner_class():
    pytest.importorskip("vllm")
    vllm_adapter.register()
    for module_name, class_name in vllm_adapter.CANDIDATES:
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if isinstance(cls, type):
            return cls
    pytest.fail("vLLM is installed but none of its MoE runner modules imported")


def test_real_vllm_shape_is_recognised_or_declined_with_a_reason(vllm_runner_class):
    shape = vllm_adapter.detect_api_shape(vllm_runner_class)
    adapted = getattr(vllm_runner_class._encode_layer_name, "__moe_passes_original__", None) is not None
    assert adapted == shape.supported, shape
    if not shape.supported:
        assert shape.reason


def test_real_vllm_layers_compiled_alone_share_one_compile(vllm_runner_class, tmp_path):
    """Real FusedMoE layers (factory of vLLM 0.25+), one DP rank, compiled one by one under hpu_moe."""
    if not vllm_adapter.detect_api_shape(vllm_runner_class).supported:
        pytest.skip("this vLLM's MoE convention is declined by the adapter")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.fused_moe import FusedMoE

    init_distributed_environment(1, 0, f"file://{tmp_path / 'dist'}", 0, backend="gloo")
    initialize_model_parallel(1, 1)
    config = VllmConfig()
    config.compilation_config.fast_moe_cold_start = False  # names, not a call count: the adapter applies
    with set_current_vllm_config(config):
        layers = [
            FusedMoE(
                EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, params_dtype=torch.float32, prefix=f"layers.{i}.experts"
            )
            for i in range(8)
        ]
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in layers:
            for parameter in layer.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
            for module in layer.modules():  # where the quant method lives moved between releases
                method = getattr(module, "quant_method", None)
                if hasattr(module, "w13_weight") and hasattr(method, "process_weights_after_loading"):
                    method.process_weights_after_loading(module)
    x = torch.randn(5, HIDDEN, generator=generator)
    logits = torch.randn(5, EXPERTS, generator=generator)

    def chain(modules):
        out = x
        with torch.no_grad(), set_forward_context(None, config):
            for module in modules:
                out = out + module(out, logits)
        return out

    expected = chain(layers)
    counters.clear()
    out = chain([torch.compile(layer, backend="hpu_moe", options=PORTABLE_EAGER) for layer in layers])
    assert counters["frames"]["ok"] == 1 and not counters["graph_break"], dict(counters)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
