"""Module functions with expert loops, traced as their adapted copies while dynamo traces for hpu_moe.

MoE code often runs its expert loop in a module-level function that a method calls by its global name
(SGLang's `moe_forward_native(layer, x, topk_output, config)`), and reaches that method through a bound
method stored on the instance at construction (SGLang's `CustomOp._forward_method`), so that no class
attribute is looked up while tracing and a copy installed on the class would never run. Each such
function gets a dispatcher that dynamo traces in its place (`inlined`: the copy under hpu_moe, the
function's own code otherwise, and what happens when the function is changed later).
"""

from __future__ import annotations

import logging
import types

from . import hit_expert_loops
from .inlined import given, inline_copy, inlined_elsewhere

log = logging.getLogger(__name__)



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
            if not isinstance(callee, types.FunctionType) or given(callee) or inlined_elsewhere(callee):
                continue  # not a Python function, taken already, or inlined as something else (a ScriptFunction)
            if not hit_expert_loops.may_hold_expert_loop(callee):
                continue
            copy = hit_expert_loops.function_copy(callee)
            if copy is not None and inline_copy(callee, copy):
                taken.append(f"{callee.__module__}.{callee.__qualname__}")
                log.info("expert loop of %s.%s traced as its copy under hpu_moe", callee.__module__,
                         callee.__qualname__)
    return taken
