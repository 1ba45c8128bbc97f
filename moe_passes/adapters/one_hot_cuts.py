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
import builtins
import types

import torch

from .offset_slices import compile_with_helpers
from .source_ast import (
    Decisions,
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
_DECISIONS = Decisions("one_hot_cut_copy")  # on the function: its copy, or the reason


def one_hot_cut(ids: torch.Tensor, width, as_written):
    """`one_hot(ids, W)[..., :width]` for any W >= width: int64 one-hot rows of `width`, zeros for the ids
    at or past it. A width that is not an int >= 0 (a negative cut keeps all but the last columns of
    the W) is computed `as_written` (a thunk of the original expression)."""
    if isinstance(width, int) and not isinstance(width, bool) and width >= 0:
        return (ids.unsqueeze(-1) == torch.arange(width, device=ids.device)).long()
    return as_written()


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
        new_def = _CutOneHots(fn_def, fn.__globals__).visit(fn_def)
        new_def.decorator_list = []
        helpers = types.SimpleNamespace(one_hot_cut=one_hot_cut)
        return compile_with_helpers(fn, new_def, filename, _HELPERS, helpers)

    decision = decided(_DECISIONS.of(fn), "copy", f"{fn.__module__}.{fn.__qualname__}", decide, "one-hot cut")
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


def _resolve(expr: ast.AST, namespace: dict):
    """The object a dotted name (`F.one_hot`, `torch.nn.functional.one_hot`) stands for in `namespace`."""
    if isinstance(expr, ast.Name):
        return namespace.get(expr.id, getattr(builtins, expr.id, None))
    if isinstance(expr, ast.Attribute):
        return getattr(_resolve(expr.value, namespace), expr.attr, None)
    return None


class _CutOneHots(ast.NodeTransformer):
    """`one_hot(i, W)[..., :n]` -> `one_hot_cut(i, n, lambda: <as written>)` where W >= n is shown;
    raises NotAdaptable when none is.

    W >= n is shown when W is the builtin `max(..., n, ...)`, inline or in a name bound once in the
    body (not a parameter) and read only there, with no name `n` reads bound anywhere in the body
    (so `n` has one value throughout); `one_hot` must be torch's and `max` the builtin."""

    def __init__(self, fn_def: ast.FunctionDef, namespace: dict):
        self.assigned = bindings(fn_def)
        arguments = fn_def.args
        self.parameters = {a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs,
                                           *filter(None, (arguments.vararg, arguments.kwarg)))}
        self.reads = [n.id for n in walk_function(fn_def) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)]
        self.namespace = namespace
        self.builtin_max = "max" not in self.assigned and "max" not in self.parameters and (
            namespace.get("max", builtins.max) is builtins.max)
        self.dropped: set[int] = set()  # ids of the width bindings read only by a rewritten cut
        if not any(self._shown(node) for node in walk_function(fn_def)):
            raise NotAdaptable("no one-hot cut to a width it is shown to reach (`one_hot(i, max(.., n))[..., :n]`)")

    def _shown(self, node: ast.AST) -> bool:
        """`node` is a cut one-hot whose width is shown to reach the cut (and notes a width binding to drop)."""
        found = _width_cut(node)
        if found is None or _resolve(found[0].func, self.namespace) is not torch.nn.functional.one_hot:
            return False
        (_, width), bound = found[0].args, found[1]
        if not self.builtin_max or loads(bound) & set(self.assigned):
            return False
        if self._at_least(width, bound):
            return True
        if isinstance(width, ast.Name) and self._bound_once_to_max(width.id, bound):
            self.dropped.add(id(self.assigned[width.id][0]))
            return True
        return False

    @staticmethod
    def _at_least(width: ast.expr, bound: ast.expr) -> bool:
        """`width` is `max(..., bound, ...)` (the builtin, checked by the caller: at least `bound`)."""
        return (isinstance(width, ast.Call) and isinstance(width.func, ast.Name) and width.func.id == "max"
                and not width.keywords and len(width.args) >= 2
                and any(ast.dump(a) == ast.dump(bound) for a in width.args))

    def _bound_once_to_max(self, name: str, bound: ast.expr) -> bool:
        bound_by = self.assigned.get(name, [])
        return (name not in self.parameters and len(bound_by) == 1 and isinstance(bound_by[0], ast.Assign)
                and len(bound_by[0].targets) == 1 and isinstance(bound_by[0].targets[0], ast.Name)
                and self._at_least(bound_by[0].value, bound) and self.reads.count(name) == 1)

    def visit_Assign(self, node: ast.Assign):
        if id(node) in self.dropped:
            return ast.copy_location(ast.Pass(), node)
        return self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript):
        node = self.generic_visit(node)
        if not self._shown(node):
            return node
        call, bound = _width_cut(node)
        ids, width = call.args
        if isinstance(width, ast.Name) and width.id not in self.parameters and self.reads.count(width.id) == 1:
            # its binding is dropped: the thunk recomputes it as written
            width = self.assigned[width.id][0].value
            node = ast.Subscript(ast.Call(call.func, [ids, width], []), node.slice, ast.Load())
        thunk = ast.Lambda(ast.arguments([], [], None, [], [], None, []), node)
        helper = ast.Attribute(ast.Name(_HELPERS, ast.Load()), "one_hot_cut", ast.Load())
        return ast.copy_location(ast.Call(helper, [ids, bound, thunk], []), node)
