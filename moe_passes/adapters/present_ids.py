"""Loops over the expert ids present in the routing (`for e in ids.unique().tolist():`), and over the runs
of sorted ids with their counts (`zip(*torch.unique_consecutive(ids, return_counts=True))`, below).

    for e in ids.unique().tolist():            # or torch.unique(ids), sorted(set(ids.flatten().tolist())), ...
        token, slot = torch.where(ids == e)
        out.index_add_(0, token, self.experts[e](x[token]) * w[token, slot, None])

The sequence has a data-dependent length, so dynamo cannot unroll the loop in one graph. The traced copy
runs the loop over every expert instead, `range(len(self.experts))`, in the same (ascending) order.

Why that is the same computation (checked on the source, else the loop is left as written and the
reason logged): the body's only effect is one accumulation at the rows `torch.where(ids == e)` (the
expert-loop adapter's proof), so an expert absent from `ids` adds nothing; the loop variable is read only
in `ids == e` and as the index of the one container of experts, where a Python int and the 0-dim tensor
`torch.unique` yields behave alike (any other test of it, `e == n_routed`, could single out an id no
expert holds), and not after the loop; `unique` sorts by default, as `range` counts. An id outside 0..len-1, which made the original
raise on `self.experts[e]` (or pick an expert from the end for a negative id), makes the copy raise at
run time (`present_experts`) rather than skip it.

Also taken (LLMs-from-scratch): the unique ids bound to a name only the loop reads (`u = torch.unique(ids)`,
by the statement right before the loop, so nothing changes ids in between; the copy drops the binding), the id read
first as a number (`e = int(t.item())`: the copy loops over `e`, the same ints), several parallel
containers indexed with it (`self.fc1[e]`, `self.fc2[e]`: the copy runs over the shortest, and an id past
it raises as above), and rows that are the non-zero entries of `(ids == e).any(dim)` (empty for an absent
id as `torch.where(ids == e)` is), with `if not (ids == e).any(): continue` (never true for an id present).
"""

from __future__ import annotations

import ast
import dataclasses

import torch

from .source_ast import NotAdaptable, call_name, in_place_name, loads, placed, strip_methods

# Methods that keep the values of the ids (flattening, host copies) before or after `unique`
_KEEPS_VALUES = {"flatten", "view", "reshape", "contiguous", "cpu", "tolist", "long", "int"}


@dataclasses.dataclass(frozen=True)
class PresentLoop:
    line: int  # the `for` statement
    var: str  # the name the body reads the id under: the loop variable, or its alias
    ids: str  # the name whose unique values the loop visits
    containers: tuple[str, ...]  # the containers the id indexes (`self.experts`, or parallel lists), as written
    alias: str | None = None  # `e = int(t.item())`, the body's first statement: the copy loops over `e` itself
    bound_at: int | None = None  # the line of `u = torch.unique(ids)` where the loop iterates `u`


def present_sequence(loop: ast.For, assignments: dict, fn_def: ast.FunctionDef) -> tuple[str, int | None] | None:
    """(ids, line) when `loop` iterates the unique values of ids (`present_ids`), written in the `for` (line
    None) or bound once, by the statement right before the loop, to a name the loop alone reads
    (`u = torch.unique(ids)`, line of that binding); else None."""
    ids = present_ids(loop.iter)
    if ids is not None or not isinstance(loop.iter, ast.Name):
        return (ids, None) if ids is not None else None
    bound = assignments.get(loop.iter.id, [])
    if len(bound) != 1 or not isinstance(bound[0], ast.Assign) or len(bound[0].targets) != 1:
        return None
    ids = present_ids(bound[0].value)
    reads = [n for n in ast.walk(fn_def) if isinstance(n, ast.Name) and n.id == loop.iter.id and isinstance(n.ctx, ast.Load)]
    if ids is None or reads != [loop.iter]:
        return None
    if not _just_before(bound[0], loop, fn_def):
        return None  # ids could change between the two (through a view, `out=`, an enclosing loop's turn)
    return ids, bound[0].lineno


def _just_before(binding: ast.stmt, loop: ast.For, fn_def: ast.FunctionDef) -> bool:
    """`binding` is the statement right before `loop` in the same block."""
    for node in ast.walk(fn_def):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if isinstance(block, list) and loop in block:
                at = block.index(loop)
                return at > 0 and block[at - 1] is binding
    return False


