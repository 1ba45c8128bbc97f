"""The adapter for real vLLM's fused MoE layers, and the vLLM plugin hook that installs it.

vLLM runs an MoE layer through an opaque custom op that receives the layer's *name* and finds the
layer again in the forward context (`torch.ops.vllm.moe_forward(..., layer_name, ...)`). This module
recognises, by the attributes and code of the loaded classes (not by version strings), which calling
convention the installed vLLM uses. In the runner conventions, the runner's `forward` does the pre-
and post-processing (routed input transform, padding, reductions) around
`self.<entry>(hidden, logits, shared_input, [input_ids,] self._encode_layer_name(), ...)`, and the
op's body looks the layer up and runs the runner's impl. The adapter keeps `forward` exactly as vLLM
wrote it and hooks the two places that involve the name: while dynamo traces for `hpu_moe`, the entry
is the op's body with the layer in hand, and `_encode_layer_name` is skipped. Routing, experts, shared
experts, `_maybe_combine` and routing capture stay vLLM's own code, run by reference:

* **runner module** (0.25 to at least 0.33, `fused_moe/runner/moe_runner.py`): `FusedMoE` is a factory
  and the layer is the `MoERunner`; the op's body is `layer._forward_impl(hidden, logits, shared_input,
  input_ids)`.
* **runner of a FusedMoE** (0.17 to 0.22): `FusedMoE.runner` knows its layer only by name and the op's
  body is `layer.ensure_moe_quant_config_init()` (0.17-0.19; 0.20-0.22 do it inside the impl) then
  `layer.runner.<impl>(layer, ...)`: `DefaultMoERunner.forward_impl` through `moe_forward` (0.17-0.19,
  the runner is handed its layer when built) or `MoERunner._forward_impl` through `_forward_entry`
  (0.20-0.22, `FusedMoE.__init__` builds it). The adapter records the layer on the runner when either
  constructor runs, outside nn.Module's registries.

It only does so where the impl needs nothing the forward context knows (`runs_alone`: one
data-parallel rank, no sequence or context parallelism, no DP chunking, no dual-batch overlap, no LoRA)
and where the op does not find layers by counting its calls (`fast_moe_cold_start`, vLLM's default on
torch < 2.11: skipping the op in some layers would shift the count). Otherwise the opaque op stays, as
vllm-gaudi keeps it for `dp_size > 1`. Declined conventions, left untouched with a log line on the
`moe_passes` logger:

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
import gc
import importlib
import inspect
import logging
import sys
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

from .base import adapters_active, env_enabled, record_adapted

log = logging.getLogger(__name__)

NAME = "vLLM MoE runner (layer by reference)"
FUSED_MOE_PACKAGE = "vllm.model_executor.layers.fused_moe"
LAYER_MODULE = f"{FUSED_MOE_PACKAGE}.layer"
# Where each convention keeps the class whose forward calls the opaque op, newest first.
CANDIDATES = (
    (f"{FUSED_MOE_PACKAGE}.runner.default_moe_runner", "DefaultMoERunner"),  # 0.17-0.19
    (f"{FUSED_MOE_PACKAGE}.runner.moe_runner", "MoERunner"),  # 0.20+ (0.17-0.19: an abstract base)
    (LAYER_MODULE, "FusedMoE"),  # 0.10-0.16 (0.25+: a factory function)
)
ENTRIES = ("_forward_entry", "moe_forward")  # the attribute holding the op: 0.20+, 0.17-0.19
IMPLS = ("_forward_impl", "forward_impl")  # what the op's body runs: 0.20+, 0.17-0.19
ENCODE_NAME = "_encode_layer_name"
OWNER = "_moe_passes_owner"  # the FusedMoE a 0.17-0.22 runner belongs to, recorded at construction

RUNNER_MODULE = "runner module (_forward_entry -> MoERunner._forward_impl)"
RUNNER_OF_LAYER = "runner of a FusedMoE (entry -> runner impl(layer, ...))"


@dataclass(frozen=True)
class Convention:
    """How a runner class reaches vLLM's op, and how to run the op's body with the layer in hand."""

    entry: str  # the attribute forward calls with the encoded name
    impl: str  # the runner method the op's body calls
    impl_args: int  # its positional arguments after self (and the layer): the entry's first ones
    owner: str | None = None  # where the owning layer is learnt: "runner_init" or "layer_init"


@dataclass(frozen=True)
class ApiShape:
    """The calling convention recognised on a class; `reason` says why it is declined ("" if not)."""

    name: str
    reason: str = ""
    convention: Convention | None = None

    @property
    def supported(self) -> bool:
        return not self.reason


def _code_names(function) -> set[str]:
    function = getattr(function, "__moe_passes_original__", function)  # vLLM's, if this adapter wrapped it
    code = getattr(function, "__code__", None)
    return set(code.co_names) if code is not None else set()


def _parameters(function) -> list[str]:
    try:
        return list(inspect.signature(function).parameters)[1:]  # after self
    except (TypeError, ValueError):
        return []


def detect_api_shape(cls: type, owner_cls: type | None = None) -> ApiShape:
    """Which vLLM calling convention `cls` follows, found from its methods and their code.

    `owner_cls` is the FusedMoE class of the same vLLM, where a 0.20-0.22 runner's layer is learnt.
    """
    forward = getattr(cls, "forward", None)
    original = getattr(forward, "__moe_passes_original__", forward)
    forward_names = _code_names(forward)
    impl_name = next((name for name in IMPLS if callable(getattr(cls, name, None))), None)
    impl_parameters = _parameters(getattr(cls, impl_name)) if impl_name else []
    entry = next((name for name in ENTRIES if name in forward_names), None)
    if callable(getattr(cls, "forward_native", None)) and impl_parameters[:1] == ["hidden_states"]:
        return ApiShape(
            "FusedMoE layer (forward_native -> torch.ops.vllm.moe_forward)",
            "forward_native calls the op by its global name and its surrounding code differs per "
            "release; it is not re-implemented here",
        )
    if entry is not None and _class_attribute(cls, entry) is not None:
        return ApiShape(
            "runner", f"{cls.__qualname__}.{entry} is defined on the class, not the op vLLM sets per instance"
        )
    if entry is not None and ENCODE_NAME in forward_names and callable(getattr(cls, ENCODE_NAME, None)):
        if impl_parameters[:1] == ["hidden_states"]:
            return ApiShape(RUNNER_MODULE, convention=Convention(entry, impl_name, len(impl_parameters)))
        if impl_parameters[:2] == ["layer", "hidden_states"]:
            args = len(impl_parameters) - 1
            if "layer" in _parameters(cls.__init__):
                return ApiShape(RUNNER_OF_LAYER, convention=Convention(entry, impl_name, args, "runner_init"))
            if owner_cls is not None and "runner" in _code_names(owner_cls.__init__):
                return ApiShape(RUNNER_OF_LAYER, convention=Convention(entry, impl_name, args, "layer_init"))
            return ApiShape(
                RUNNER_OF_LAYER,
                f"{cls.__qualname__}.{impl_name}(layer, ...) needs the layer that owns the runner, and "
                "neither the runner's nor the layer's constructor shows where to learn it",
            )
        return ApiShape("runner", f"{cls.__qualname__} has no {'/'.join(IMPLS)}(hidden_states, ...) to call")
    module = getattr(original, "__module__", None)
    if "forward" in vars(cls) and module != cls.__module__:
        return ApiShape(
            "forward replaced",
            f"{cls.__qualname__}.forward is {module}.{getattr(original, '__qualname__', '?')}, not the "
            "class's own; left to it",
        )
    return ApiShape(
        "unknown", f"{cls.__qualname__}.forward calls neither {' nor '.join(ENTRIES)} as vLLM does"
    )


def _class_attribute(cls: type, name: str):
    """`name` as defined on `cls` or a base (not on instances), other than this adapter's property."""
    for klass in cls.__mro__:
        if name in vars(klass):
            value = vars(klass)[name]
            return None if getattr(getattr(value, "fget", None), "__moe_passes_adapter__", None) else value
    return None


