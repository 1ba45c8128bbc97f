"""Tensor values read on the host in an expert loop: the ones a traced copy can do without, and the rest.

Capturing a loop that selects tokens with `torch.where` / `nonzero` needs dynamo to keep data-dependent
sizes symbolic (`capture_dynamic_output_shape_ops`). Under that setting a list made of a tensor whose
LENGTH depends on the data (`.tolist()` of selected rows, of a `bincount`) can no longer break the graph
as it does by default: dynamo raises, since a Python list needs a concrete length. (A number read off a
fixed-size tensor, `.item()` of a sum, is kept symbolic or breaks the graph as usual, and a branch on a
data-dependent size breaks it too.) So the copy traced for `hpu_moe` is made only when every such list is
one of these:

- **a list used as an index** (transformers 4.3x Mixtral, Grok-1, Phi-3.5-MoE, XVERSE):
      rows_list = rows.tolist()
      x[None, rows_list] ... w[rows_list, slot_list, None]
  `rows_list` is read only inside subscripts, as one index among others. Advanced indexing turns a list of
  ints into an int64 tensor of those ints, so `rows` itself indexes the same elements (an empty list and
  an empty int64 tensor both select nothing). The copy indexes with `rows` and makes no host read.

Any other such list is named and the method is left as written: it then breaks the graph there exactly
as it does without `hpu_moe`.

- **a cut to a capacity, guarded by a size read on the host** (makeMoE):
      kept = rows[:capacity] if rows.numel() > capacity else rows
  (also `len(rows)`, `rows.shape[0]`, `rows.size(0)` in the test). `rows[:capacity]` is `rows` itself
  whenever rows has no more than `capacity` rows, so the branch picks the same value either way; the
  copy cuts unconditionally (for `numel()`, where rows is 1-D: a trace-time test), with no host read.
  Whether a cut drops tokens is then the finders' question, and a cut rows tensor is declined by them.

- **split sizes read on the host** (torchtune's and torchtitan's grouped experts without grouped GEMM,
  Arctic, LLaMA-MoE):
      pieces = torch.split(x, counts.tolist())      # or sizes = counts.tolist(); x.split(sizes, dim=0)
  Each size becomes an unbacked SymInt when dynamo keeps host reads symbolic (`capture_scalar_outputs`),
  and `split` checks at run time that they add up to the split dim, so the pieces and everything after
  them are the same as eager's. The copy traced for `hpu_moe` switches that setting on for the compile;
  a branch on a size later still breaks the graph there, as it would at the host read by default.

- **sizes read on the host gathered into a tensor** (labml's switch, for its load statistics):
      counts = x.new_tensor([len(rows[i]) for i in range(E)])
  `Tensor.new_tensor(data)` and `torch.tensor(data, dtype=x.dtype, device=x.device)` build the same tensor
  from the same Python list (one C++ path, `internal_new_from_data`); dynamo before torch 2.11 traces
  the second with data-dependent lengths in the list and raises on the first. The copy spells it so.
- **a prefix cut at a count of true elements read on the host** (LongCat-Flash's deterministic MoE):
      kept = (flat_ids < routed).sum().item()
      rows = order[:kept]
  A sum of booleans is at least 0, and for a count n >= 0 `X[:n]` is `X.narrow(0, 0, min(len(X), n))`.
  Dynamo before torch 2.11 guards on the sign of the unbacked count in the slice, and raises; it traces
  the narrow once told the sign. The copy states it (`torch._check(n >= 0)`, true by construction) and
  narrows.
"""

from __future__ import annotations

import ast
import dataclasses

import torch

from .source_ast import (
    NotAdaptable,
    bindings,
    boolean_by_construction,
    call_name,
    changes_in_place,
    loop_index,
    moves_itself,
    number_read,
    span,
    strip_methods,
    walk_function,
)

_VIEWS = {"view", "reshape", "flatten", "contiguous", "cpu", "long", "int", "to", "squeeze", "unsqueeze"}


@dataclasses.dataclass(frozen=True)
class ListIndex:
    """`name = rows.tolist()` (at `line`), where `name` is read only as an index: replaced by `rows`."""

    line: int
    name: str
    rows: str
    at: tuple[int, int, int, int] | None = None  # an inline `rows.tolist()` index (name ""): where it stands