def present_ids(sequence: ast.AST) -> str | None:
    """N when `sequence` is the sorted unique values of a name N (`N.unique()`, `torch.unique(N)`,
    `sorted(set(N.tolist()))`, through flattening views, casts and `.tolist()`); else None. `unique` with
    other arguments (`sorted=False`, `return_counts`, `dim`) and an unsorted `set` are not taken."""
    if _builtin_call(sequence, "sorted"):
        sequence = sequence.args[0]
        if _builtin_call(sequence, "set"):  # sorted(set(values.tolist())): the distinct numbers, ascending
            listed = sequence.args[0]  # (a set of 0-dim tensors keeps every element: they hash by identity)
            if call_name(listed) != "tolist" or not isinstance(listed.func, ast.Attribute):
                return None
            values = strip_methods(listed, _KEEPS_VALUES)
            return values.id if isinstance(values, ast.Name) else None
    unique = strip_methods(sequence, _KEEPS_VALUES)
    if call_name(unique) != "unique" or not isinstance(unique.func, ast.Attribute):
        return None
    if any(not (k.arg == "sorted" and isinstance(k.value, ast.Constant) and k.value.value is True) for k in unique.keywords):
        return None
    base = unique.func.value
    if isinstance(base, ast.Name) and base.id == "torch":
        if len(unique.args) != 1:
            return None
        base = unique.args[0]
    elif unique.args:
        return None
    base = strip_methods(base, _KEEPS_VALUES)
    return base.id if isinstance(base, ast.Name) else None


def _builtin_call(expr: ast.AST, name: str) -> bool:
    """`name(one_argument)`, no keywords (`sorted(x)`, not `sorted(x, reverse=True)`)."""
    return (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == name
            and len(expr.args) == 1 and not expr.keywords)


def present_loop(loop: ast.For, ids: str, alias: str | None = None, bound_at: int | None = None) -> PresentLoop:
    """The loop over the values of `ids` read as a loop over every expert, else NotAdaptable naming why.
    The body's proof (one accumulation at rows where `ids == var`) is the expert-loop adapter's. With
    `alias`, the body's first statement reads the id as a number under that name, and the rest of the body
    reads it so."""
    if not isinstance(loop.target, ast.Name) or loop.orelse:
        raise NotAdaptable(f"line {loop.lineno}: the loop over the ids present has a target other than one name, "
                           "or an else")
    var = alias if alias is not None else loop.target.id
    body = loop.body[1:] if alias is not None else loop.body
    if alias is not None and any(isinstance(n, ast.Name) and n.id == loop.target.id for s in body for n in ast.walk(s)):
        raise NotAdaptable(f"line {loop.lineno}: the loop variable {loop.target.id} is read beside its alias {alias}")
    parents = {child: node for node in ast.walk(loop) for child in ast.iter_child_nodes(node)}
    containers = set()
    for node in (n for stmt in body for n in ast.walk(stmt)):
        if not (isinstance(node, ast.Name) and node.id == var and isinstance(node.ctx, ast.Load)):
            continue
        parent = parents[node]
        if isinstance(parent, ast.Subscript) and parent.slice is node and isinstance(parent.value, ast.Attribute):
            containers.add(ast.unparse(parent.value))
        elif not _compared_with(parent, ids):
            raise NotAdaptable(f"line {node.lineno}: the id {var} is used other than in `{ids} == {var}` or "
                               "indexing the experts (a test of it, `e == n_routed`, may single out ids no "
                               "expert holds; `unique` yields it as a tensor or an int, `range` as an int)")
    if not containers:
        raise NotAdaptable(f"line {loop.lineno}: the loop over the ids present indexes no container of experts "
                           f"with {var}")
    return PresentLoop(loop.lineno, var, ids, tuple(sorted(containers)), alias, bound_at)


def _compared_with(node: ast.AST, ids: str) -> bool:
    """`ids == var` or `var == ids` (the selection of the expert's slots)."""
    return (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq)
            and any(isinstance(side, ast.Name) and side.id == ids for side in (node.left, node.comparators[0])))


def present_experts(ids: torch.Tensor, count: int) -> int:
    """`count`, the number of experts the copy loops over, once the ids are checked to lie in 0..count-1
    (at run time: the original raised on an expert index out of range)."""
    torch._assert_async(((ids >= 0) & (ids < count)).all(),
                        "an expert id is negative or past the experts: the loop over the ids present runs over "
                        "experts 0..number - 1 under hpu_moe (the original indexed the experts with the id)")
    return count


def expert_one_hot(ids: torch.Tensor, count: int) -> torch.Tensor:
    """The [N, count] one-hot table of the flat ids (its column sums: each expert's count), once the ids are
    checked to lie in 0..count-1 (`present_experts`)."""
    flat = ids.reshape(-1).long()
    return torch.nn.functional.one_hot(flat, present_experts(flat, count))


