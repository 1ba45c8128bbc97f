"""Loops over the expert ids present in the routing (`for e in ids.unique().tolist():`).

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

from .source_ast import NotAdaptable, call_name, strip_methods

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
