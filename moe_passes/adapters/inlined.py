"""Module functions that dynamo, tracing for hpu_moe, runs as their adapted copies (`_torchdynamo_inline`).

Dynamo traces a function's `_torchdynamo_inline` in its place (how it inlines a ScriptFunction's Python
source), and only dynamo reads it. A module function called by its global name (SGLang's
`moe_forward_native`), which no class attribute the adapter could replace reaches, gets there a
dispatcher that runs the adapted copy while dynamo traces for hpu_moe and the function's own code
otherwise. Eager calls never see it; a compile for another backend traces the function's code one call
deeper. A wrapper made with `functools.wraps` from the function after that copies the attribute (as it
copies any), and dynamo then traces the dispatcher in the wrapper's place: not done for the methods a
decorator wraps (`decorators` copies the wrapper instead).

The dispatcher stays once set (dynamo guards on it: taken away after each compile, it made every call
recompile), until the function's `__code__`, `__defaults__`, `__kwdefaults__` or an attribute is replaced
(the dispatcher carries a copy of its attributes, which dynamo reads in their place): the next
trace that reaches it then takes it off for good and has dynamo start that frame again, so that every
backend, hpu_moe included, traces the function as it now is. A frame compiled before such a change is not
traced again: dynamo guards the dispatcher's code and closure, and any read of the function inside the
dispatcher gives the dispatcher (dynamo wraps a function as its `_torchdynamo_inline`), so no guard on the
function's own `__code__` or `__defaults__` can be built from here; `torch._dynamo.reset()` clears such
frames.
"""

from __future__ import annotations

import logging
import types
import weakref

import torch

from .base import adapters_active

log = logging.getLogger(__name__)

INLINE = "_torchdynamo_inline"
# Dynamo starts the frame's analysis again on it, its speculation log cleared (as after it unspecialises
# a module it found changed): the path taken at the dispatcher differs on the second run.
_RESTART = getattr(torch._dynamo.exc, "UnspecializeRestartAnalysis", torch._dynamo.exc.RestartAnalysis)
_GIVEN: weakref.WeakSet[types.FunctionType] = weakref.WeakSet()  # functions whose dispatcher is set
_TAKEN_OFF: weakref.WeakSet[types.FunctionType] = weakref.WeakSet()


def inlined_elsewhere(fn: types.FunctionType) -> bool:
    """`fn` already has an `_torchdynamo_inline` this module did not set (a ScriptFunction's source), or had
    its dispatcher taken off after a change: it is left as it is."""
    return fn in _TAKEN_OFF or (INLINE in vars(fn) and fn not in _GIVEN)


def given(fn: types.FunctionType) -> bool:
    """`fn` has a dispatcher from this module, or had one taken off (it is not given another)."""
    return fn in _GIVEN or fn in _TAKEN_OFF


def inline_copy(fn: types.FunctionType, copy: types.FunctionType) -> bool:
    """Have dynamo, tracing for hpu_moe, run `copy` where `fn` is called; False where `fn` is left as it
    is (`inlined_elsewhere`)."""
    if inlined_elsewhere(fn):
        return False
    _GIVEN.add(fn)
    setattr(fn, INLINE, _dispatcher(fn, copy))
    return True


def _dispatcher(fn: types.FunctionType, copy: types.FunctionType) -> types.FunctionType:
    """What dynamo traces for `fn`: a copy under hpu_moe, else `fn`'s own code (a clone without the
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

    def traced(*args, **kwargs):
        check_unchanged()
        if adapters_active():
            return copy(*args, **kwargs)
        return own(*args, **kwargs)

    # Dynamo reads a traced function's attributes on what it traces: the dispatcher carries `fn`'s (a
    # wrapper reading `fn.attr` reads them), never its `_torchdynamo_inline` (dynamo would trace that
    # instead); `check_unchanged` compares them with fn's
    traced.__name__, traced.__qualname__, traced.__module__, traced.__doc__ = (
        fn.__name__, fn.__qualname__, fn.__module__, fn.__doc__)
    traced.__dict__.update(_attributes(fn))
    return traced


def _attributes(fn: types.FunctionType) -> dict:
    """`fn`'s own attributes: what a user or a decorator set on it, not the adapters' records."""
    return {k: v for k, v in vars(fn).items() if k != INLINE and not k.startswith("__moe_passes_")}


def _state(fn: types.FunctionType) -> list:
    """What a dispatcher copies from `fn` and a user may replace: its code, defaults, keyword defaults
    (the keyword-defaults dict is shared with the clone, so its items are taken too) and attributes."""
    return [fn.__code__, fn.__defaults__, *(item for pair in sorted((fn.__kwdefaults__ or {}).items()) for item in pair),
            *(item for pair in sorted(_attributes(fn).items(), key=lambda kv: kv[0]) for item in pair)]


def _same(state: list, made_from: list) -> bool:
    return len(state) == len(made_from) and all(a is b for a, b in zip(state, made_from, strict=True))


def _take_off(fn: types.FunctionType) -> None:
    if INLINE in vars(fn):
        delattr(fn, INLINE)
    _GIVEN.discard(fn)
    _TAKEN_OFF.add(fn)  # not given a dispatcher again from a copy decided before
    log.info("%s.%s was changed after its expert loop was adapted: its dispatcher is taken off",
             fn.__module__, fn.__qualname__)