def length_reads(fn_def: ast.FunctionDef, rows: set[str]) -> list[ast.Call]:
    """Every `.tolist()` in `fn_def` of a tensor whose length depends on the data: `rows` (names bound by
    `torch.where` / `nonzero`, or to a `bincount`) or a `bincount(...)` itself, through view-like methods."""
    found = []
    for node in walk_function(fn_def):
        if call_name(node) != "tolist" or not isinstance(node.func, ast.Attribute) or node.args:
            continue
        receiver = strip_methods(node.func.value, _VIEWS)
        if (isinstance(receiver, ast.Name) and receiver.id in rows) or call_name(receiver) == "bincount":
            found.append(node)
    return found


def data_length_names(fn_def: ast.FunctionDef, selected: set[str]) -> set[str]:
    """`selected` (names bound by torch.where / nonzero) and names bound to a `bincount(...)`."""
    names = set(selected)
    for node in walk_function(fn_def):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if call_name(node.value) == "bincount":
                names.add(node.targets[0].id)
    return names


def list_indices(loop: ast.For, rows: set[str], fn_def: ast.FunctionDef) -> list[ListIndex]:
    """The `name = r.tolist()` bindings in `loop`'s body (r one of the selected `rows`; also as pairs,
    `a, b = r.tolist(), s.tolist()`) whose name is bound once in the whole function and read only as an
    index element of a subscript in the body, where r is bound once in the body and never changed in
    place: every read of the list then reads r's values, as the rewrite does."""
    statements = [s for s in ast.walk(loop) if isinstance(s, ast.Assign)]
    everywhere = bindings(fn_def)
    steady = {r for r in rows if _bound_once_in(loop, r)}  # a list named now reads r's values where it is read
    found = []
    for stmt in statements:
        listed = [(name, value.func.value.id) for name, value in _pairs(stmt)
                  if call_name(value) == "tolist" and isinstance(value.func, ast.Attribute) and not value.args
                  and isinstance(value.func.value, ast.Name) and value.func.value.id in rows]
        taken = [(name, source) for name, source in listed if source in steady and len(everywhere.get(name, [])) == 1
                 and all(_as_index(use) for use in _loads_of(fn_def, name))]
        if taken == listed:  # a statement is dropped whole, or left whole (its lists then stay, named)
            found.extend(ListIndex(stmt.lineno, name, source) for name, source in taken)
    for call in ast.walk(loop):  # `w[r.tolist(), s.tolist(), None]`: the lists read in place as indices
        if (call_name(call) == "tolist" and isinstance(call.func, ast.Attribute) and not call.args
                and isinstance(call.func.value, ast.Name) and call.func.value.id in rows and _as_index(call)):
            where = span(call)
            found.append(ListIndex(call.lineno, "", call.func.value.id, where))
    return found


def _bound_once_in(loop: ast.For, name: str) -> bool:
    """`name` is bound once in the loop (by its target or one statement of the body; `name =
    name.to(...)` keeps its values) and no statement changes it in place."""
    binding = [n for stmt in loop.body for n in ast.walk(stmt) if isinstance(n, ast.Name) and n.id == name
               and isinstance(n.ctx, ast.Store) and not moves_itself(stmt)]
    binding += [n for n in ast.walk(loop.target) if isinstance(n, ast.Name) and n.id == name]
    return len(binding) == 1 and not any(changes_in_place(n, name) for stmt in loop.body for n in ast.walk(stmt))


def _pairs(stmt: ast.Assign) -> list[tuple[str, ast.expr]]:
    """(name, value) for `name = value` and for `a, b = x, y`."""
    if len(stmt.targets) != 1:
        return []
    target, value = stmt.targets[0], stmt.value
    if isinstance(target, ast.Name):
        return [(target.id, value)]
    if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
        return [(t.id, v) for t, v in zip(target.elts, value.elts, strict=True) if isinstance(t, ast.Name)]
    return []


def _loads_of(tree: ast.AST, name: str) -> list[ast.Name]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)]