# ---------------------------------------------------------------------------------------------------
# Runs of sorted ids with their counts (transformers' first AFMoE)
#
#     order = torch.argsort(ids, stable=True)
#     ids = ids[order]
#     present, counts = torch.unique_consecutive(ids, return_counts=True)
#     start = 0
#     for e, n in zip(present.tolist(), counts.tolist()):
#         end = start + n
#         out[start:end] = self.experts[e](rows[start:end])
#         start = end
#
# becomes `counts = helpers.expert_one_hot(ids, len(self.experts)).sum(0).tolist()` and
# `for e, n in enumerate(counts):` with `if n == 0: continue` first in the body (kept where the loop had
# it). Why that is the same loop: on ids sorted ascending, the runs `unique_consecutive` finds are the
# distinct ids, ascending, each with its total count (as `torch.unique(ids, return_counts=True)` gives
# for ids in any order); the copy visits every expert ascending with its total count and skips the
# experts with none, so the body runs for the same (id, count) pairs in the same order. Taken where the
# sorted ids are flat (`x.reshape(-1)`: a sort of [T, k] ids along a dim orders each token's) and nothing
# between their sort and the runs may change them or the order (`_untouched_between`); the id is read only
# as the index of one container of experts (an id past it raised there, and raises in the count; a
# negative one, which picked an expert from the end, raises); the two sequences are read only by the loop,
# the loop's id and count not after it (there the copy leaves the last expert's, not the last run's), and
# nothing leaves the loop early (`break`: the runs not visited could be ids past the experts). The guard
# may then go as every count loop's does (count_loops.py), or stay with its graph break.

_RUNS = {"unique_consecutive", "unique"}


def counted_runs_as_counts(fn_def: ast.FunctionDef, helpers: str) -> None:
    """Rewrite, in place, each loop of the method's own block over `zip(present, counts)` of the runs of its
    ids into a loop over every expert's count (above); loops not proved so are left alone."""
    block = fn_def.body
    for stmt in list(block):
        runs = _runs_binding(stmt)
        if runs is None:
            continue
        present, counts, ids, consecutive = runs
        loop_at = _loop_over_runs(block, block.index(stmt), present, counts)
        if loop_at is None or (consecutive and not _sorted_before(block, block.index(stmt), ids)):
            continue
        loop = block[loop_at]
        var, count = loop.target.elts[0].id, loop.target.elts[1].id
        container = _only_container(loop, var)
        if container is None or _read_elsewhere(fn_def, (present, counts), loop, stmt) or _leaves_early(loop) or (
                _read_outside(fn_def, (var, count), loop)):
            continue  # after the copy's loop, e and n are the last expert's, not the last run's
        block[block.index(stmt)] = placed(
            f"{counts} = {helpers}.expert_one_hot({ids}, len({container})).sum(0).tolist()", stmt)
        loop.iter = placed(f"enumerate({counts})", loop.iter, expression=True)
        if not _starts_with_zero_skip(loop, count):
            loop.body.insert(0, placed(f"if {count} == 0:\n    continue", loop.body[0]))