def runs_alone(runner) -> bool:
    """Whether the impl needs nothing the forward context knows for this layer's configuration.

    One DP rank, no sequence or context parallelism, no DP chunking, no dual-batch overlap
    (dispatch, combine and chunking read per-step token counts from the context), and no LoRA (vLLM
    notes that its MoE-LoRA dual-stream path relies on the op boundary). Read at trace time from the
    layer's config: constants, the same for every layer of a model.
    """
    config = getattr(runner, "moe_config", None)
    return (
        getattr(config, "dp_size", None) == 1
        and getattr(config, "pcp_size", 1) == 1
        and getattr(config, "is_sequence_parallel", True) is False
        and not getattr(runner, "enable_dbo", False)
        and not getattr(runner, "use_dp_chunking", False)
        and not uses_lora(runner)
    )


def uses_lora(runner) -> bool:
    """Whether vLLM's LoRA wrapped this layer: `FusedMoEWithLoRA` sets the routed experts'
    `lora_base_layer_prefix` to "base_layer." (0.25+); without LoRA it is "" (or absent, before)."""
    return bool(getattr(getattr(runner, "routed_experts", None), "lora_base_layer_prefix", ""))


def layers_found_by_counting(names_module) -> bool:
    """True when the op finds layers by counting its calls (vLLM's `fast_moe_cold_start`).

    Then the op takes "from_forward_context" and the n-th call runs the n-th MoE layer, so skipping the
    op in some layers (compiled) but not others (run eagerly after a recompile limit) would shift the
    count and run the wrong layer: the adapter keeps the op. Not the case when names are opaque objects
    (`_USE_LAYERNAME` from 0.20, `HAS_OPAQUE_TYPE` before: torch >= 2.11) or the context carries no
    `all_moe_layers`.
    """
    flag = "_USE_LAYERNAME" if hasattr(names_module, "_USE_LAYERNAME") else "HAS_OPAQUE_TYPE"
    if getattr(names_module, flag, False) is True:
        return False
    available = getattr(names_module, "is_forward_context_available", None)
    get_context = getattr(names_module, "get_forward_context", None)
    if available is None or get_context is None:
        return True  # cannot tell: keep the op
    return bool(available()) and getattr(get_context(), "all_moe_layers", None) is not None