def _as_index(use: ast.Name) -> bool:
    """`use` is a subscript's index, or one element of a tuple of indices."""
    parent = getattr(use, "_moe_parent", None)
    if isinstance(parent, ast.Tuple):
        parent = getattr(parent, "_moe_parent", None) if parent.elts and use in parent.elts else None
        return isinstance(parent, ast.Subscript) and isinstance(parent.slice, ast.Tuple)
    return isinstance(parent, ast.Subscript) and parent.slice is use


def link_parents(tree: ast.AST) -> None:
    """Give each node of `tree` a `_moe_parent` attribute (for `_as_index`)."""
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            child._moe_parent = node


def check_length_reads(fn_def: ast.FunctionDef, rows: set[str], handled: set[int]) -> None:
    """Raise NotAdaptable naming the first list of data-dependent length not in `handled` (call ids)."""
    for call in length_reads(fn_def, rows):
        if id(call) not in handled:
            code = ast.unparse(call)[:60]
            raise NotAdaptable(
                f"line {call.lineno}: `{code}` makes a list of data-dependent length; with the loop's "
                "data-dependent shapes captured dynamo could not trace it, so the method is left as written"
            )


def splits_by_host_sizes(fn_def: ast.FunctionDef, assignments: dict) -> bool:
    """`fn_def` splits a tensor at sizes read on the host from a tensor (`torch.split(x, c.tolist())`,
    `x.split(sizes)` with `sizes = c.tolist()`, `split_with_sizes`), the sizes passed positionally or as
    `split_size_or_sections` / `split_sizes`, and a loop over experts reads the pieces: it iterates over
    them (or indexes them with its index) and its index picks one of the module's own parts
    (`self.experts[e]`, `self.gate_proj[e]`). Other splits at host sizes (audio and vision encoders cutting
    a batch into its items) are left as written."""
    splits = [node for node in walk_function(fn_def) if _split_at_host_sizes(node, assignments)]
    pieces = {target.id for node in walk_function(fn_def) if isinstance(node, ast.Assign)
              for target in node.targets if isinstance(target, ast.Name) and _unwrapped(node.value) in splits}
    parts = function_parameters(fn_def)
    for loop in walk_function(fn_def):
        index = loop_index(loop) if isinstance(loop, ast.For) else None
        if index is None or not _indexes_own_parts(loop, index, parts):
            continue
        iterated = _unwrapped(loop.iter.args[0] if call_name(loop.iter) == "enumerate" and loop.iter.args else loop.iter)
        if iterated in splits or (isinstance(iterated, ast.Name) and iterated.id in pieces):
            return True
        if any(isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id in pieces
               and isinstance(n.slice, ast.Name) and n.slice.id == index for stmt in loop.body for n in ast.walk(stmt)):
            return True
    return False


def _split_at_host_sizes(node: ast.AST, assignments: dict) -> bool:
    return call_name(node) in ("split", "split_with_sizes") and any(
        _host_list(size, assignments) for size in _split_sizes_arguments(node))


def _split_sizes_arguments(split: ast.Call) -> list[ast.expr]:
    """The sizes argument of `torch.split(x, sizes)` / `x.split(sizes)`, positional or by keyword."""
    is_function = isinstance(split.func, ast.Attribute) and isinstance(split.func.value, ast.Name) and (
        split.func.value.id == "torch")
    positional = split.args[1:2] if is_function else split.args[:1]
    keywords = [k.value for k in split.keywords if k.arg in ("split_size_or_sections", "split_sizes", "split_size")]
    return [*positional, *keywords]


def _unwrapped(expr: ast.AST) -> ast.AST:
    """E for `list(E)` / `tuple(E)`."""
    while call_name(expr) in ("list", "tuple") and isinstance(expr.func, ast.Name) and len(expr.args) == 1:
        expr = expr.args[0]
    return expr


def _indexes_own_parts(loop: ast.For, index: str, parameters: frozenset[str] = frozenset()) -> bool:
    """The loop's body subscripts an attribute of `self` with the index alone (`self.experts[e]`,
    `self.experts[e].w1`, `self.down_proj[e]`), or one of `parameters` (a module function's stacked
    expert weights, torchtitan's `w1[expert_idx]`)."""
    return any(isinstance(n, ast.Subscript) and (_owned(n.value) or (isinstance(n.value, ast.Name) and n.value.id in parameters))
               and isinstance(n.slice, ast.Name) and n.slice.id == index for stmt in loop.body for n in ast.walk(stmt))


