"""Module functions with expert loops, traced as their adapted copies while dynamo traces for hpu_moe.

MoE code often runs its expert loop in a module-level function that a method calls by its global name
(SGLang's `moe_forward_native(layer, x, topk_output, config)`), and reaches that method through a bound
method stored on the instance at construction (SGLang's `CustomOp._forward_method`), so that no class
attribute is looked up while tracing and a copy installed on the class would never run. Dynamo traces a
function's `_torchdynamo_inline` in its place (how it inlines a ScriptFunction's Python source), and only
dynamo reads it: each such function gets there a dispatcher that runs the traced copy while dynamo traces
for hpu_moe and the function's own code otherwise. Eager calls never see it; a compile for another backend
traces the function's code one call deeper. It stays once set (dynamo guards on it: taken away after each
compile, it made every call recompile), until the function's `__code__`, `__defaults__` or
`__kwdefaults__` is replaced: the next trace that reaches the dispatcher then takes it off for good and
has dynamo start that frame again, so that every backend, hpu_moe included, traces the function as it
now is (as written: it is not adapted again). A frame compiled before such a change is not traced again:
dynamo guards the dispatcher's code and closure, and any read of the function inside the dispatcher gives
the dispatcher (dynamo wraps a function as its `_torchdynamo_inline`), so no guard on the function's own
`__code__` or `__defaults__` can be built from here; `torch._dynamo.reset()` clears such frames.
"""

from __future__ import annotations

import functools
import logging
import types
import weakref

import torch

from . import hit_expert_loops
from .base import adapters_active

log = logging.getLogger(__name__)

_INLINE = "_torchdynamo_inline"
# Dynamo starts the frame's analysis again on it, its speculation log cleared (as after it unspecialises
# a module it found changed): the path taken at the dispatcher differs on the second run.
_RESTART = getattr(torch._dynamo.exc, "UnspecializeRestartAnalysis", torch._dynamo.exc.RestartAnalysis)
_SWAPPED: weakref.WeakSet[types.FunctionType] = weakref.WeakSet()  # functions given a dispatcher


def look_at_callees(cls: type) -> list[str]:
    """Give a dispatcher to the module functions that methods of `cls` call by a global name and that
    hold an expert loop the expert-loop adapter takes; "module.function" for each one taken now."""
    taken = []
    for method in list(vars(cls).values()):
        method = getattr(method, "__moe_passes_original__", method)
        if not isinstance(method, types.FunctionType):
            continue
        for name in method.__code__.co_names:
            callee = method.__globals__.get(name)
            if not isinstance(callee, types.FunctionType) or callee in _SWAPPED or _INLINE in vars(callee):
                continue  # not a Python function, taken already, or inlined as something else (a ScriptFunction)
            if not hit_expert_loops.may_hold_expert_loop(callee):
                continue
            copy = hit_expert_loops.function_copy(callee)
            if copy is not None:
                setattr(callee, _INLINE, _dispatcher(callee, copy))
                _SWAPPED.add(callee)
                taken.append(f"{callee.__module__}.{callee.__qualname__}")
                log.info("expert loop of %s.%s traced as its copy under hpu_moe", callee.__module__,
                         callee.__qualname__)
    return taken


def _dispatcher(fn: types.FunctionType, copy: types.FunctionType) -> types.FunctionType:
    """What dynamo traces for `fn`: `copy` under hpu_moe, else `fn`'s own code (a clone without the
    attribute, which would otherwise send dynamo back here); neither once `fn` was changed."""
    own = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    own.__kwdefaults__ = fn.__kwdefaults__
    made_from = _state(fn)

    @torch.compiler.assume_constant_result
    def check_unchanged() -> bool:
        """Runs in plain Python while dynamo traces (a trace-time constant)."""
        if _same(_state(fn), made_from):
            return True
        _take_off(fn)
        raise _RESTART(f"{fn.__module__}.{fn.__qualname__} was changed after its expert loop was adapted")

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        check_unchanged()
        if adapters_active():
            return copy(*args, **kwargs)
        return own(*args, **kwargs)

    return traced


def _state(fn: types.FunctionType) -> list:
    """What a dispatcher copies from `fn` and a user may replace: its code, defaults and keyword
    defaults (the keyword-defaults dict is shared with the clone, so its items are taken too)."""
    return [fn.__code__, fn.__defaults__, *(item for pair in sorted((fn.__kwdefaults__ or {}).items()) for item in pair)]


def _same(state: list, made_from: list) -> bool:
    return len(state) == len(made_from) and all(a is b for a, b in zip(state, made_from, strict=True))


def _take_off(fn: types.FunctionType) -> None:
    if _INLINE in vars(fn):  # it stays in _SWAPPED: not adapted again from the copy decided before
        delattr(fn, _INLINE)
    log.info("%s.%s was changed after its expert loop was adapted: its dispatcher is taken off",
             fn.__module__, fn.__qualname__)
