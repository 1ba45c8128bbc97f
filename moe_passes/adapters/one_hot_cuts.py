"""Module-level functions that size a one-hot by a value read on the host and cut it to a fixed width
(tensor2tensor's `safe_one_hot`, as lucidrains' mixture-of-experts and st-moe write it):

    def safe_one_hot(indexes, max_length):
        top = indexes.max() + 1
        return F.one_hot(indexes, max(top + 1, max_length))[..., :max_length]

Python's `max` of a tensor and a number compares them on the host: dynamo breaks the graph there
(`aten._local_scalar_dense`), and the gating that calls it runs eagerly. The cut makes the width
irrelevant: for any W >= n, `one_hot(i, W)[..., :n]` holds, for each id, a one at i when i < n and zeros
otherwise, which is `(i[..., None] == arange(n))` as int64. W >= n holds when W is `max(..., n, ...)`,
written inline or bound to a name read only there (that binding, the host read, is dropped). The traced
copy computes the cut one-hot with no host read. It equals eager wherever eager runs; where eager raises
(an id at or past W, or negative), the copy gives a row of zeros instead.

A method that calls such a function by a global name of its module traces the copy instead; the copy is
used only while hpu_moe traces, like every adapter.
"""

from __future__ import annotations

import ast
import types

import torch

from .offset_slices import compile_with_helpers
from .source_ast import (
    NotAdaptable,
    adapted_callees,
    bindings,
    call_name,
    decided,
    function_source,
    loads,
    walk_function,
)

_HELPERS = "__moe_passes_one_hot_helpers"
_DECISIONS: dict[types.FunctionType, types.FunctionType | str] = {}


def one_hot_cut(ids: torch.Tensor, width: int) -> torch.Tensor:
    """`one_hot(ids, W)[..., :width]` for any W >= width: int64 one-hot rows of `width`, zeros for the ids
    at or past it."""
    return (ids.unsqueeze(-1) == torch.arange(width, device=ids.device)).long()


def sizes_one_hot_on_host(callee) -> bool:
    """A plain Python function that calls `one_hot` and the builtin `max` (a cheap filter before its
    source is read)."""
    names = getattr(getattr(callee, "__code__", None), "co_names", ())
    return isinstance(callee, types.FunctionType) and "one_hot" in names and "max" in names


def adapted_one_hot_calls(fn: types.FunctionType) -> dict[str, types.FunctionType]:
    """{global name: traced copy} for the plain functions `fn` calls by a global name that cut a one-hot
    sized on the host."""
    return adapted_callees(fn, sizes_one_hot_on_host, traced_copy)


def traced_copy(fn: types.FunctionType) -> types.FunctionType | None:
    """The copy of `fn` that cuts its one-hots with no host read, or None (the reason is logged and kept)."""

    def decide():
        fn_def, filename = function_source(fn)
        new_def = _CutOneHots(fn_def).visit(fn_def)
        new_def.decorator_list = []
        helpers = types.SimpleNamespace(one_hot_cut=one_hot_cut)
        return compile_with_helpers(fn, new_def, filename, _HELPERS, helpers)

    decided(_DECISIONS, fn, f"{fn.__module__}.{fn.__qualname__}", decide, "one-hot cut")
    decision = _DECISIONS[fn]
    return decision if isinstance(decision, types.FunctionType) else None


def _width_cut(node: ast.AST) -> tuple[ast.Call, ast.expr] | None:
    """(the one_hot call, n) for `one_hot(i, W)[..., :n]`."""
    if not (isinstance(node, ast.Subscript) and call_name(node.value) == "one_hot"):
        return None
    index = node.slice
    if not (isinstance(index, ast.Tuple) and len(index.elts) == 2):
        return None
    ellipsis, cut = index.elts
    if not (isinstance(ellipsis, ast.Constant) and ellipsis.value is Ellipsis and isinstance(cut, ast.Slice)):
        return None
    if cut.lower is not None or cut.step is not None or cut.upper is None:
        return None
    call = node.value
    if len(call.args) != 2 or call.keywords:
        return None
    return call, cut.upper


def _at_least(width: ast.expr, bound: ast.expr) -> bool:
    """`width` is `max(..., bound, ...)` (the builtin: at least `bound`)."""
    return (isinstance(width, ast.Call) and isinstance(width.func, ast.Name) and width.func.id == "max"
            and not width.keywords and len(width.args) >= 2 and any(ast.dump(a) == ast.dump(bound) for a in width.args))


class _CutOneHots(ast.NodeTransformer):
    """`one_hot(i, W)[..., :n]` -> `one_hot_cut(i, n)` where W >= n is shown; raises NotAdaptable when
    none is."""

    def __init__(self, fn_def: ast.FunctionDef):
        self.assigned = bindings(fn_def)
        self.reads = [n.id for n in walk_function(fn_def) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)]
        self.dropped: set[int] = set()  # ids of the width bindings read only by a rewritten cut
        cuts = 0
        for node in walk_function(fn_def):
            found = _width_cut(node)
            if found is None:
                continue
            (_, width), bound = found[0].args, found[1]
            if _at_least(width, bound):
                cuts += 1
            elif isinstance(width, ast.Name) and self._bound_once_to_max(width.id, bound):
                self.dropped.add(id(self.assigned[width.id][0]))
                cuts += 1
        if not cuts:
            raise NotAdaptable("no one-hot cut to a width it is shown to reach (`one_hot(i, max(.., n))[..., :n]`)")

    def _bound_once_to_max(self, name: str, bound: ast.expr) -> bool:
        bound_by = self.assigned.get(name, [])
        return (len(bound_by) == 1 and isinstance(bound_by[0], ast.Assign) and len(bound_by[0].targets) == 1
                and isinstance(bound_by[0].targets[0], ast.Name) and _at_least(bound_by[0].value, bound)
                and self.reads.count(name) == 1 and not loads(bound) & {name})

    def visit_Assign(self, node: ast.Assign):
        if id(node) in self.dropped:
            return ast.copy_location(ast.Pass(), node)
        return self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript):
        node = self.generic_visit(node)
        found = _width_cut(node)
        if found is None:
            return node
        (ids, width), bound = found[0].args, found[1]
        if not (_at_least(width, bound) or (isinstance(width, ast.Name) and self._bound_once_to_max(width.id, bound))):
            return node
        helper = ast.Attribute(ast.Name(_HELPERS, ast.Load()), "one_hot_cut", ast.Load())
        return ast.copy_location(ast.Call(helper, [ids, bound], []), node)