def function_parameters(fn_def: ast.FunctionDef) -> frozenset[str]:
    """The parameters of a module function (empty for a method, whose parts hang off `self`)."""
    names = [a.arg for a in (*fn_def.args.posonlyargs, *fn_def.args.args, *fn_def.args.kwonlyargs)]
    return frozenset() if names[:1] in (["self"], ["cls"]) else frozenset(names)


def split_sizes_of_parameters(fn_def: ast.FunctionDef, assignments: dict) -> tuple[str, ...]:
    """The parameters of a module function whose `.tolist()` gives the sizes it splits at. Their length is
    known only when the function is traced: a count of fixed length (torchtitan's histogram) can be read
    as numbers, one of data-dependent length (a bincount) cannot."""
    parameters = function_parameters(fn_def)
    found = []
    for node in walk_function(fn_def):
        if _split_at_host_sizes(node, assignments):
            for name in sorted(_host_list_receivers(node, assignments) & parameters):
                if assignments.get(name):  # `counts = counts[counts > 0]`: the entry's length says nothing
                    raise NotAdaptable(f"line {node.lineno}: the split sizes are read from {name}, a parameter "
                                       "bound again in the body, whose length is not known when traced")
                found.append(name)
    return tuple(dict.fromkeys(found))


def _host_list_receivers(split: ast.Call, assignments: dict) -> set[str]:
    """The names `t` whose `t.tolist()` (directly or through a name bound to it) sizes `split`."""
    found, stack = set(), [*split.args, *(k.value for k in split.keywords)]
    while stack:
        expr = stack.pop()
        if isinstance(expr, ast.Name):
            stack.extend(b.value for b in assignments.get(expr.id, []) if isinstance(b, ast.Assign))
        elif call_name(expr) == "tolist" and isinstance(expr.func, ast.Attribute):
            receiver = strip_methods(expr.func.value, _VIEWS)
            if isinstance(receiver, ast.Name):
                found.add(receiver.id)
    return found


def _owned(expr: ast.AST) -> bool:
    """`self.a` or `self.a.b...`."""
    while isinstance(expr, ast.Attribute):
        expr = expr.value
        if isinstance(expr, ast.Name) and expr.id == "self":
            return True
    return False


def _host_list(expr: ast.AST, assignments: dict, seen: frozenset[str] = frozenset()) -> bool:
    """`t.tolist()` (through view-like methods on t), or a name whose every binding is one."""
    if isinstance(expr, ast.Name):
        bound = assignments.get(expr.id, [])
        if expr.id in seen or not bound or not all(isinstance(b, ast.Assign) and len(b.targets) == 1 for b in bound):
            return False
        return all(_host_list(b.value, assignments, seen | {expr.id}) for b in bound)
    return call_name(expr) == "tolist" and isinstance(expr.func, ast.Attribute) and not expr.args


def _size_read(expr: ast.AST) -> tuple[str, bool] | None:
    """(A, counts elements) for `A.numel()` (True), `len(A)`, `A.shape[0]`, `A.size(0)` (False)."""
    if isinstance(expr, ast.Call) and not expr.keywords:
        name = call_name(expr)
        if name == "numel" and isinstance(expr.func, ast.Attribute) and not expr.args:
            base = expr.func.value
            return (base.id, True) if isinstance(base, ast.Name) else None
        if name == "len" and isinstance(expr.func, ast.Name) and len(expr.args) == 1 and isinstance(expr.args[0], ast.Name):
            return expr.args[0].id, False
        if name == "size" and isinstance(expr.func, ast.Attribute) and isinstance(expr.func.value, ast.Name):
            if len(expr.args) == 1 and isinstance(expr.args[0], ast.Constant) and expr.args[0].value == 0:
                return expr.func.value.id, False
    if (isinstance(expr, ast.Subscript) and isinstance(expr.slice, ast.Constant) and expr.slice.value == 0
            and isinstance(expr.value, ast.Attribute) and expr.value.attr == "shape"
            and isinstance(expr.value.value, ast.Name)):
        return expr.value.value.id, False
    return None


