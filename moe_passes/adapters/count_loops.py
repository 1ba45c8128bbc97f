"""Per-expert counts in the source: where they are read as numbers, and loops that skip empty experts.

    counts = one_hot(ids, E).sum(0)          # or zeros(T, E).scatter_(1, ids, 1).sum(0), histc(ids, E)
    start = 0
    for i, n in enumerate(counts):
        if n == 0:
            continue                         # a data-dependent branch: dynamo breaks the graph here
        end = start + n
        outputs.append(self.experts[i](rows[start:end]))
        start = end
    y = torch.cat(outputs)                   # DeepSeek-V2 (transformers 4.x)

Why the guard can go (checked on the source, else it stays with its graph break): for n == 0 the body
binds `end = start + 0` (the same number), carries `start` unchanged, cuts `rows[start:start]` (no
rows), and appends what the expert makes of no rows: no rows, since an expert maps rows to rows (the
premise under which the hit-loop adapter runs an expert no token chose). Appending no rows changes no
`torch.cat` of the list, and the list is read after the loop only by `cat` and truthiness tests; the one
change is when no slot exists at all (no tokens), where an empty list's `else` value becomes the cat of
empty outputs. Every other name the body binds lives for one iteration.

Cutting rows with tensor bounds reads the counts as Python numbers: the traced copy reads the offsets it
cuts at with `.item()` (older dynamo refuses a slice with tensor bounds), and has dynamo keep them symbolic (`capture_scalar_outputs`) for that compile, as it does wherever per-expert counts are
read as numbers or handed to a submodule that does (`.tolist()` split sizes, Aria's offsets).
"""

from __future__ import annotations

import ast
import dataclasses

from .source_ast import (
    VIEW_METHODS,
    NotAdaptable,
    call_name,
    defining_bindings,
    loads,
    stored_names,
    walk_function,
)

# Per-expert counts of a fixed length (E). `bincount` is not one (its length is data-dependent, which
# `.tolist()` cannot keep symbolic).
_COUNT_CALLS = {"histc"}


def is_count(expr: ast.AST, assignments: dict, seen: frozenset[str] = frozenset()) -> bool:
    """Per-expert counts: `M.sum(0)` (a reduction over the tokens) or `histc(...)`, through
    view-like methods and names whose every binding is such a count (or the name's own `.tolist()`)."""
    while True:
        if isinstance(expr, ast.Name):
            bound = defining_bindings(expr.id, assignments)
            if expr.id in seen or bound is None:
                return False
            return all(
                is_count(b.value, assignments, seen | {expr.id}) or tolist_of(b.value) == expr.id for b in bound
            )
        name = call_name(expr)
        if name in _COUNT_CALLS:
            return _counts_from_zero(expr)
        if name == "sum" and isinstance(expr.func, ast.Attribute) and _reduces_dim_zero(expr):
            return True
        if name in VIEW_METHODS | {"cpu"} and isinstance(expr.func, ast.Attribute):
            expr = expr.func.value
            continue
        return False


def _counts_from_zero(call: ast.Call) -> bool:
    """`histc(ids, bins=E, min=0, max=E - 1)`: one bin per id from 0 (a histogram of values over their
    own range, `min=x.min()`, counts no experts)."""
    low = call.args[2] if len(call.args) > 2 else next((k.value for k in call.keywords if k.arg == "min"), None)
    return isinstance(low, ast.Constant) and low.value == 0


def _reduces_dim_zero(call: ast.Call) -> bool:
    dim = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "dim"), None)
    return isinstance(dim, ast.Constant) and dim.value == 0


def tolist_of(expr: ast.AST) -> str | None:
    """N for a host copy of N's values: `N.tolist()`, `N.numpy()`, `N.cpu().numpy()`, `N.cpu().tolist()`."""
    if call_name(expr) not in ("tolist", "numpy") or not isinstance(expr.func, ast.Attribute) or expr.args:
        return None
    receiver = expr.func.value
    if call_name(receiver) == "cpu" and isinstance(receiver.func, ast.Attribute) and not receiver.args:
        receiver = receiver.func.value
    return receiver.id if isinstance(receiver, ast.Name) else None


def reads_counts_as_numbers(fn_def: ast.FunctionDef, assignments: dict) -> bool:
    """Per-expert counts become Python numbers here: `counts.tolist()` (GraniteMoE's and JetMoE's split
    sizes), a loop over the counts (DeepSeek-V2's slice bounds), or the counts handed to a submodule
    (`self.experts(rows, counts)`, Aria's cumsum offsets). Dynamo can keep such numbers symbolic
    (unbacked) instead of breaking the graph there."""
    def count(expr) -> bool:
        return isinstance(expr, ast.Name) and is_count(expr, assignments)

    for node in walk_function(fn_def):
        receiver = tolist_of(node)
        if receiver is not None and count(ast.Name(receiver, ast.Load())):
            return True
        if isinstance(node, ast.For) and count(_counts_iterated(node)):
            return True
        if _calls_submodule(node) and any(count(arg) for arg in node.args):
            return True
    return False