def _runs_binding(stmt: ast.stmt) -> tuple[str, str, str, bool] | None:
    """(present, counts, ids, consecutive) for `present, counts = torch.unique_consecutive(ids,
    return_counts=True)` (or `ids.unique_consecutive(...)`, `torch.unique(ids, return_counts=True)`)."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Tuple)
            and len(stmt.targets[0].elts) == 2 and all(isinstance(t, ast.Name) for t in stmt.targets[0].elts)):
        return None
    call = stmt.value
    name = call_name(call)
    if name not in _RUNS or not isinstance(call.func, ast.Attribute):
        return None
    base, args = call.func.value, list(call.args)
    if isinstance(base, ast.Name) and base.id == "torch":
        if len(args) != 1:
            return None
        base = args.pop()
    keywords = {k.arg: k.value for k in call.keywords}
    wanted = {"return_counts": True} | ({"sorted": True} if name == "unique" else {})
    if args or not isinstance(base, ast.Name) or "return_counts" not in keywords or any(
            k not in wanted or not (isinstance(v, ast.Constant) and v.value is wanted[k]) for k, v in keywords.items()):
        return None
    present, counts = (t.id for t in stmt.targets[0].elts)
    return present, counts, base.id, name == "unique_consecutive"


def _loop_over_runs(block: list[ast.stmt], at: int, present: str, counts: str) -> int | None:
    """Where, after `at` in the same block, the first loop `for e, n in zip(present, counts)` stands (either
    sequence maybe through `.tolist()`, `.cpu()`). The counts replace the runs at their own place, so what
    runs in between sees the same ids either way."""
    for index in range(at + 1, len(block)):
        if isinstance(block[index], ast.For) and _zips_runs(block[index], present, counts):
            return index
    return None


def _zips_runs(loop: ast.For, present: str, counts: str) -> bool:
    target = loop.target
    if loop.orelse or not (isinstance(target, ast.Tuple) and len(target.elts) == 2
                           and all(isinstance(t, ast.Name) for t in target.elts)):
        return False
    zipped = loop.iter
    if not (isinstance(zipped, ast.Call) and isinstance(zipped.func, ast.Name) and zipped.func.id == "zip"
            and len(zipped.args) == 2 and all(k.arg == "strict" for k in zipped.keywords)):
        return False
    names = [strip_methods(a, {"tolist", "cpu"}) for a in zipped.args]
    return all(isinstance(n, ast.Name) for n in names) and [n.id for n in names] == [present, counts]


def _sorted_before(block: list[ast.stmt], at: int, ids: str) -> bool:
    """The ids were last bound, in this block before `at`, as `ids = ids[order]` with `order` the ascending
    argsort of the flat ids before (`torch.argsort(ids)`, `ids.argsort()`), or as `ids, _ = torch.sort(ids)`
    of flat ids, and nothing may change the ids or the order in between (`_untouched_between`)."""
    for index in range(at - 1, -1, -1):
        stmt = block[index]
        if ids not in loads(stmt) and ids not in _names_stored(stmt):
            continue
        if _sorts_in_place_of(stmt, ids):
            return _flat_before(block[:index], ids) and _untouched_between(block[index + 1:at], ids, None, None)
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
                and stmt.targets[0].id == ids and isinstance(stmt.value, ast.Subscript)
                and isinstance(stmt.value.value, ast.Name) and stmt.value.value.id == ids
                and isinstance(stmt.value.slice, ast.Name)):
            return False
        order = stmt.value.slice.id
        sorted_at = _argsort_at(block[:index], order, ids)
        return (sorted_at is not None and _flat_before(block[:sorted_at], ids)
                and _untouched_between(block[sorted_at + 1:at], ids, order, stmt))
    return False


def _sorts_in_place_of(stmt: ast.stmt, ids: str) -> bool:
    """`ids, _ = torch.sort(ids)` / `ids.sort()` (ascending)."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Tuple)
            and stmt.targets[0].elts and isinstance(stmt.targets[0].elts[0], ast.Name)
            and stmt.targets[0].elts[0].id == ids):
        return False
    return _ascending_call(stmt.value, "sort", ids)


def _argsort_at(before: list[ast.stmt], order: str, ids: str) -> int | None:
    """Where, among `before`, `order` was last bound, when that is the ascending argsort of `ids` and `ids`
    is not bound after it."""
    for index in range(len(before) - 1, -1, -1):
        stmt = before[index]
        if order in _names_stored(stmt):
            return index if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                             and isinstance(stmt.targets[0], ast.Name)
                             and _ascending_call(stmt.value, "argsort", ids)) else None
        if ids in _names_stored(stmt):
            return None
    return None


_FLATTENING = {"reshape", "view", "flatten", "ravel"}


def _flat_before(before: list[ast.stmt], ids: str) -> bool:
    """The ids were last bound, among `before`, to a flattening of a tensor (`x.reshape(-1)`, `x.view(-1)`,
    `x.flatten()`, `torch.flatten(x)`): 1-D, so that a sort orders all of them."""
    for stmt in reversed(before):
        if ids not in _names_stored(stmt):
            continue
        value = _bound_value(stmt, ids)
        name = call_name(value)
        if name not in _FLATTENING or not isinstance(value.func, ast.Attribute):
            return False
        if name in ("reshape", "view"):
            return (len(value.args) == 1 and not value.keywords and isinstance(value.args[0], ast.UnaryOp)
                    and ast.unparse(value.args[0]) == "-1")
        return not value.keywords and (len(value.args) == 0 or ast.unparse(value.func.value) == "torch")
    return False


