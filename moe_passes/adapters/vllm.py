"""The adapter for real vLLM's fused MoE layers, and the vLLM plugin hook that installs it.

vLLM runs an MoE layer through an opaque custom op that receives the layer's *name* and finds the
layer again in the forward context (`torch.ops.vllm.moe_forward(..., layer_name, ...)`). This module
recognises, by the attributes and code of the loaded classes (not by version strings), which calling
convention the installed vLLM uses, and adapts the one it can adapt exactly:

* **runner module** (vLLM 0.25 to at least 0.33, `fused_moe/runner/moe_runner.py`): `FusedMoE` is a
  factory and the layer itself is a `MoERunner`. `MoERunner.forward` does the pre- and post-processing
  (routed input transform, padding, shared-expert and final reductions) around
  `self._forward_entry(hidden, logits, shared_input, input_ids, self._encode_layer_name(), unpadded)`,
  and the op's body is `get_layer_from_name(name)._forward_impl(hidden, logits, shared_input,
  input_ids)`. The adapter keeps `forward` exactly as vLLM wrote it and hooks the two places that
  involve the name: while dynamo traces for `hpu_moe`, `_forward_entry` is this runner's own
  `_forward_impl` (the op's body without the lookup) and `_encode_layer_name` is skipped. Routing,
  experts, shared experts, `_maybe_combine` and routing capture are vLLM's own code, run by reference.

It only does so where `_forward_impl` needs nothing the forward context knows (`runs_alone`: one
data-parallel rank, no sequence or context parallelism, no dual-batch overlap, no LoRA) and where the
op does not find layers by counting its calls (`fast_moe_cold_start`, vLLM's default on torch < 2.11:
skipping the op in some layers would shift the count). Otherwise the opaque op stays, as vllm-gaudi
keeps it for `dp_size > 1`. Declined conventions, left untouched with a log line on the `moe_passes`
logger:

* **runner with a layer argument** (0.17 to 0.22, `DefaultMoERunner.forward_impl(layer, ...)`,
  `MoERunner._forward_impl(layer, ...)`): the runner knows its `FusedMoE` only by name, so the impl
  cannot be called by reference without the very lookup the adapter removes.
* **FusedMoE layer** (0.10 to 0.16, `FusedMoE.forward_native` calls `torch.ops.vllm.moe_forward`):
  the op is named globally inside `forward_native`, whose surrounding code changed in every release;
  adapting it would mean re-implementing `forward_native` per release.
* a `forward` replaced by someone else (vllm-gaudi's `patched_fused_moe_forward` already calls the
  layer by reference for one DP rank), and anything not recognised.

vLLM loads plugins from the `vllm.general_plugins` entry point group in each process it starts; this
package declares `register` there, so a vLLM process with moe-passes installed gets the adapter.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from .base import adapters_active, env_enabled, record_adapted

log = logging.getLogger(__name__)

NAME = "vLLM MoERunner (layer by reference)"
FUSED_MOE_PACKAGE = "vllm.model_executor.layers.fused_moe"
# Where each convention keeps the class whose forward calls the opaque op, newest first.
CANDIDATES = (
    (f"{FUSED_MOE_PACKAGE}.runner.default_moe_runner", "DefaultMoERunner"),  # 0.17-0.19
    (f"{FUSED_MOE_PACKAGE}.runner.moe_runner", "MoERunner"),  # 0.20+ (0.17-0.19: an abstract base)
    (f"{FUSED_MOE_PACKAGE}.layer", "FusedMoE"),  # 0.10-0.16 (0.25+: a factory function)
)
ENTRY = "_forward_entry"
ENCODE_NAME = "_encode_layer_name"
IMPL = "_forward_impl"


@dataclass(frozen=True)
class ApiShape:
    """The calling convention recognised on a class; `reason` says why it is declined ("" if not)."""

    name: str
    reason: str = ""

    @property
    def supported(self) -> bool:
        return not self.reason


RUNNER_MODULE = "runner module (_forward_entry -> MoERunner._forward_impl)"


def _code_names(function) -> set[str]:
    code = getattr(function, "__code__", None)
    return set(code.co_names) if code is not None else set()


def _first_parameter(function) -> str | None:
    try:
        parameters = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return None
    return parameters[1] if len(parameters) > 1 else None


def detect_api_shape(cls: type) -> ApiShape:
    """Which vLLM calling convention `cls` follows, found from its methods and their code."""
    forward = getattr(cls, "forward", None)
    original = getattr(forward, "__moe_passes_original__", forward)
    forward_names = _code_names(original)
    impl = getattr(cls, IMPL, None) or getattr(cls, "forward_impl", None)
    if impl is not None and _first_parameter(impl) == "layer":
        return ApiShape(
            "runner with a layer argument",
            f"{cls.__qualname__}.{impl.__name__}(layer, ...) needs the FusedMoE that owns the runner, "
            "which the runner knows only by name: calling it by reference would need the lookup",
        )
    if callable(getattr(cls, "forward_native", None)) and callable(getattr(cls, "forward_impl", None)):
        return ApiShape(
            "FusedMoE layer (forward_native -> torch.ops.vllm.moe_forward)",
            "forward_native calls the op by its global name and its surrounding code differs per "
            "release; it is not re-implemented here",
        )
    if ENTRY in forward_names and ENCODE_NAME in forward_names:
        if _first_parameter(impl) == "hidden_states" and callable(getattr(cls, ENCODE_NAME, None)):
            return ApiShape(RUNNER_MODULE)
        return ApiShape("runner module", f"{cls.__qualname__} has no {IMPL}(hidden_states, ...) to call")
    module = getattr(original, "__module__", None)
    if "forward" in vars(cls) and module != cls.__module__:
        return ApiShape(
            "forward replaced",
            f"{cls.__qualname__}.forward is {module}.{getattr(original, '__qualname__', '?')}, not the "
            "class's own; left to it",
        )
    return ApiShape("unknown", f"{cls.__qualname__}.forward calls neither {ENTRY} nor a known MoE op")


def runs_alone(runner) -> bool:
    """Whether `_forward_impl` needs nothing the forward context knows for this layer's configuration.

    One DP rank, no sequence or context parallelism, no dual-batch overlap (dispatch, combine and
    chunking read per-step token counts from the context), and no LoRA (vLLM notes that its MoE-LoRA
    dual-stream path relies on the op boundary). Read at trace time from the layer's config: constants,
    the same for every layer of a model.
    """
    config = getattr(runner, "moe_config", None)
    return (
        getattr(config, "dp_size", None) == 1
        and getattr(config, "pcp_size", 1) == 1
        and getattr(config, "is_sequence_parallel", True) is False
        and not getattr(runner, "enable_dbo", False)
        and getattr(getattr(runner, "routed_experts", None), "lora_base_layer_prefix", None) is None
    )


def layers_found_by_counting(names_module) -> bool:
    """True when the op finds layers by counting its calls (vLLM's `fast_moe_cold_start`).

    Then the op takes "from_forward_context" and the n-th call runs the n-th MoE layer, so skipping the
    op in some layers (compiled) but not others (run eagerly after a recompile limit) would shift the
    count and run the wrong layer: the adapter keeps the op. Not the case when names are LayerName
    objects (`_USE_LAYERNAME`, torch >= 2.11) or the context carries no `all_moe_layers`.
    """
    if getattr(names_module, "_USE_LAYERNAME", False) is True:
        return False
    available = getattr(names_module, "is_forward_context_available", None)
    get_context = getattr(names_module, "get_forward_context", None)
    if available is None or get_context is None:
        return True  # cannot tell: keep the op
    return bool(available()) and getattr(get_context(), "all_moe_layers", None) is not None


def _forward_impl_by_reference(runner, hidden_states, router_logits, shared_experts_input, input_ids, *_name):
    """The body of vLLM's `_moe_forward` / `_moe_forward_shared` with the layer already in hand."""
    return getattr(runner, IMPL)(hidden_states, router_logits, shared_experts_input, input_ids)


_STORED_ENTRY = "_moe_passes_forward_entry"


def install_runner_adapter(cls: type) -> bool:
    """Hook `cls._forward_entry` and `cls._encode_layer_name`; False if `cls` was already adapted.

    `_forward_entry` becomes a property: vLLM's `self._forward_entry = self._select_forward()` still
    stores the op (on the instance, under another name), and reading it gives that op except while
    dynamo traces for hpu_moe a layer that `runs_alone`, where it gives the layer's own `_forward_impl`.
    A property wins over the instance dict, so layers built before the adapter are covered too.
    """
    encode = getattr(cls, ENCODE_NAME)
    if getattr(encode, "__moe_passes_original__", None) is not None:
        return False
    names_module = sys.modules.get(getattr(encode, "__module__", "") or "")

    def by_reference(runner) -> bool:
        return adapters_active() and runs_alone(runner) and not layers_found_by_counting(names_module)

    def get_entry(runner):
        if by_reference(runner):
            return functools.partial(_forward_impl_by_reference, runner)
        entry = getattr(runner, _STORED_ENTRY, None)
        if entry is None:  # set before the adapter was installed
            entry = runner.__dict__[ENTRY]
        return entry

    def set_entry(runner, value):
        runner.__dict__[_STORED_ENTRY] = value

    @functools.wraps(encode)
    def encode_layer_name(runner):
        if by_reference(runner):
            return None  # the by-reference entry takes no name, nor the context read behind it
        return encode(runner)

    encode_layer_name.__moe_passes_original__ = encode
    setattr(
        cls, ENTRY, property(get_entry, set_entry, doc="vLLM's op; the layer's _forward_impl under hpu_moe")
    )
    setattr(cls, ENCODE_NAME, encode_layer_name)
    record_adapted(cls, NAME)
    return True


def _loaded_class(modules: Mapping[str, object]) -> tuple[str, type] | None:
    for module_name, class_name in CANDIDATES:
        candidate = getattr(modules.get(module_name), class_name, None)
        if isinstance(candidate, type) and not inspect.isabstract(candidate):
            return f"{module_name}.{class_name}", candidate
    return None


def install_if_loaded(modules: Mapping[str, object] | None = None) -> list[str]:
    """Adapt vLLM's MoE runner if its module is already imported (never imports vLLM itself).

    `modules` defaults to `sys.modules`. Returns "module.Class" for a class adapted by this call.
    """
    if not env_enabled():
        return []
    found = _loaded_class(sys.modules if modules is None else modules)
    if found is None:
        return []
    qualified, cls = found
    if getattr(getattr(cls, ENCODE_NAME, None), "__moe_passes_original__", None) is not None:
        return []  # adapted already
    shape = detect_api_shape(cls)
    if not shape.supported:
        if cls not in _declined:
            _declined.add(cls)
            log.info("vLLM adapter: %s left as is (%s): %s", qualified, shape.name, shape.reason)
        return []
    return [qualified] if install_runner_adapter(cls) else []


_declined: set[type] = set()  # logged once per class, not per compile


def register() -> None:
    """vLLM plugin entry point (`vllm.general_plugins`): adapt vLLM's MoE runner in this process.

    Never raises (a plugin error would stop vLLM) and never imports vLLM when vLLM is not loaded.
    """
    try:
        if not env_enabled():
            log.info("moe-passes vLLM plugin: adapters are off (MOE_PASSES_ADAPTERS=0)")
            return
        if "vllm" not in sys.modules:
            log.info("moe-passes vLLM plugin: vLLM is not loaded; nothing to adapt")
            return
        for module_name, _ in CANDIDATES:
            try:
                importlib.import_module(module_name)
            except ImportError:
                continue  # this vLLM keeps its MoE classes elsewhere
        adapted = install_if_loaded()
        from .discovery import install_discovery_hook

        install_discovery_hook()  # catches the runner if its module is imported later
        log.info("moe-passes vLLM plugin: %s", ", ".join(adapted) or "no class adapted by this call")
    except Exception as error:  # noqa: BLE001 - a plugin must not stop vLLM
        log.warning("moe-passes vLLM plugin: adapter not installed (%s: %s)", type(error).__name__, error)