def _stored(entry: str) -> str:
    return f"_moe_passes{entry}" if entry.startswith("_") else f"_moe_passes_{entry}"


def install_runner_adapter(cls: type, convention: Convention, owner_cls: type | None = None) -> bool:
    """Hook the entry and `_encode_layer_name` of `cls` (and record layers); False if done already.

    The entry becomes a property: vLLM's `self.<entry> = <op>` still stores the op (on the instance,
    under another name), and reading it gives that op except while dynamo traces for hpu_moe a layer
    that `runs_alone`, where it gives the op's body with the layer in hand: `<impl>(...)` on the runner
    itself (0.25+), or `layer.ensure_moe_quant_config_init(); runner.<impl>(layer, ...)` with the
    layer recorded when the runner was built (0.17-0.22). A property wins over the instance dict, so
    runners built before the adapter are covered too, though a 0.17-0.22 runner built before it has no
    recorded layer and keeps the op.
    """
    encode = getattr(cls, ENCODE_NAME)
    if getattr(encode, "__moe_passes_original__", None) is not None:
        return False
    names_module = sys.modules.get(getattr(encode, "__module__", "") or "")
    entry, impl, impl_args, owner = convention.entry, convention.impl, convention.impl_args, convention.owner
    stored = _stored(entry)

    def by_reference(runner) -> bool:
        return (
            adapters_active()
            and runs_alone(runner)
            and (owner is None or getattr(runner, OWNER, None) is not None)
            and not layers_found_by_counting(names_module)
        )

    def op_body_by_reference(runner, *entry_args):
        """vLLM's `_moe_forward` / `_moe_forward_shared` body without the lookup by name."""
        if owner is None:
            return getattr(runner, impl)(*entry_args[:impl_args])
        layer = getattr(runner, OWNER)
        ensure = getattr(layer, "ensure_moe_quant_config_init", None)
        if ensure is not None:
            ensure()
        return getattr(runner, impl)(layer, *entry_args[:impl_args])

    def get_entry(runner):
        if by_reference(runner):
            return functools.partial(op_body_by_reference, runner)
        # never runner.__dict__ here: dynamo before 2.13 reads it through this very property (recursion);
        # runners built before the adapter had their op moved to `stored` when it was installed
        value = getattr(runner, stored, None)
        if value is None:
            raise AttributeError(f"{type(runner).__name__!r} object has no attribute {entry!r}")
        return value

    def set_entry(runner, value):
        runner.__dict__[stored] = value

    @functools.wraps(encode)
    def encode_layer_name(runner):
        if by_reference(runner):
            return None  # the by-reference entry takes no name, nor the context read behind it
        return encode(runner)

    encode_layer_name.__moe_passes_original__ = encode
    if owner == "runner_init":
        _record_owner_after(cls, lambda runner, bound: (runner, bound.arguments.get("layer")))
    elif owner == "layer_init":
        _record_owner_after(owner_cls, lambda layer, bound: (getattr(layer, "runner", None), layer))
    get_entry.__moe_passes_adapter__ = NAME
    setattr(cls, entry, property(get_entry, set_entry, doc="vLLM's op; its body by reference under hpu_moe"))
    _move_stored_entries(cls, entry, stored)
    setattr(cls, ENCODE_NAME, encode_layer_name)
    record_adapted(cls, NAME)
    return True


