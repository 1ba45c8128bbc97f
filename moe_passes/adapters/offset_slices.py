"""Module-level functions that cut rows at per-expert offsets held in a tensor (transformers 4.x Aria's
`sequential_experts_gemm`), made traceable by dynamo before torch 2.12:

    offsets = torch.cat((torch.zeros(1, ...), torch.cumsum(counts, dim=0)))
    for e in range(E):
        start = offsets[e]
        end = offsets[e + 1]
        out[start:end] = torch.matmul(rows[start:end], W[e])

Slice bounds that are 0-dim tensors break the graph in torch 2.9 and 2.10; torch 2.11 cannot tell that
the read and the written slice have one size (each tensor bound is read as a number separately). The
traced copy reads each bound once, where it is bound (`offset(offsets[e])`: `.item()`, told >= 0), and
cuts with `cut(X, start, end)`, which tells the trace 0 <= start <= end <= len(X); a write
`Y[start:end] = v` becomes `cut(Y, start, end).copy_(v)`, what slice assignment does. Offsets that are
running sums of counts satisfy these bounds; the compiled graph checks them, so a bound outside them
raises instead of being wrapped or clamped as Python slicing would.

Recognised from the function's source: the offsets are one binding of `cumsum(...)` or of
`cat((zeros(...), cumsum(...)))`; the bounds are names bound in a `for ... in range(...)` loop to
elements of the offsets and read only as the bounds of such slices. Anything else leaves the function
as written. A method that calls such a function (a global of its module) traces the copy instead; the
copy is used only while hpu_moe traces, like every adapter.
"""

from __future__ import annotations

import ast
import types

import numpy
import torch

from .source_ast import (
    Decisions,
    NotAdaptable,
    adapted_callees,
    bindings,
    call_name,
    decided,
    function_source,
    walk_function,
)

_HELPERS = "__moe_passes_offset_helpers"
_DECISIONS = Decisions("offset_slice_copy")  # on the function: its copy, or the reason


# A tuple, not `X | Y`: dynamo of torch 2.9 cannot trace isinstance with a types.UnionType.
_HOLDS_A_NUMBER = (torch.Tensor, numpy.ndarray, numpy.generic)


def _number(value):
    """A bound as a Python number: the value of a 0-dim tensor or of a numpy scalar (counts read with
    `.cpu().numpy()`), read with `.item()` (kept symbolic by the trace), else the value itself."""
    return value.item() if isinstance(value, _HOLDS_A_NUMBER) else value


def offset(value) -> int:
    """A slice bound held in a 0-dim tensor, read as a number once (kept symbolic by the trace)."""
    number = _number(value)
    torch._check(number >= 0)
    return number


def write(rows: torch.Tensor, value: torch.Tensor, start, end) -> torch.Tensor:
    """`rows` with `value` written over rows start..end (`rows[start:end] = value` without the in-place
    copy, whose broadcasting test older torch cannot decide for symbolic sizes); bounds as in `cut`. As in
    the assignment, `value` may be a number, a tensor of fewer dims that broadcasts to the rows cut, or of
    another dtype (sizes of a tensor with as many dims are left to slice_scatter: comparing them would
    guard on data-dependent sizes)."""
    piece = cut(rows, start, end)
    if not isinstance(value, torch.Tensor) or value.dim() != piece.dim() or value.dtype != rows.dtype:
        value = torch.as_tensor(value, device=rows.device).to(rows.dtype).expand_as(piece)
    return torch.slice_scatter(rows, value, 0, start, end)


def cut(rows: torch.Tensor, start, end) -> torch.Tensor:
    """rows[start:end] for offsets that may be 0-dim tensors or numpy scalars, read as numbers (kept
    symbolic by the trace; older dynamo refuses a slice with tensor bounds).

    The offsets are running sums of per-expert counts over the rows being cut, so 0 <= start <= end
    <= len(rows): the trace is told so (older torch cannot otherwise decide how slicing treats symbolic
    bounds), and the compiled code checks it."""
    start, end = _number(start), _number(end)
    torch._check(start >= 0)
    torch._check(start <= rows.shape[0])
    torch._check(end >= 0)  # implied by the next, but older torch does not derive it for a sum of counts
    torch._check(end >= start)
    torch._check(end <= rows.shape[0])
    return rows[start:end]


