"""The vLLM adapter on real vLLM: ten real MoE layers compiled one by one share one compile under hpu_moe.

Runs where vLLM is installed (`python tools/vllm_env.py test`, which CI runs after the main suite with
MOE_PASSES_REQUIRE_VLLM=1: there a missing vLLM is a failure, not a skip). Each configuration runs in
its own process (`tests/real_vllm.py`), since vLLM fixes its layer-name type when it is imported.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap

import pytest

if os.environ.get("MOE_PASSES_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401 - must be importable here
else:
    pytest.importorskip("vllm")

from moe_passes.adapters import vllm as vllm_adapter  # noqa: E402
from tests import vllm_mirrors as mirrors  # noqa: E402
from tests.real_vllm import LAYERS, run_in_process  # noqa: E402

CONFIGS = [("custom-op", False), ("default", False), ("custom-op", True), ("default", True)]


def _ids(config):
    entry, use_layername = config
    return f"{entry}-{'LayerName' if use_layername else 'str'}"


def keys_layers_by_identity() -> bool:
    """vLLM 0.17-0.23's CPU MoE fallback can hand its op `id(layer)` (`cpu_fused_moe.py`, `forward_torch`): the
    source check, where the run cannot tell which path its layers took."""
    try:
        from vllm.model_executor.layers.fused_moe import cpu_fused_moe
    except ImportError:
        return False
    return "id(layer)" in inspect.getsource(cpu_fused_moe)


@pytest.mark.parametrize("config", CONFIGS, ids=_ids)
def test_ten_real_layers_share_one_compile_under_hpu_moe(config):
    entry, use_layername = config
    result = run_in_process(entry, "hpu_moe", use_layername)
    assert result.adapted, result.report
    assert not any("layer_name" in failure for failure in result.guard_failures), result.report
    assert result.graph_breaks == 0 and result.max_diff == 0.0, result.report
    keyed = result.keyed_by_identity if result.keyed_by_identity is not None else keys_layers_by_identity()
    if keyed:
        # vLLM's own CPU fallback recompiles per layer on `id(layer)`: left as written, named in the advice
        assert result.guard_failures and all("___check_obj_id" in f for f in result.guard_failures)
        assert any("`layer_id = id(layer)` at" in advice for advice in result.advice), result.advice
    else:
        assert (result.compiles, result.recompiles) == (1, 0), result.report
        assert "compiles: 1   recompiles: 0" in result.report  # what moe_passes.explain shows


@pytest.mark.parametrize("entry", ["custom-op", "default"])
def test_plain_dynamo_recompiles_per_layer(entry):
    """What the adapter removes: with names as strings, dynamo guards on each layer's name (on the CPU
    fallback of vLLM 0.17-0.23, on the layer's identity first)."""
    result = run_in_process(entry, "eager", use_layername=False)
    assert result.compiles > 1, result.report
    assert any(
        "layer_name == 'model.layers.0.mlp.experts'" in f or "___check_obj_id" in f for f in result.guard_failures
    ), result.report
    assert result.limit_hits and result.compiles < LAYERS  # the last layers ran uncompiled


def test_the_real_convention_is_adapted():
    vllm_adapter.register()
    found = vllm_adapter.loaded_runner()
    assert found is not None and found.shape.supported, found
    assert getattr(found.cls._encode_layer_name, "__moe_passes_original__", None) is not None


def _mirror_of(convention) -> type:
    """The mirror in tests/vllm_mirrors.py that stands for the loaded release's convention."""
    if convention.owner is None:
        return mirrors.mirror_033()  # 0.25-0.33
    return (mirrors.mirror_019 if convention.owner == "runner_init" else mirrors.mirror_022)()[0]


def test_the_mirror_of_this_release_matches_the_real_runner():
    """The mirror of the installed release's convention: the same decision, signatures of the methods the
    adapter hooks or calls, and (0.25+) the LoRA marker the adapter reads."""
    vllm_adapter.register()
    found = vllm_adapter.loaded_runner()
    real, convention = found.cls, found.shape.convention
    mirror = _mirror_of(convention)
    assert vllm_adapter.detect_api_shape(mirror, found.owner_cls) == vllm_adapter.detect_api_shape(real, found.owner_cls)
    for name in ("forward", convention.impl, "_encode_layer_name"):
        original = getattr(getattr(real, name), "__moe_passes_original__", getattr(real, name))
        real_parameters = list(inspect.signature(original).parameters)
        assert list(inspect.signature(getattr(mirror, name)).parameters) == real_parameters, name
    if convention.owner is None:
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

        assert 'self.lora_base_layer_prefix = ""' in inspect.getsource(RoutedExperts.__init__)
        assert mirrors.routed_experts().lora_base_layer_prefix == ""


WALK = textwrap.dedent(
    """
    import importlib, pkgutil, re, sys
    import torch
    import vllm.model_executor
    from moe_passes.adapters import discovery
    from moe_passes.adapters.base import adapted_classes

    # backends of other hardware (ROCm, TPU, XPU, ...) load a second copy of vLLM's C library: skipped
    other = re.compile(r"rocm|aiter|tpu|xpu|flashinfer|deep_gemm|triton|cutlass|marlin|hpu")
    for module in pkgutil.walk_packages(vllm.model_executor.__path__, "vllm.model_executor."):
        if not other.search(module.name):
            try:
                importlib.import_module(module.name)
            except Exception:
                pass
    discovery.adapt()
    for qualified, adapter in sorted(adapted_classes().items()):
        print(qualified, "|", adapter)
    """
)


def test_only_moe_classes_are_adapted():
    """Every loaded nn.Module class of vLLM's model executor (its layers, 300+ models), torch and
    transformers offered to the adapters: only MoE classes take one. Attention (MLA reads `layer_name`
    and has a `forward_impl`), Mamba mixers, poolers and vision towers never do."""
    result = subprocess.run(
        [sys.executable, "-c", WALK], capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    adapted = [line.split(" | ")[0] for line in result.stdout.splitlines() if " | " in line]
    vllm_adapter.register()
    assert vllm_adapter.loaded_runner().qualified in adapted
    not_moe = [name for name in adapted if not any(w in name.rsplit(".", 1)[-1].lower() for w in ("moe", "expert"))]
    assert not not_moe, result.stdout
