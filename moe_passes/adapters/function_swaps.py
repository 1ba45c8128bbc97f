"""Module functions with expert loops, traced as their adapted copies while dynamo compiles for hpu_moe.

MoE code often runs its expert loop in a module-level function that a method calls by its global name
(SGLang's `moe_forward_native(layer, x, topk_output, config)`), and reaches that method through a bound
method stored on the instance at construction (SGLang's `CustomOp._forward_method`), so that no class
attribute is looked up while tracing and a copy installed on the class would never run. Dynamo traces a
function's `_torchdynamo_inline` in its place (how it inlines a ScriptFunction's Python source): for the
frames it compiles for hpu_moe, and only for those, each such function gets its traced copy there. A
start-of-compile callback sets the attribute and the end-of-compile callback removes it, so that eager
calls and compiles for any other backend never see it.
"""

from __future__ import annotations

import logging
import types
import weakref

from . import hit_expert_loops
from .base import compiling_for_hpu_moe

log = logging.getLogger(__name__)

_INLINE = "_torchdynamo_inline"
_SWAPPED: weakref.WeakSet[types.FunctionType] = weakref.WeakSet()  # functions with an adapted copy
_SET_NOW: list[types.FunctionType] = []  # functions given the attribute for the compile in progress


def look_at_callees(cls: type) -> list[str]:
    """Adapt the module functions that methods of `cls` call by a global name and that hold an expert
    loop the expert-loop adapter takes; "module.function" for each one taken now."""
    taken = []
    for method in list(vars(cls).values()):
        method = getattr(method, "__moe_passes_original__", method)
        if not isinstance(method, types.FunctionType):
            continue
        for name in method.__code__.co_names:
            callee = method.__globals__.get(name)
            if not isinstance(callee, types.FunctionType) or callee in _SWAPPED or _INLINE in vars(callee):
                continue
            if not hit_expert_loops.may_hold_expert_loop(callee):
                continue
            if hit_expert_loops.function_copy(callee) is not None:
                _SWAPPED.add(callee)
                taken.append(f"{callee.__module__}.{callee.__qualname__}")
                log.info("expert loop of %s.%s traced as its copy under hpu_moe", callee.__module__,
                         callee.__qualname__)
    return taken


def swap_in(*_args) -> None:
    """Dynamo start-of-compile callback: for an hpu_moe compile, point each adapted function at its copy."""
    if not compiling_for_hpu_moe():
        return
    for fn in list(_SWAPPED):
        copy = hit_expert_loops.function_copy(fn)
        if copy is not None and _INLINE not in vars(fn):
            setattr(fn, _INLINE, copy)
            _SET_NOW.append(fn)


def swap_out(*_args) -> None:
    """Dynamo end-of-compile callback: take back every attribute `swap_in` set."""
    while _SET_NOW:
        vars(_SET_NOW.pop()).pop(_INLINE, None)