def capacity_cut(expr: ast.AST) -> tuple[str, ast.expr, bool] | None:
    """(A, c, counts elements) when `expr` is `A[:c] if <size of A> > c else A` (or `c < <size>`)."""
    if not isinstance(expr, ast.IfExp) or not isinstance(expr.orelse, ast.Name):
        return None
    body, test, rows = expr.body, expr.test, expr.orelse.id
    if not (isinstance(body, ast.Subscript) and isinstance(body.value, ast.Name) and body.value.id == rows
            and isinstance(body.slice, ast.Slice) and body.slice.lower is None and body.slice.step is None
            and body.slice.upper is not None):
        return None
    if not isinstance(test, ast.Compare) or len(test.ops) != 1:
        return None
    if isinstance(test.ops[0], ast.Gt):
        size, bound = test.left, test.comparators[0]
    elif isinstance(test.ops[0], ast.Lt):
        size, bound = test.comparators[0], test.left
    else:
        return None
    read = _size_read(size)
    if read is None or read[0] != rows or ast.dump(bound) != ast.dump(body.slice.upper):
        return None
    return rows, body.slice.upper, read[1]


class CutToCapacity(ast.NodeTransformer):
    """`A[:c] if A.numel() > c else A` -> `cut(A, c)`, where `cut` is `cut_to_capacity` (for numel,
    `cut(A, c) if A.dim() == 1 else <as written>`)."""

    def __init__(self, cut: str):
        self.cut = ast.parse(cut, mode="eval").body

    def visit_IfExp(self, node: ast.IfExp):
        node = self.generic_visit(node)
        found = capacity_cut(node)
        if found is None:
            return node
        rows, capacity, counts_elements = found
        cut = ast.copy_location(ast.Call(self.cut, [ast.Name(rows, ast.Load()), capacity], []), node.body)
        if not counts_elements:
            return cut
        one_dim = ast.Compare(
            ast.Call(ast.Attribute(ast.Name(rows, ast.Load()), "dim", ast.Load()), [], []), [ast.Eq()],
            [ast.Constant(1)])
        return ast.copy_location(ast.IfExp(one_dim, cut, node), node)


def cut_to_capacity(rows, capacity):
    """`rows[:capacity]`, where `rows.numel() > capacity` (the cut is written `R[:c] if R.numel() > c else
    R`). For a count (an int >= 0) it is spelled `narrow(0, 0, min(len, capacity))`:
    the same rows, and a length dynamo before torch 2.11 can trace when `rows` has a data-dependent
    length (slicing there guards on which of the two is smaller, and raises)."""
    # a Python int only (`>= 0` of a SymInt could guard on an unbacked one), a tensor only (`len(rows)` may
    # measure a list)
    if isinstance(rows, torch.Tensor) and type(capacity) is int and capacity >= 0:
        return rows.narrow(0, 0, torch.sym_min(rows.shape[0], capacity))
    if isinstance(rows, torch.Tensor) and type(capacity) is float:  # `T * k / E * factor`
        # the original slices only where the rows pass the capacity, and slicing with a float raises there
        torch._check(rows.shape[0] <= capacity, lambda: f"slice indices must be integers (capacity {capacity})")
        return rows
    return rows[:capacity]


class NewTensorOfList(ast.NodeTransformer):
    """`X.new_tensor(<list or tuple display, or comprehension>)` -> `make(X, <list>)`, where `make` is
    `tensor_like` (no other arguments: dtype, device and grad flag are X's defaults)."""

    def __init__(self, make: str):
        self.make = ast.parse(make, mode="eval").body

    def visit_Call(self, node: ast.Call):
        node = self.generic_visit(node)
        if not (call_name(node) == "new_tensor" and isinstance(node.func, ast.Attribute) and len(node.args) == 1
                and not node.keywords and isinstance(node.args[0], ast.List | ast.Tuple | ast.ListComp)):
            return node
        return ast.copy_location(ast.Call(self.make, [node.func.value, node.args[0]], []), node)


def tensor_like(like, data):
    """`like.new_tensor(data)`, spelled `torch.tensor(data, dtype=like.dtype, device=like.device)` for a
    tensor (the same tensor; the spelling dynamo before torch 2.11 traces with data-dependent sizes)."""
    if isinstance(like, torch.Tensor):
        return torch.tensor(data, dtype=like.dtype, device=like.device)
    return like.new_tensor(data)