def _bound_value(stmt: ast.stmt, name: str) -> ast.AST | None:
    """The value `stmt` binds `name` to: `name = v`, or its place in `a, name = u, v`."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1):
        return None
    target, value = stmt.targets[0], stmt.value
    if isinstance(target, ast.Name):
        return value if target.id == name else None
    if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
        return next((v for t, v in zip(target.elts, value.elts, strict=True)
                     if isinstance(t, ast.Name) and t.id == name), None)
    return None


def _untouched_between(between: list[ast.stmt], ids: str, order: str | None, reindex: ast.stmt | None) -> bool:
    """Nothing in `between` can change the sorted ids or their order: no in-place method (`x.add_()`), no
    `out=`, no store into a subscript or an attribute (through any name: a view of the ids may be anywhere),
    the ids read only by `reindex` (`ids = ids[order]`), the order only as an index (`x[order]`)."""
    for stmt in between:
        nodes = list(ast.walk(stmt))
        if any(_changes_something(node) for node in nodes):
            return False
        if stmt is not reindex and ids in loads(stmt):
            return False
        index_reads = {id(n.slice) for n in nodes if isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Load)}
        if order is not None and any(isinstance(n, ast.Name) and n.id == order and id(n) not in index_reads
                                     for n in nodes):
            return False
    return True


def _changes_something(node: ast.AST) -> bool:
    if isinstance(node, ast.Subscript | ast.Attribute) and isinstance(node.ctx, ast.Store | ast.Del):
        return True
    if not isinstance(node, ast.Call):
        return False
    method = node.func.attr if isinstance(node.func, ast.Attribute) else ""
    return in_place_name(method) or any(k.arg == "out" for k in node.keywords)


def _ascending_call(call: ast.AST, name: str, ids: str) -> bool:
    """`torch.<name>(ids, ...)` or `ids.<name>(...)` without `descending=True` (dim 0 or -1 of 1-D ids)."""
    if call_name(call) != name or not isinstance(call.func, ast.Attribute):
        return False
    base, args = call.func.value, list(call.args)
    if isinstance(base, ast.Name) and base.id == "torch" and args:
        base = args.pop(0)
    if not (isinstance(base, ast.Name) and base.id == ids) or args:
        return False
    keywords = {k.arg: k.value for k in call.keywords}
    descending = keywords.pop("descending", ast.Constant(False))
    keywords.pop("stable", None)
    dim = keywords.pop("dim", ast.Constant(0))
    return (not keywords and isinstance(descending, ast.Constant) and descending.value is False
            and isinstance(dim, ast.Constant) and dim.value in (0, -1))


def _only_container(loop: ast.For, var: str) -> str | None:
    """The one container (`self`, `self.experts`) the loop's id indexes, when the body reads the id only so."""
    parents = {child: node for node in ast.walk(loop) for child in ast.iter_child_nodes(node)}
    containers = set()
    for node in (n for stmt in loop.body for n in ast.walk(stmt)):
        if isinstance(node, ast.Name) and node.id == var:
            parent = parents[node]
            if not (isinstance(node.ctx, ast.Load) and isinstance(parent, ast.Subscript) and parent.slice is node
                    and _attribute_chain_of_self(parent.value)):
                return None
            containers.add(ast.unparse(parent.value))
    return containers.pop() if len(containers) == 1 else None


def _attribute_chain_of_self(node: ast.AST) -> bool:
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name) and node.id == "self"


def _read_elsewhere(fn_def: ast.FunctionDef, names: tuple[str, ...], loop: ast.For, binding: ast.stmt) -> bool:
    """`names` are read or bound anywhere but in the loop's `zip` and their binding."""
    allowed = {id(n) for n in ast.walk(loop.iter)} | {id(n) for n in ast.walk(binding)}
    return any(isinstance(n, ast.Name) and n.id in names and id(n) not in allowed for n in ast.walk(fn_def))


def _leaves_early(loop: ast.For) -> bool:
    """A `break` or `return` in the body: the runs left unvisited could be ids past the experts (an expert
    range), which the copy's count would check."""
    return any(isinstance(n, ast.Break | ast.Return) for stmt in loop.body for n in ast.walk(stmt))


def _read_outside(fn_def: ast.FunctionDef, names: tuple[str, ...], loop: ast.For) -> bool:
    inside = {id(n) for n in ast.walk(loop)}
    return any(isinstance(n, ast.Name) and n.id in names and id(n) not in inside for n in ast.walk(fn_def))


def _starts_with_zero_skip(loop: ast.For, count: str) -> bool:
    """The body begins with `if count == 0: continue`."""
    first = loop.body[0]
    return (isinstance(first, ast.If) and not first.orelse and len(first.body) == 1
            and isinstance(first.body[0], ast.Continue) and isinstance(first.test, ast.Compare)
            and ast.unparse(first.test) == f"{count} == 0")


def _names_stored(stmt: ast.stmt) -> set[str]:
    return {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}