def _move_stored_entries(cls: type, entry: str, stored: str) -> None:
    """Runners built before the adapter hold the op in their own `entry`, now shadowed by the property:
    move it to `stored`, where the property reads it (once, when the adapter is installed)."""
    for obj in gc.get_objects():
        if issubclass(type(obj), cls):  # type(), not isinstance: a dead weak proxy raises on isinstance
            own = getattr(obj, "__dict__", None)
            if isinstance(own, dict) and entry in own:
                own[stored] = own.pop(entry)


def _record_owner_after(cls: type, runner_and_layer) -> None:
    """Wrap `cls.__init__` to note, on the runner it built or was given, the layer it belongs to.

    Kept in the runner's `__dict__`, out of nn.Module's registries: no submodule, no state, no cycle in
    `modules()`.
    """
    init = cls.__init__
    if getattr(init, "__moe_passes_original__", None) is not None:
        return
    signature = inspect.signature(init)

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        try:
            runner, layer = runner_and_layer(self, signature.bind(self, *args, **kwargs))
        except TypeError:
            return
        if runner is not None and layer is not None:
            runner.__dict__[OWNER] = layer

    __init__.__moe_passes_original__ = init
    cls.__init__ = __init__


@dataclass(frozen=True)
class LoadedRunner:
    """The runner class of the loaded vLLM, its FusedMoE class (if a class), and their convention."""

    qualified: str
    cls: type
    owner_cls: type | None
    shape: ApiShape


def loaded_runner(modules: Mapping[str, object] | None = None) -> LoadedRunner | None:
    """What `install_if_loaded` would adapt or decline among `modules` (default `sys.modules`)."""
    modules = sys.modules if modules is None else modules
    for module_name, class_name in CANDIDATES:
        cls = getattr(modules.get(module_name), class_name, None)
        if isinstance(cls, type) and not inspect.isabstract(cls):
            owner_cls = getattr(modules.get(LAYER_MODULE), "FusedMoE", None)
            owner_cls = owner_cls if isinstance(owner_cls, type) and owner_cls is not cls else None
            return LoadedRunner(
                f"{module_name}.{class_name}", cls, owner_cls, detect_api_shape(cls, owner_cls)
            )
    return None


def install_if_loaded(modules: Mapping[str, object] | None = None) -> list[str]:
    """Adapt vLLM's MoE runner if its module is already imported (never imports vLLM itself).

    `modules` defaults to `sys.modules`. Returns "module.Class" for a class adapted by this call.
    """
    if not env_enabled():
        return []
    found = loaded_runner(modules)
    if found is None or getattr(getattr(found.cls, ENCODE_NAME, None), "__moe_passes_original__", None):
        return []  # nothing loaded, or adapted already
    if not found.shape.supported:
        if found.cls not in _declined:
            _declined.add(found.cls)
            log.info(
                "vLLM adapter: %s left as is (%s): %s", found.qualified, found.shape.name, found.shape.reason
            )
        return []
    if install_runner_adapter(found.cls, found.shape.convention, found.owner_cls):
        return [found.qualified]
    return []


_declined: weakref.WeakSet[type] = weakref.WeakSet()  # logged once per class, not per compile


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
        # Importing this module ran the package's __init__, which installed the discovery hook: a runner
        # module imported later is adapted before dynamo compiles it.
        adapted = install_if_loaded()
        log.info("moe-passes vLLM plugin: %s", ", ".join(adapted) or "no class adapted by this call")
    except Exception as error:  # noqa: BLE001 - a plugin must not stop vLLM
        log.warning("moe-passes vLLM plugin: adapter not installed (%s: %s)", type(error).__name__, error)