def true_counts(fn_def: ast.FunctionDef, assignments: dict) -> frozenset[str]:
    """Names bound once to a count of true elements read on the host: `(a < b).sum().item()` or
    `int((a < b).sum())`, the operand boolean by construction (comparisons, `&`, `|`, `^`, `~`, `.bool()`)."""
    found = set()
    for name, bound in assignments.items():
        if len(bound) != 1 or not isinstance(bound[0], ast.Assign) or len(bound[0].targets) != 1:
            continue
        if isinstance(bound[0].targets[0], ast.Name) and _counts_true(bound[0].value) and _bound_once(fn_def, name):
            found.add(name)
    return frozenset(found)


def _bound_once(fn_def: ast.FunctionDef, name: str) -> bool:
    """`name` has one binding in the function, nested scopes included: no parameter, comprehension or
    loop variable, import, `except ... as`, `global`/`nonlocal` or `del` of that name besides it."""
    stores = 0
    for node in ast.walk(fn_def):
        if isinstance(node, ast.Name) and node.id == name and not isinstance(node.ctx, ast.Load):
            stores += 1
        elif isinstance(node, ast.arg) and node.arg == name:
            return False
        elif isinstance(node, ast.Global | ast.Nonlocal) and name in node.names:
            return False
        elif isinstance(node, ast.alias) and (node.asname or node.name.split(".")[0]) == name:
            return False
        elif isinstance(node, ast.ExceptHandler | ast.MatchAs | ast.MatchStar) and node.name == name:
            return False
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node is not fn_def and (
                node.name == name):
            return False
    return stores == 1


def _counts_true(expr: ast.AST) -> bool:
    total = number_read(expr)
    if total is None or call_name(total) != "sum" or not isinstance(total.func, ast.Attribute) or total.args or total.keywords:
        return False
    return boolean_by_construction(total.func.value)


class CutToCount(ast.NodeTransformer):
    """`X[:n]`, n one of `counts` (`true_counts`) or `sum(L)`, L one of `sizes` (`split_size_lists`) ->
    `cut(X, n)`, where `cut` is `cut_to_count`."""

    def __init__(self, cut: str, counts: frozenset[str], sizes: frozenset[str] = frozenset()):
        self.cut, self.counts, self.sizes = ast.parse(cut, mode="eval").body, counts, sizes

    def visit_Subscript(self, node: ast.Subscript):
        node = self.generic_visit(node)
        bounds = node.slice
        if not (isinstance(node.ctx, ast.Load) and isinstance(bounds, ast.Slice) and bounds.lower is None
                and bounds.step is None and self._at_least_zero(bounds.upper)):
            return node
        return ast.copy_location(ast.Call(self.cut, [node.value, bounds.upper], []), node)

    def _at_least_zero(self, bound: ast.expr | None) -> bool:
        if isinstance(bound, ast.Name):
            return bound.id in self.counts
        return (call_name(bound) == "sum" and isinstance(bound.func, ast.Name) and len(bound.args) == 1
                and not bound.keywords and isinstance(bound.args[0], ast.Name) and bound.args[0].id in self.sizes)


def split_size_lists(fn_def: ast.FunctionDef, assignments: dict) -> frozenset[str]:
    """Names bound once to `t.tolist()` that size a split later in the same block, surely reached: no
    `return`, `raise`, `yield`, `break` or `continue` between, the split under no conditional expression,
    nothing in a `try`. `split` raises on a negative size, so a run that gets past the read and completes
    has every size >= 0; stating it at the read (`sizes_at_least_zero`) changes no such run, and tells
    dynamo before torch 2.11 the sign it otherwise guards on (`x[: sum(sizes)]`: torchtitan's grouped
    experts)."""
    found = set()
    for name, bound in assignments.items():
        if len(bound) != 1 or not _host_read(bound[0]) or not _bound_once(fn_def, name):
            continue
        if not _only_read_whole(fn_def, name):  # `sizes[-1] = rest`: the numbers change after the read
            continue
        block = _block_of(bound[0])
        if block is None:
            continue
        for stmt in block[block.index(bound[0]) + 1:]:
            if _sized_by(stmt, name, assignments):
                found.add(name)
                break
            if any(isinstance(n, ast.Return | ast.Raise | ast.Yield | ast.YieldFrom | ast.Break | ast.Continue)
                   for n in ast.walk(stmt)):
                break
    return frozenset(found)