def _calls_submodule(node: ast.AST) -> bool:
    """`self.<name>(...)`."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "self"
    )


def _counts_iterated(loop: ast.For) -> ast.AST | None:
    """C for `for n in C` or `for i, n in enumerate(C)`."""
    if call_name(loop.iter) == "enumerate" and isinstance(loop.iter.func, ast.Name) and len(loop.iter.args) == 1:
        return loop.iter.args[0]
    return loop.iter


def _count_variable(loop: ast.For) -> str | None:
    enumerated = call_name(loop.iter) == "enumerate"
    target = loop.target
    if enumerated and isinstance(target, ast.Tuple) and len(target.elts) == 2 and isinstance(target.elts[1], ast.Name):
        return target.elts[1].id
    return target.id if not enumerated and isinstance(target, ast.Name) else None


def _skips_zero_count(stmt: ast.stmt, n: str) -> bool:
    """`if n == 0: continue` or `if not n: continue`."""
    if not isinstance(stmt, ast.If) or stmt.orelse or len(stmt.body) != 1 or not isinstance(stmt.body[0], ast.Continue):
        return False
    test = stmt.test
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return isinstance(test.operand, ast.Name) and test.operand.id == n
    return (
        isinstance(test, ast.Compare)
        and len(test.ops) == 1
        and isinstance(test.ops[0], ast.Eq)
        and isinstance(test.left, ast.Name)
        and test.left.id == n
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value == 0
    )


@dataclasses.dataclass(frozen=True)
class CountLoop:
    """A loop over per-expert counts whose `if n == 0: continue` (at `guard`) is proved removable."""

    line: int
    guard: int
    bounds: frozenset[str]  # the offset names its slices are cut at (read as numbers when traced)


def count_loop(loop: ast.For, assignments: dict, fn_def: ast.FunctionDef) -> CountLoop | None:
    """The loop as a CountLoop when its guard is proved removable, None when it is not a loop over
    counts with such a guard; NotAdaptable names what stops the proof."""
    n = _count_variable(loop)
    counts = _counts_iterated(loop)
    if n is None or not isinstance(counts, ast.Name) or not is_count(counts, assignments):
        return None
    guard = _guard_index(loop.body, n)
    if guard is None:
        return None
    if loop.orelse:
        raise NotAdaptable(f"line {loop.lineno}: the loop over the counts has an else")
    # Bindings before the guard run for an empty expert too; the proof below covers the whole body.
    body = loop.body[:guard] + loop.body[guard + 1:]
    lists, bound = _appends_and_bindings(body, n)
    carried = _carried(body, bound)
    ends = {name for name, value in _simple_bindings(body) if _is_sum_with(value, n, carried)}
    for name in carried:
        _check_carried(body, name, n, ends)
    definitions = dict(_simple_bindings(body))

    def from_segment(value: ast.AST, depth: int = 0) -> bool:
        if any(_cuts_between(part, carried, ends) for part in ast.walk(value)):
            return True
        return depth < 8 and any(from_segment(definitions[name], depth + 1) for name in loads(value) & set(definitions))

    for line, listed, value in lists:
        if not from_segment(value):
            raise NotAdaptable(
                f"line {line}: what is appended to {listed} is not computed from the rows cut between the "
                "running offset and offset + count"
            )
    _check_reads_after(loop, fn_def, bound - carried, {listed for _, listed, _ in lists})
    return CountLoop(loop.lineno, loop.body[guard].lineno, frozenset(carried | ends))


def _guard_index(body: list[ast.stmt], n: str) -> int | None:
    """Where `if n == 0: continue` stands in `body`, after nothing but name bindings (DeepSeek's
    `end_idx = start_idx + num_tokens` comes first); None when there is no such guard."""
    for index, stmt in enumerate(body):
        if _skips_zero_count(stmt, n):
            return index
        if not (isinstance(stmt, ast.Assign) and all(isinstance(t, ast.Name) for t in stmt.targets)):
            return None
    return None


def _appends_and_bindings(body: list[ast.stmt], n: str) -> tuple[list[tuple[int, str, ast.expr]], set[str]]:
    """((line, list, appended value) for each `L.append(v)`, names bound) after checking that the body
    only binds names and appends to lists defined before the loop."""
    appends, bound = [], set()
    for stmt in body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            names = stored_names(stmt.targets[0])
        elif isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Name):
            names = [stmt.target.id]
        elif _appends_to_a_name(stmt):
            appends.append((stmt.lineno, stmt.value.func.value.id, stmt.value.args[0] if stmt.value.args else None))
            continue
        elif isinstance(stmt, ast.Pass):
            continue
        else:
            code = ast.unparse(stmt).splitlines()[0][:60]
            raise NotAdaptable(
                f"line {stmt.lineno}: `{code}` in the loop over the counts may act for an expert with no rows; "
                "only name bindings and list appends may"
            )
        if n in names:
            raise NotAdaptable(f"line {stmt.lineno}: the count {n} is re-bound in the body")
        bound.update(names)
    for line, listed, value in appends:
        if listed in bound or value is None:
            raise NotAdaptable(f"line {line}: the appended-to list {listed} is not defined before the loop")
    return appends, bound


def _appends_to_a_name(stmt: ast.stmt) -> bool:
    """`L.append(v)` with L a name."""
    return (
        isinstance(stmt, ast.Expr)
        and call_name(stmt.value) == "append"
        and isinstance(stmt.value.func, ast.Attribute)
        and isinstance(stmt.value.func.value, ast.Name)
    )


def _simple_bindings(body: list[ast.stmt]) -> list[tuple[str, ast.expr]]:
    found = []
    for stmt in body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            found.append((stmt.targets[0].id, stmt.value))
    return found


def _carried(body: list[ast.stmt], bound: set[str]) -> set[str]:
    """Names the body reads before binding them in an iteration: values carried between iterations."""
    seen, carried = set(), set()
    for stmt in body:
        value = stmt.value if isinstance(stmt, ast.Assign | ast.Expr) else stmt
        carried |= (loads(value) & bound) - seen
        if isinstance(stmt, ast.AugAssign):
            carried |= {stmt.target.id} - seen
        if isinstance(stmt, ast.Assign | ast.AugAssign):
            seen |= {n for t in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]) for n in stored_names(t)}
    return carried


def _is_sum_with(value: ast.AST, n: str, carried: set[str]) -> bool:
    """`c + n` or `n + c` with c carried."""
    if not (isinstance(value, ast.BinOp) and isinstance(value.op, ast.Add)):
        return False
    names = [x.id for x in (value.left, value.right) if isinstance(x, ast.Name)]
    return len(names) == 2 and n in names and bool(set(names) & carried)


def _check_carried(body: list[ast.stmt], name: str, n: str, ends: set[str]) -> None:
    """Every binding of a carried name in the body leaves it unchanged when n == 0."""
    for stmt in body:
        if isinstance(stmt, ast.AugAssign) and stmt.target.id == name:
            if isinstance(stmt.op, ast.Add) and isinstance(stmt.value, ast.Name) and stmt.value.id == n:
                continue
        elif not (isinstance(stmt, ast.Assign) and name in stored_names(stmt.targets[0])):
            continue
        elif isinstance(stmt.targets[0], ast.Name) and (
            _is_sum_with(stmt.value, n, {name}) or (isinstance(stmt.value, ast.Name) and stmt.value.id in ends)
        ):
            continue
        raise NotAdaptable(
            f"line {stmt.lineno}: {name}, carried between iterations, does not move by the count alone "
            f"(`{ast.unparse(stmt)[:50]}`)"
        )


def _cuts_between(value: ast.AST, carried: set[str], ends: set) -> bool:
    """`X[c:e]` with c a carried offset and e its offset + count."""
    if not (isinstance(value, ast.Subscript) and isinstance(value.slice, ast.Slice)) or value.slice.step is not None:
        return False
    lower, upper = value.slice.lower, value.slice.upper
    return isinstance(lower, ast.Name) and lower.id in carried and isinstance(upper, ast.Name) and upper.id in ends


def _check_reads_after(loop: ast.For, fn_def: ast.FunctionDef, local: set[str], lists: set[str]) -> None:
    """Outside the loop, names bound for one iteration are not read, and the lists only by `cat` or a
    truthiness test (`if L`, `if len(L)`)."""
    inside = {id(node) for node in ast.walk(loop)}
    allowed: set[int] = set()
    for node in walk_function(fn_def):
        if id(node) in inside:
            continue
        if call_name(node) == "cat" and node.args and isinstance(node.args[0], ast.Name):
            allowed.add(id(node.args[0]))
        if isinstance(node, ast.If | ast.IfExp | ast.While) and isinstance(node.test, ast.Name):
            allowed.add(id(node.test))
        if isinstance(node, ast.If | ast.IfExp | ast.While) and call_name(node.test) == "len" and node.test.args:
            allowed.add(id(node.test.args[0]))  # `if len(L)`: the list's truthiness
    for node in walk_function(fn_def):
        if id(node) in inside or not (isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)):
            continue
        if node.id in local:
            raise NotAdaptable(f"line {node.lineno}: {node.id}, bound in the loop over the counts, is read after it")
        if node.id in lists and id(node) not in allowed:
            raise NotAdaptable(f"line {node.lineno}: the list {node.id} is read other than by torch.cat after the loop")
