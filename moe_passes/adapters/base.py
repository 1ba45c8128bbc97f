"""Installing an adapter on a class, and deciding at trace time whether it applies."""

from __future__ import annotations

import functools
import logging
import os
import sys
import weakref
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

ENV_VAR = "MOE_PASSES_ADAPTERS"
# Set on the hpu_moe backend function (to itself): how a compile's backend is recognised without
# importing it (the backend imports the adapters).
BACKEND_MARK = "__moe_passes_backend__"
_ADAPTED: weakref.WeakKeyDictionary[type, str] = weakref.WeakKeyDictionary()  # class -> adapter name


def env_enabled() -> bool:
    """False when MOE_PASSES_ADAPTERS is 0/false/off/no."""
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "off", "no")


def _hpu_moe_options_of(compiler) -> dict | None:
    """The options of the compile in progress when its backend is hpu_moe, else None.

    Dynamo wraps the backend (debug wrapper, torch.compile's options wrapper, explain's partial); walk
    the wrappers down to the function and keep the options met on the way.
    """
    options: dict | None = None
    for _ in range(8):
        if getattr(compiler, BACKEND_MARK, None) is compiler:  # wrappers copy the mark: the function itself
            return options if options is not None else {}
        if isinstance(compiler, functools.partial):
            options = compiler.keywords.get("options", options)
            compiler = compiler.func
            continue
        kwargs = getattr(compiler, "kwargs", None)
        if isinstance(kwargs, dict) and "options" in kwargs:
            options = kwargs["options"]
        inner = getattr(compiler, "_torchdynamo_orig_backend", None) or getattr(compiler, "compiler_fn", None)
        if inner is None or inner is compiler:
            return None
        compiler = inner
    return None


def _dynamo_compile_locals() -> dict:
    """The locals of dynamo's `_compile` running the compile in progress (read from the call stack), or {}
    where none runs or this torch's dynamo does not show it."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_compile" and frame.f_globals.get("__name__") == "torch._dynamo.convert_frame":
            return frame.f_locals
        frame = frame.f_back
    return {}


def compiling_for_hpu_moe() -> bool:
    """Whether the dynamo compile in progress has hpu_moe as its backend; False when none is, or when
    this torch's dynamo does not show it."""
    compiler = _dynamo_compile_locals().get("compiler_fn")
    return compiler is not None and _hpu_moe_options_of(compiler) is not None


def modules_of_the_frame_being_compiled() -> list[torch.nn.Module]:
    """The nn.Modules among the locals of the frame dynamo starts to compile (its `self`, most often);
    empty where this torch's dynamo does not show them."""
    local_values = _dynamo_compile_locals().get("locals")
    if not isinstance(local_values, dict):
        return []
    return [v for v in local_values.values() if isinstance(v, torch.nn.Module)]


@torch.compiler.assume_constant_result
def adapters_active() -> bool:
    """True while dynamo traces for the hpu_moe backend with adapters enabled (a trace-time constant).

    Dynamo guards every compiled frame on the backend that compiled it, so a constant taken for one
    backend never serves another.
    """
    if not env_enabled():
        return False
    # The translator being tracing is the test, not torch.compiler.is_compiling(): dynamo runs this
    # function in plain Python, where older torch versions report is_compiling() as False.
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        if tx is None:
            return False
        options = _hpu_moe_options_of(tx.output.compiler_fn)
    except Exception:  # noqa: BLE001 - not tracing, or another torch's internals: keep the original forward
        return False
    if options is None:
        return False
    if hasattr(options, "adapters"):  # an Options instance
        return bool(options.adapters)
    return bool(options.get("adapters", True)) if isinstance(options, dict) else True


def install(cls: type, traceable_forward: Callable, name: str, method: str = "forward", exact: bool = False) -> bool:
    """Give `cls` a `method` that runs `traceable_forward` under hpu_moe tracing; False if already done.

    exact: only for instances of `cls` itself (a copy proved from the class's attributes: a subclass may
    override one it read, and gets its own decision, installed on it, or the method as written). A method
    `cls` inherits from a class adapted before is installed on `cls` over the inherited original."""
    original = cls.__dict__.get(method)
    if original is None:
        inherited = getattr(cls, method)
        original = getattr(inherited, "__moe_passes_original__", inherited) if exact else inherited
    # A forward goes beside methods the same adapter took (TensorRT-LLM's forward and `run_experts`), never
    # onto a class another adapter owns (the vLLM runners, the vLLM-style layers)
    owners = _ADAPTED.get(cls)
    if getattr(original, "__moe_passes_original__", None) is not None or (
            method == "forward" and owners is not None and name not in owners.split(" + ")):
        return False

    traced = [traceable_forward]  # replaced where the copy's proof no longer holds (see retrace)

    @functools.wraps(original)
    def adapted(self, *args, **kwargs):
        # Eager calls pay one check (is_compiling is False there); dynamo folds both tests while it traces.
        if torch.compiler.is_compiling() and adapters_active() and (not exact or type(self) is cls):
            _refresh()
            return traced[0](self, *args, **kwargs)
        return original(self, *args, **kwargs)

    adapted.__moe_passes_original__ = original
    adapted.__moe_passes_traced__ = traced
    setattr(cls, method, adapted)
    record_adapted(cls, name)
    return True


# Run before an adapted method is traced for hpu_moe (discovery's check that each installed copy's proof
# still holds): the start-of-compile callback misses the first frame after a dynamo reset()
BEFORE_TRACE: list[Callable[[], None]] = []


@torch.compiler.assume_constant_result
def _refresh() -> bool:
    """Runs in plain Python while dynamo traces (a trace-time constant)."""
    for hook in BEFORE_TRACE:
        hook()
    return True


def retrace(cls: type, method: str, traceable: Callable | None) -> None:
    """Have hpu_moe trace `traceable` for `cls.method` from now on (None: the method as written). Dynamo
    guards the copy it traced, so frames compiled before trace again; a frame compiled now reads the new
    one (putting back the original method would not reach a frame already entered through the wrapper)."""
    installed = cls.__dict__.get(method)
    holder = getattr(installed, "__moe_passes_traced__", None)
    if holder is not None:
        holder[0] = traceable if traceable is not None else installed.__moe_passes_original__


def record_adapted(cls: type, name: str) -> None:
    """Note `cls` as adapted by `name` (also for adapters that hook methods other than forward)."""
    known = _ADAPTED.get(cls)
    _ADAPTED[cls] = name if known is None or name in known.split(" + ") else f"{known} + {name}"
    log.info("adapter %s installed on %s.%s", name, cls.__module__, cls.__qualname__)


def adapted_classes() -> dict[str, str]:
    """{"module.Class": adapter name} for every class adapted in this process (names joined by " + "
    where several adapters hook methods of one class)."""
    return {f"{cls.__module__}.{cls.__qualname__}": name for cls, name in _ADAPTED.items()}