def adapted_calls(fn: types.FunctionType) -> dict[str, types.FunctionType]:
    """{global name: traced copy} for the plain functions `fn` calls by a global name that cut at offsets."""
    return adapted_callees(fn, sums_offsets, traced_copy)


def sums_offsets(callee) -> bool:
    """A plain Python function that computes a cumsum (a cheap filter before its source is read)."""
    return isinstance(callee, types.FunctionType) and "cumsum" in callee.__code__.co_names


def traced_copy(fn: types.FunctionType) -> types.FunctionType | None:
    """The copy of `fn` that reads its offsets as numbers, or None (the reason is logged and kept)."""
    def decide():
        fn_def, filename = function_source(fn)
        return _rewrite(fn, fn_def, filename, _bounds(fn_def))

    decision = decided(_DECISIONS.of(fn), "copy", f"{fn.__module__}.{fn.__qualname__}", decide, "offset slices")
    return decision if isinstance(decision, types.FunctionType) else None


def _is_offsets(value: ast.AST, name: str, assigned: dict) -> bool:
    """`cumsum(...)`, or `cat((Z, C))` / `cat([...])` with Z `zeros(...)` (or a name bound once to it)
    and C a `cumsum(...)` or the name's own previous value (`offsets = cat((zero, offsets))`): running
    sums from 0."""
    if call_name(value) == "cumsum":
        return True
    if call_name(value) != "cat" or not value.args or not isinstance(value.args[0], ast.Tuple | ast.List):
        return False
    *zeros, last = value.args[0].elts
    sums = call_name(last) == "cumsum" or (isinstance(last, ast.Name) and last.id == name)
    return sums and all(_is_zeros(part, assigned) for part in zeros)


def _is_zeros(value: ast.AST, assigned: dict) -> bool:
    if isinstance(value, ast.Name):
        bound = assigned.get(value.id, [])
        return len(bound) == 1 and isinstance(bound[0], ast.Assign) and call_name(bound[0].value) == "zeros"
    return call_name(value) == "zeros"


_FRESH = {"zeros", "zeros_like", "empty", "empty_like", "new_zeros", "new_empty", "full", "new_full"}


def written_fresh(fn_def: ast.FunctionDef, loop: ast.For, names: set[str], assigned: dict) -> set[str]:
    """Names written at offsets in `loop` (`Y[s:t] = v`) that hold a tensor created in this function and
    read nowhere but in those writes and after the loop: for them `Y = write(Y, v, s, t)` is the same
    computation (no other reference sees Y change)."""
    targets = {
        node.targets[0].value.id
        for node in ast.walk(loop)
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Subscript)
        and _is_cut(node.targets[0], names) and isinstance(node.targets[0].value, ast.Name)
    }
    written_at = {
        id(node.targets[0].value)
        for node in ast.walk(loop)
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Subscript)
    }
    fresh = set()
    for name in targets:
        bound = assigned.get(name, [])
        if len(bound) != 1 or not isinstance(bound[0], ast.Assign) or call_name(bound[0].value) not in _FRESH:
            continue
        reads = [n for n in walk_function(fn_def) if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)]
        if all(id(n) in written_at or n.lineno > loop.end_lineno for n in reads):
            fresh.add(name)
    return fresh