def _only_read_whole(fn_def: ast.FunctionDef, name: str) -> bool:
    """Every load of `name` is an argument of `split`/`split_with_sizes`/`sum`/`len` (or of `list`/`tuple`
    within one): never indexed, stored into, mutated by a method or handed to other code."""
    for node in walk_function(fn_def):
        if not (isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Load)):
            continue
        parent = getattr(node, "_moe_parent", None)
        while call_name(parent) in ("list", "tuple") and isinstance(parent.func, ast.Name):
            parent = getattr(parent, "_moe_parent", None)
        if isinstance(parent, ast.keyword):
            parent = getattr(parent, "_moe_parent", None)
        if call_name(parent) not in ("split", "split_with_sizes", "sum", "len") or not isinstance(parent, ast.Call):
            return False
        if isinstance(parent.func, ast.Attribute) and parent.func.value is node:
            return False  # `sizes.split(...)` is no tensor split
    return True


def _host_read(stmt: ast.AST) -> bool:
    return (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
            and call_name(stmt.value) == "tolist" and isinstance(stmt.value.func, ast.Attribute)
            and not stmt.value.args and not stmt.value.keywords)


def _block_of(stmt: ast.stmt) -> list[ast.stmt] | None:
    """The statement list holding `stmt` (needs `link_parents`); None inside a `try`."""
    parent = getattr(stmt, "_moe_parent", None)
    node = parent
    while node is not None:
        if isinstance(node, ast.Try | ast.TryStar):
            return None
        node = getattr(node, "_moe_parent", None)
    for field in ("body", "orelse", "finalbody"):
        block = getattr(parent, field, None)
        if isinstance(block, list) and any(item is stmt for item in block):
            return block
    return None


def _sized_by(stmt: ast.stmt, name: str, assignments: dict) -> bool:
    """`stmt` is an expression or assignment whose evaluation always calls a split sized by `name`."""
    if not isinstance(stmt, ast.Assign | ast.Expr | ast.AnnAssign):
        return False
    conditional = (ast.IfExp, ast.BoolOp, ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
    stack = [stmt.value]
    while stack:
        node = stack.pop()
        if isinstance(node, conditional):
            continue
        if _split_at_host_sizes(node, assignments) and any(
                isinstance(_unwrapped(size), ast.Name) and _unwrapped(size).id == name
                for size in _split_sizes_arguments(node)):
            return True
        stack.extend(ast.iter_child_nodes(node))
    return False


def sizes_at_least_zero(sizes):
    """`sizes` (a list read on the host that sizes a split: `split_size_lists`), each stated >= 0."""
    if not isinstance(sizes, list):  # a 0-d tensor's number: split's size, checked by split itself
        return sizes
    for size in sizes:
        if isinstance(size, (int, torch.SymInt)):  # a tuple: dynamo before 2.11 cannot read `X | Y`
            torch._check(size >= 0)
    return sizes


class StateSizes(ast.NodeTransformer):
    """`L = t.tolist()`, L one of `sizes` (`split_size_lists`) -> `L = state(t.tolist())`."""

    def __init__(self, state: str, sizes: frozenset[str]):
        self.state, self.sizes = ast.parse(state, mode="eval").body, sizes

    def visit_Assign(self, node: ast.Assign):
        if _host_read(node) and node.targets[0].id in self.sizes:
            node.value = ast.copy_location(ast.Call(self.state, [node.value], []), node.value)
        return node


def cut_to_count(rows, count):
    """`rows[:count]` for a count of true elements (>= 0 by construction), spelled `narrow(0, 0,
    min(len, count))` for a tensor: the same rows, and a cut dynamo before torch 2.11 can trace at an
    unbacked count once `count >= 0` is stated."""
    if isinstance(rows, torch.Tensor) and rows.dim() >= 1 and isinstance(count, (int, torch.SymInt)):
        torch._check(count >= 0)
        return rows.narrow(0, 0, torch.sym_min(rows.shape[0], count))
    return rows[:count]


def capacity_cuts(tree: ast.AST) -> tuple[int, ...]:
    """Lines of the capacity cuts in `tree` (`CutToCapacity` rewrites them; exact wherever they are)."""
    return tuple(sorted({node.lineno for node in ast.walk(tree) if capacity_cut(node) is not None}))


class ReplaceListIndices(ast.NodeTransformer):
    """Drops each `name = rows.tolist()` of `found` and indexes with `rows` where `name` was read."""

    def __init__(self, found: list[ListIndex]):
        self.rows = {item.name: item.rows for item in found if item.at is None}
        self.inline = {item.at: item.rows for item in found if item.at is not None}

    def visit_Call(self, node: ast.Call):
        rows = self.inline.get(span(node))
        if rows is not None:
            return ast.copy_location(ast.Name(rows, ast.Load()), node)
        return self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign):
        pairs = _pairs(node)
        if pairs and all(name in self.rows for name, _ in pairs):
            return ast.copy_location(ast.Pass(), node)
        return self.generic_visit(node)

    def visit_Name(self, node: ast.Name):
        if isinstance(node.ctx, ast.Load) and node.id in self.rows:
            return ast.copy_location(ast.Name(self.rows[node.id], ast.Load()), node)
        return node