def _bounds(fn_def: ast.FunctionDef) -> dict[int, tuple[set[str], set[str]]]:
    """{line of a loop: (the names it binds to elements of the offsets, the fresh tensors it writes at
    them)}; NotAdaptable if there are none or a bound is read other than as a slice bound."""
    assigned = bindings(fn_def)
    offsets = {
        name
        for name, bound in assigned.items()
        if all(isinstance(b, ast.Assign) and len(b.targets) == 1 and _is_offsets(b.value, name, assigned) for b in bound)
        and any(call_name(b.value) == "cumsum" or _sums_inline(b.value) for b in bound)
    }
    loops = {}
    for loop in walk_function(fn_def):
        if not (isinstance(loop, ast.For) and call_name(loop.iter) == "range"):
            continue
        names = {name for stmt in loop.body for name in _offset_bindings(stmt, offsets)}
        if names:
            _check_reads(loop, names, assigned)
            loops[loop.lineno] = (names, written_fresh(fn_def, loop, names, assigned))
    if not loops:
        raise NotAdaptable("no loop over range(...) binds elements of cumsum offsets")
    return loops


def _sums_inline(value: ast.AST) -> bool:
    return call_name(value) == "cat" and call_name(value.args[0].elts[-1]) == "cumsum"


def _offset_bindings(stmt: ast.stmt, offsets: set[str]) -> list[str]:
    """The names `stmt` binds to `O[i]` for offsets O: `s = O[e]`, `s, t = O[e], O[e + 1]`."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1):
        return []
    target, value = stmt.targets[0], stmt.value
    pairs = (
        list(zip(target.elts, value.elts, strict=True))
        if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts)
        else [(target, value)]
    )
    return [
        name.id
        for name, element in pairs
        if isinstance(name, ast.Name) and _element_of(element, offsets)
    ]


def _element_of(value: ast.AST, offsets: set[str]) -> bool:
    return isinstance(value, ast.Subscript) and isinstance(value.value, ast.Name) and value.value.id in offsets


def _check_reads(loop: ast.For, names: set[str], assigned: dict) -> None:
    """Each bound is bound once, and read only as the lower/upper bound of a step-less slice."""
    for name in names:
        if len(assigned.get(name, [])) != 1:
            raise NotAdaptable(f"line {loop.lineno}: offset {name} is bound more than once")
    as_bounds = {
        id(bound)
        for node in ast.walk(loop)
        if isinstance(node, ast.Subscript) and _is_cut(node, names)
        for bound in (node.slice.lower, node.slice.upper)
    }
    for node in ast.walk(loop):
        if isinstance(node, ast.Name) and node.id in names and isinstance(node.ctx, ast.Load) and id(node) not in as_bounds:
            raise NotAdaptable(f"line {node.lineno}: offset {node.id} is read other than as a slice bound")


def _is_cut(node: ast.Subscript, names: set[str]) -> bool:
    bounds = node.slice
    return (
        isinstance(bounds, ast.Slice)
        and bounds.step is None
        and all(isinstance(b, ast.Name) and b.id in names for b in (bounds.lower, bounds.upper))
    )


class CutAtOffsets(ast.NodeTransformer):
    """Slices at the offset names `names`, cut with checked bounds: `X[s:t]` -> `cut(X, s, t)`. A store
    `Y[s:t] = v` into a buffer in `fresh` (made for the stores alone, `written_fresh`) -> `Y = write(Y, v, s,
    t)`: no other reference sees Y change, and dynamo of torch 2.11 cannot tell an in-place slice has the
    value's rows; any other -> `cut(Y, s, t).copy_(v)`, what slice assignment does. `helpers`: the name the
    traced copy binds its helpers (`cut`, `write`) to."""

    def __init__(self, names: set[str], fresh: set[str], helpers: str = _HELPERS):
        self.names, self.fresh, self.helpers = names, fresh, helpers

    def visit_Assign(self, node: ast.Assign):
        node = self.generic_visit(node)
        target = node.targets[0] if len(node.targets) == 1 else None
        if not (isinstance(target, ast.Subscript) and _is_cut(target, self.names)):  # Y[s:t] = v
            return node
        if isinstance(target.value, ast.Name) and target.value.id in self.fresh:  # Y = write(Y, v, s, t)
            name = target.value.id
            call = ast.Call(self._helper("write"), [ast.Name(name, ast.Load()), node.value, *self._bounds(target)], [])
            return _located(ast.Assign([ast.Name(name, ast.Store())], call), node)
        copy = ast.Call(ast.Attribute(self._cut(target), "copy_", ast.Load()), [node.value], [])
        return _located(ast.Expr(copy), node)

    def visit_Subscript(self, node: ast.Subscript):
        node = self.generic_visit(node)
        if isinstance(node.ctx, ast.Load) and _is_cut(node, self.names):
            return _located(self._cut(node), node)
        return node

    def _helper(self, name: str) -> ast.expr:
        return ast.Attribute(ast.Name(self.helpers, ast.Load()), name, ast.Load())

    @staticmethod
    def _bounds(node: ast.Subscript) -> list[ast.expr]:
        return [ast.Name(node.slice.lower.id, ast.Load()), ast.Name(node.slice.upper.id, ast.Load())]

    def _cut(self, node: ast.Subscript) -> ast.expr:
        return ast.Call(self._helper("cut"), [node.value, *self._bounds(node)], [])


class _ReadOffsets(CutAtOffsets):
    """Bindings of bounds read once as numbers; slices at them cut with checked bounds."""

    def visit_Assign(self, node: ast.Assign):
        node = super().visit_Assign(node)
        if not isinstance(node, ast.Assign):
            return node
        target = node.targets[0] if len(node.targets) == 1 else None
        if isinstance(target, ast.Name) and target.id in self.names:
            node.value = self._read(node.value)
        elif isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
            node.value.elts = [
                self._read(v) if isinstance(t, ast.Name) and t.id in self.names else v
                for t, v in zip(target.elts, node.value.elts, strict=True)
            ]
        return node

    def _read(self, value: ast.expr) -> ast.expr:
        return _located(ast.Call(self._helper("offset"), [value], []), value)


def _located(new: ast.AST, at: ast.AST) -> ast.AST:
    """`new`, each node it adds reported at `at`'s place (the nodes it takes over keep theirs): the copy's
    later rewrites read their lines."""
    for part in ast.walk(new):
        if isinstance(part, ast.expr | ast.stmt) and not hasattr(part, "lineno"):
            ast.copy_location(part, at)
    return new


def _rewrite(fn, fn_def: ast.FunctionDef, filename: str, loops: dict) -> types.FunctionType:
    class _Loops(ast.NodeTransformer):
        def visit_For(self, node: ast.For):
            node = self.generic_visit(node)
            return _ReadOffsets(*loops[node.lineno]).visit(node) if node.lineno in loops else node

    new_def = _Loops().visit(fn_def)
    new_def.decorator_list = []
    helpers = types.SimpleNamespace(offset=offset, cut=cut, write=write)
    return compile_with_helpers(fn, new_def, filename, _HELPERS, helpers)


def compile_with_helpers(fn, new_def: ast.FunctionDef, filename: str, helpers_name: str, helpers) -> types.FunctionType:
    """`new_def` compiled as a copy of `fn` (same globals, closure, defaults, file and line numbers),
    with `helpers_name` bound to `helpers` in its closure."""
    free = list(fn.__code__.co_freevars)
    factory = ast.parse(f"def __moe_passes_factory({', '.join([*free, helpers_name])}):\n    pass").body[0]
    factory.body = [new_def, ast.Return(ast.Name(new_def.name, ast.Load()))]
    module = ast.Module(body=[factory], type_ignores=[])
    ast.fix_missing_locations(module)
    code = compile(module, filename, "exec")
    factory_code = next(c for c in code.co_consts if isinstance(c, types.CodeType))
    fn_code = next(c for c in factory_code.co_consts if isinstance(c, types.CodeType) and c.co_name == fn.__name__)
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True))
    cells[helpers_name] = types.CellType(helpers)
    closure = tuple(cells[name] for name in fn_code.co_freevars)
    new_fn = types.FunctionType(fn_code, fn.__globals__, fn.__name__, fn.__defaults__, closure)
    new_fn.__kwdefaults__ = fn.__kwdefaults__
    new_fn.__qualname__ = fn.__qualname__
    new_fn.__module__ = fn.__module__
    return new_fn