# ---------------------------------------------------------------------------------------------------
# Loops over the pieces of rows split at host counts, zipped with the experts (Snowflake Arctic)
#
#     expert_idx, token_idx, slot_idx = torch.where(chosen == torch.arange(E).view(E, 1, 1))
#     counts = torch.bincount(expert_idx, minlength=E).tolist()
#     for expert, rows, slots in zip(self.experts, token_idx.split(counts), slot_idx.split(counts)):
#         if rows.shape[0] == 0:
#             continue
#         ...
#         out.index_add_(0, rows, y)


@dataclasses.dataclass(frozen=True)
class SplitPieces:
    """A `for ... in zip(self.<experts>, A.split(sizes), ...)` loop: its piece names -> the sizes' source."""

    line: int
    pieces: dict


def split_pieces(loop: ast.For, assignments: dict) -> SplitPieces | None:
    """The loop as SplitPieces when it zips one of the module's own expert containers with pieces of
    tensors split at sizes read on the host (directly, or names bound once to such splits); else None."""
    if call_name(loop.iter) != "zip" or not isinstance(loop.iter.func, ast.Name) or not isinstance(loop.target, ast.Tuple):
        return None
    if len(loop.target.elts) != len(loop.iter.args) or not all(isinstance(t, ast.Name) for t in loop.target.elts):
        return None
    pieces, owned = {}, False
    for target, source in zip(loop.target.elts, loop.iter.args, strict=True):
        split = _split_source(source, assignments, loop.lineno)
        if split is not None:
            pieces[target.id] = split
        owned |= _owned(source)
    return SplitPieces(loop.lineno, pieces) if pieces and owned else None


def _split_source(expr: ast.AST, assignments: dict, line: int) -> str | None:
    """The sizes' source (`counts` of `counts.tolist()`, unparsed) of a split at host sizes, through the
    name's last binding before `line` (`token_idx = token_idx.split(counts)`), when no binding follows it
    up to the loop; None for anything else."""
    if isinstance(expr, ast.Name):
        bound = sorted((b for b in assignments.get(expr.id, []) if b.lineno < line), key=lambda b: b.lineno)
        later = [b for b in assignments.get(expr.id, []) if b.lineno >= line]
        if not bound or later or not isinstance(bound[-1], ast.Assign) or len(bound[-1].targets) != 1:
            return None
        expr = bound[-1].value
    if not _split_at_host_sizes(expr, assignments):
        return None
    is_function = isinstance(expr.func.value, ast.Name) and expr.func.value.id == "torch"
    sizes = (expr.args[1:2] if is_function else expr.args[:1]) or [k.value for k in expr.keywords]
    return ast.unparse(sizes[0])


__all__ = ["CutToCapacity", "cut_to_capacity", "CutToCount", "cut_to_count", "StateSizes", "sizes_at_least_zero", "split_size_lists", "true_counts", "NewTensorOfList", "tensor_like", "ListIndex", "ReplaceListIndices", "capacity_cuts", "check_length_reads", "data_length_names", "length_reads",
           "link_parents", "list_indices", "splits_by_host_sizes", "split_sizes_of_parameters", "NotAdaptable", "SplitPieces", "split_pieces"]
