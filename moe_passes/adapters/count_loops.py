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
import collections
import dataclasses
import types
from collections.abc import Mapping

from .offset_slices import written_fresh
from .row_maps import Callees, acting_call, row_dropping
from .source_ast import (
    VIEW_METHODS,
    NotAdaptable,
    bindings,
    call_name,
    defining_bindings,
    function_source,
    loads,
    number_read,
    skip_test,
    span,
    stored_names,
    strip_methods,
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
        if name in VIEW_METHODS | {"cpu", "numpy", "tolist"} and isinstance(expr.func, ast.Attribute):
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


def counts_returned(fn, fn_def: ast.FunctionDef, assignments: dict) -> frozenset[str]:
    """Names bound to per-expert counts returned by a module function: `a, sizes = route(x)` where every
    `return` of `route` gives counts at that place (JetMoE's TorchScript `compute_gating`, read through
    its Python function). A name bound anywhere else as well is not one."""
    found = set()
    for node in walk_function(fn_def):
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Tuple)
                and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)):
            continue
        callee = getattr(fn, "__globals__", {}).get(node.value.func.id)
        callee = getattr(callee, "_torchdynamo_inline", callee)  # a ScriptFunction's Python function
        places = _count_places(callee, len(node.targets[0].elts)) if isinstance(callee, types.FunctionType) else ()
        for place in places:
            element = node.targets[0].elts[place]
            if isinstance(element, ast.Name) and assignments.get(element.id) == [node]:
                found.add(element.id)
    return frozenset(found)


def _count_places(callee: types.FunctionType, width: int) -> tuple[int, ...]:
    """The places of a `width`-tuple at which every `return` of `callee` gives per-expert counts."""
    try:
        callee_def, _ = function_source(callee)
        returns = [n for n in walk_function(callee_def) if isinstance(n, ast.Return)]
        if not returns or not all(isinstance(r.value, ast.Tuple) and len(r.value.elts) == width for r in returns):
            return ()
        bound = bindings(callee_def)
        return tuple(place for place in range(width) if all(is_count(r.value.elts[place], bound) for r in returns))
    except Exception:  # noqa: BLE001 - source that cannot be read (a lambda in an expression, ...): no counts
        return ()


def reads_counts_as_numbers(fn_def: ast.FunctionDef, assignments: dict, returned: frozenset[str] = frozenset()) -> bool:
    """Per-expert counts become Python numbers here: `counts.tolist()` (GraniteMoE's and JetMoE's split
    sizes), a loop over the counts (DeepSeek-V2's slice bounds), or the counts handed to a submodule
    (`self.experts(rows, counts)`, Aria's cumsum offsets); `returned` names counts a module function
    returned (`counts_returned`). Dynamo can keep such numbers symbolic (unbacked) instead of breaking
    the graph there."""
    def count(expr) -> bool:
        return isinstance(expr, ast.Name) and (expr.id in returned or is_count(expr, assignments))

    for node in walk_function(fn_def):
        receiver = tolist_of(node)
        if receiver is not None and count(ast.Name(receiver, ast.Load())):
            return True
        if _largest_count(node, assignments):
            return True
        if isinstance(node, ast.For) and count(_counts_iterated(node)):
            return True
        if _calls_submodule(node) and any(count(arg) for arg in node.args):
            return True
    return False


def _largest_count(node: ast.AST, assignments: dict) -> bool:
    """`C.max().item()` or `int(C.max())`, C per-expert counts or a `bincount(...)`: the largest count
    read as a number (a capacity that drops nothing, whose cut the sparse-loop finder checks)."""
    reduced = number_read(node)
    if reduced is None or call_name(reduced) not in ("max", "amax") or not isinstance(reduced.func, ast.Attribute) or reduced.args:
        return False
    counts = strip_methods(reduced.func.value, VIEW_METHODS)
    return call_name(counts) == "bincount" or (isinstance(counts, ast.Name) and is_count(counts, assignments))


def _calls_submodule(node: ast.AST) -> bool:
    """`self.<name>(...)`."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "self"
    )


def _counts_iterated(loop: ast.For) -> ast.AST | None:
    """C for `for n in C` or `for i, n in enumerate(C)`, C maybe read through a host copy (`C.tolist()`,
    `C.cpu().numpy()`: the same numbers)."""
    iterated = loop.iter
    if call_name(iterated) == "enumerate" and isinstance(iterated.func, ast.Name) and len(iterated.args) == 1:
        iterated = iterated.args[0]
    copied = tolist_of(iterated)
    return ast.Name(copied, ast.Load()) if copied is not None else iterated


def _count_variable(loop: ast.For) -> str | None:
    enumerated = call_name(loop.iter) == "enumerate"
    target = loop.target
    if enumerated and isinstance(target, ast.Tuple) and len(target.elts) == 2 and isinstance(target.elts[1], ast.Name):
        return target.elts[1].id
    return target.id if not enumerated and isinstance(target, ast.Name) else None


def _skips_zero_count(stmt: ast.stmt, n: str) -> bool:
    """`if n == 0: continue` or `if not n: continue`."""
    test = skip_test(stmt)
    if test is None:
        return False
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
    fresh: frozenset[str] = frozenset()  # buffers made for the stores alone (`offset_slices.written_fresh`)
    # what the proof read of a namespace or a class (row_maps.still_trusted tells whether it still holds)
    trusted: tuple = dataclasses.field(default=(), compare=False)


def count_loop(loop: ast.For, assignments: dict, fn_def: ast.FunctionDef, namespace: Mapping[str, object] = {},
               owner: type | None = None) -> CountLoop | None:
    """The loop as a CountLoop when its guard is proved removable, None when it is not a loop over
    counts with such a guard; NotAdaptable names what stops the proof. `namespace` (the function's globals
    and closure) and `owner` (the class of a method) tell what the calls in the loop stand for."""
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
    sinks, bound = _sinks_and_bindings(body, n)
    carried = _carried(body, bound)
    ends = _ends(body, n, carried)
    for name in carried:
        _check_carried(body, name, n, ends)
    # (position in the body, name, value): a name read at some position is the one bound last before it
    # (SGLang binds `gate_up` twice, the second time from the first)
    definitions = [(i, *binding) for i, stmt in enumerate(body) for binding in _simple_bindings([stmt])]

    def computed_with(value: ast.AST, position: int, depth: int = 0) -> list[ast.AST]:
        """`value` and the values of the bindings it reads (each at the binding before its use)."""
        found = [value]
        for name in loads(value) if depth < 8 else ():
            earlier = [(i, v) for i, bound_name, v in definitions if bound_name == name and i < position]
            if earlier:
                found.extend(computed_with(earlier[-1][1], earlier[-1][0], depth + 1))
        return found

    callees = Callees(fn_def, namespace, owner)  # the function's scope, read once for every sink
    positions = {stmt.lineno: i for i, stmt in enumerate(body)}
    for sink in sinks:
        _check_sink(sink, computed_with(sink.value, positions[sink.line]), carried, ends, callees)
    _check_reads_after(loop, fn_def, bound - carried, {s.name for s in sinks if s.target is None})
    # every call but the sinks' values acts only through its value (a helper storing a statistic of the rows
    # on the module would store one for an expert with none)
    effects = Callees(fn_def, namespace, owner, effects=True, trusted=callees.trusted)
    acting = acting_call(body, {id(s.effect if s.effect is not None else s.value) for s in sinks}, effects)
    if acting is not None:
        call, found = acting
        raise NotAdaptable(f"line {call.lineno}: the call `{ast.unparse(call)[:50]}` in the loop over the counts "
                           f"goes through {found}, which may act for an expert with no rows")
    fresh = written_fresh(fn_def, loop, carried | ends, assignments) if any(s.target for s in sinks) else set()
    return CountLoop(loop.lineno, loop.body[guard].lineno, frozenset(carried | ends), frozenset(fresh),
                     tuple(callees.trusted))


def _guard_index(body: list[ast.stmt], n: str) -> int | None:
    """Where `if n == 0: continue` stands in `body`, after nothing but name bindings (DeepSeek's
    `end_idx = start_idx + num_tokens` comes first); None when there is no such guard."""
    for index, stmt in enumerate(body):
        if _skips_zero_count(stmt, n):
            return index
        if not (isinstance(stmt, ast.Assign) and all(isinstance(t, ast.Name) for t in stmt.targets)):
            return None
    return None


@dataclasses.dataclass(frozen=True)
class Sink:
    """Where the loop's body puts an expert's output: `L.append(v)` (target None), or `B[c:e] = v`, a
    store into the rows cut between the running offset and offset + count of a buffer made before the loop
    (empty for an expert with no rows: storing its no rows there changes nothing)."""

    line: int
    name: str  # the list appended to, or the buffer stored into
    value: ast.expr
    target: ast.Subscript | None = None
    effect: ast.expr | None = None  # the expression that puts the value there (`L.append(v)`, else v itself)

    def described(self) -> str:
        return f"what is appended to {self.name}" if self.target is None else f"what is stored into {self.name}"


def _sinks_and_bindings(body: list[ast.stmt], n: str) -> tuple[list[Sink], set[str]]:
    """(the appends and slice stores, names bound) after checking that the body only binds names, appends
    to lists and stores into slices of buffers defined before the loop."""
    sinks, bound = [], set()
    for stmt in body:
        if _stores_into_a_slice(stmt):
            sinks.append(Sink(stmt.lineno, stmt.targets[0].value.id, stmt.value, stmt.targets[0]))
            continue
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            names = stored_names(stmt.targets[0])
        elif isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Name):
            names = [stmt.target.id]
        elif _appends_to_a_name(stmt):
            sinks.append(Sink(stmt.lineno, stmt.value.func.value.id, stmt.value.args[0] if stmt.value.args else None,
                              effect=stmt.value))
            continue
        elif isinstance(stmt, ast.Pass):
            continue
        else:
            code = ast.unparse(stmt).splitlines()[0][:60]
            raise NotAdaptable(
                f"line {stmt.lineno}: `{code}` in the loop over the counts may act for an expert with no rows; "
                "only name bindings, list appends and stores into slices may"
            )
        if n in names:
            raise NotAdaptable(f"line {stmt.lineno}: the count {n} is re-bound in the body")
        bound.update(names)
    for sink in sinks:
        if sink.name in bound or sink.value is None:
            what = "appended-to list" if sink.target is None else "buffer stored into"
            raise NotAdaptable(f"line {sink.line}: the {what} {sink.name} is not defined before the loop")
    return sinks, bound


def _stores_into_a_slice(stmt: ast.stmt) -> bool:
    """`B[lower:upper] = v` with B a name."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Subscript)):
        return False
    target = stmt.targets[0]
    return isinstance(target.value, ast.Name) and isinstance(target.slice, ast.Slice)


def _check_sink(sink: Sink, sources: list[ast.AST], carried: set[str], ends: set[str], callees: Callees) -> None:
    """A sink's value is computed from the rows cut between the running offset and offset + count (no rows
    for an expert with none), through no call that may give rows without any; a store lands on that cut."""
    if sink.target is not None and not _cuts_between(sink.target, carried, ends):
        raise NotAdaptable(f"line {sink.line}: the store into {sink.name} is not at the rows cut between the running "
                           "offset and offset + count")
    if not any(_cuts_between(part, carried, ends) for source in sources for part in ast.walk(source)):
        raise NotAdaptable(
            f"line {sink.line}: {sink.described()} is not computed from the rows cut between the running offset "
            "and offset + count"
        )
    dropping = next(filter(None, (row_dropping(source, callees) for source in sources)), None)
    if dropping is not None:
        raise NotAdaptable(
            f"line {sink.line}: {sink.described()} goes through {dropping}, which may leave a value with rows when "
            "the cut has none (an expert with no rows would add it where the skip kept it out)"
        )


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
        if _stores_into_a_slice(stmt):  # binds no name; reads its value and the bounds it stores at
            carried |= ((loads(stmt.value) | loads(stmt.targets[0])) & bound) - seen
            continue
        value = stmt.value if isinstance(stmt, ast.Assign | ast.Expr) else stmt
        carried |= (loads(value) & bound) - seen
        if isinstance(stmt, ast.AugAssign):
            carried |= {stmt.target.id} - seen
        if isinstance(stmt, ast.Assign | ast.AugAssign):
            seen |= {n for t in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]) for n in stored_names(t)}
    return carried


def _ends(body: list[ast.stmt], n: str, carried: set[str]) -> set[str]:
    """Names the body binds once, to `c + n` with c carried: the end of an expert's cut (a name bound again,
    `end = end + 1`, is not)."""
    times = collections.Counter(
        name for stmt in body if isinstance(stmt, ast.Assign | ast.AugAssign) and not _stores_into_a_slice(stmt)
        for target in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target])
        for name in stored_names(target))
    return {name for name, value in _simple_bindings(body) if _is_sum_with(value, n, carried) and times[name] == 1}


def _is_sum_with(value: ast.AST, n: str, carried: set[str]) -> bool:
    """`c + n` or `n + c` with c carried."""
    if not (isinstance(value, ast.BinOp) and isinstance(value.op, ast.Add)):
        return False
    names = [x.id for x in (value.left, value.right) if isinstance(x, ast.Name)]
    return len(names) == 2 and n in names and bool(set(names) & carried)


def _check_carried(body: list[ast.stmt], name: str, n: str, ends: set[str]) -> None:
    """Every binding of a carried name in the body leaves it unchanged when n == 0."""
    for stmt in body:
        if _stores_into_a_slice(stmt):
            continue
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


# ---------------------------------------------------------------------------------------------------
# Loops over the running offsets of the counts (DeepSeek-MoE 16B's `moe_infer`)
#
#     offsets = flat_ids.bincount().cpu().numpy().cumsum(0)
#     for i, end in enumerate(offsets):
#         start = 0 if i == 0 else offsets[i - 1]
#         if start == end:
#             continue                       # a data-dependent branch: dynamo breaks the graph here
#         rows = token_of[start:end]
#         y = self.experts[i](x[rows])
#         y.mul_(flat_weights[order[start:end]])
#         out.scatter_reduce_(0, rows.view(-1, 1).repeat(1, x.shape[-1]), y, reduce="sum")
#
# Why the guard can go: when start == end, every cut `X[start:end]` is empty, so the accumulation
# (the body's one effect outside the iteration) adds nothing at no rows; every other statement binds
# names of one iteration or updates their tensors in place. `bincount()` has a data-dependent length
# (max id + 1), which the trace cannot iterate: it is counted into one bin per expert the loop indexes
# (`len(self.experts)`); the bins past the largest id are zero, so their iterations cut no rows either,
# and an id past the experts, on which the original loop raises IndexError, makes the count raise.

_ACCUMULATING = {"index_add_", "index_put_", "scatter_add_", "scatter_reduce_"}


@dataclasses.dataclass(frozen=True)
class FixedCounts:
    """A `bincount` read by an offset loop: counted into `length` bins instead (`length` is an
    expression of the method, `len(self.experts)`)."""

    at: tuple[int, int, int, int]  # where the call stands (line, column, end line, end column)
    length: str


def offset_loop(loop: ast.For, assignments: dict, fn_def: ast.FunctionDef) -> tuple[CountLoop, FixedCounts | None] | None:
    """(the loop, the bincount to count into fixed bins) when `loop` runs over running offsets and its
    `if start == end: continue` is proved removable; None when it is not such a loop; NotAdaptable
    names what stops the proof."""
    target, iterated = loop.target, loop.iter
    if not (call_name(iterated) == "enumerate" and isinstance(iterated.func, ast.Name) and len(iterated.args) == 1
            and isinstance(iterated.args[0], ast.Name) and isinstance(target, ast.Tuple) and len(target.elts) == 2
            and all(isinstance(t, ast.Name) for t in target.elts)):
        return None
    offsets, (index, end) = iterated.args[0].id, (t.id for t in target.elts)
    counts = _cumsum_operand(offsets, assignments)
    if counts is None:
        return None
    start, guard = _previous_offset(loop.body, index, offsets), None
    if start is None:
        return None
    for position, stmt in enumerate(loop.body):
        if _skips_equal(stmt, start, end):
            guard = position
            break
        if not (isinstance(stmt, ast.Assign) and all(isinstance(t, ast.Name) for t in stmt.targets)):
            return None
    if guard is None:
        return None
    if loop.orelse:
        raise NotAdaptable(f"line {loop.lineno}: the loop over the offsets has an else")
    body = loop.body[:guard] + loop.body[guard + 1:]
    bound, cut, accumulations = {index, end}, set(), []
    for stmt in body:
        if _recasts_outer(stmt, bound):
            continue  # `acc = acc.to(out.dtype)`: see _recasts_outer
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            names = stored_names(stmt.targets[0])
            if {offsets, index, end} & set(names):
                raise NotAdaptable(f"line {stmt.lineno}: the loop re-binds {', '.join(sorted({offsets, index, end} & set(names)))}")
            if _is_cut(stmt.value, start, end) or _derives_from(stmt.value, cut):
                cut.update(names)
            bound.update(names)
        elif isinstance(stmt, ast.Expr) and call_name(stmt.value) in _ACCUMULATING | _IN_PLACE:
            receiver = stmt.value.func.value if isinstance(stmt.value.func, ast.Attribute) else None
            if not isinstance(receiver, ast.Name):
                raise NotAdaptable(f"line {stmt.lineno}: `{ast.unparse(stmt)[:50]}` updates no named tensor")
            if receiver.id not in bound:
                accumulations.append(stmt.value)
            elif call_name(stmt.value) not in _IN_PLACE:
                raise NotAdaptable(f"line {stmt.lineno}: an accumulation into {receiver.id}, bound in the loop")
        else:
            code = ast.unparse(stmt).splitlines()[0][:60]
            raise NotAdaptable(
                f"line {stmt.lineno}: `{code}` in the loop over the offsets may act for an expert with no rows; "
                "only name bindings, in-place updates of them and one accumulation may"
            )
    if len(accumulations) != 1:
        raise NotAdaptable(f"line {loop.lineno}: the loop over the offsets accumulates {len(accumulations)} times, not once")
    rows = _accumulated_rows(accumulations[0])
    if rows is None or not _derives_from(rows, cut):
        raise NotAdaptable(
            f"line {accumulations[0].lineno}: the accumulated rows are not cut between the offsets {start} and {end}"
        )
    _check_reads_after(loop, fn_def, bound - {index, end}, set())
    fixed = _fixed_counts(counts, loop, index)
    return CountLoop(loop.lineno, loop.body[guard].lineno, frozenset({start, end})), fixed


_IN_PLACE = {"mul_", "div_", "add_", "sub_", "copy_", "clamp_"}


def _recasts_outer(stmt: ast.stmt, bound: set[str]) -> bool:
    """`acc = acc.to(out.dtype)` (or `dtype=`) of a tensor defined before the loop (DiT-MoE re-casts its
    accumulator to the experts' output dtype under autocast). Running it for an expert with no rows as
    well is exact: a dtype does not depend on the rows, the experts of a layer give one dtype (the
    premise, with "rows to rows", under which the experts' loops are read), so after the first cast
    each is a no-op, and before the first expert with rows nothing else has touched the accumulator
    (what an empty expert would accumulate is nothing): it is cast from the same value either way."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        return False
    name, value = stmt.targets[0].id, stmt.value
    if name in bound or call_name(value) != "to" or not isinstance(value.func, ast.Attribute):
        return False
    receiver = value.func.value
    arguments = list(value.args) + [k.value for k in value.keywords if k.arg == "dtype"]
    return (isinstance(receiver, ast.Name) and receiver.id == name and len(value.args) + len(value.keywords) == 1
            and len(arguments) == 1 and isinstance(arguments[0], ast.Attribute) and arguments[0].attr == "dtype")


def _cumsum_operand(offsets: str, assignments: dict) -> ast.AST | None:
    """C for offsets bound once to `C.cumsum(0)` (through host copies: `.cpu()`, `.numpy()`,
    `.tolist()`), C per-expert counts or a `bincount`."""
    bound = defining_bindings(offsets, assignments)
    if not bound or len(bound) != 1:
        return None
    value = bound[0].value
    while call_name(value) in ("cpu", "numpy", "tolist") and isinstance(value.func, ast.Attribute):
        value = value.func.value
    if call_name(value) != "cumsum" or not isinstance(value.func, ast.Attribute):
        return None
    dims = value.args or [k.value for k in value.keywords if k.arg in ("dim", "axis")]
    if not (len(dims) == 1 and isinstance(dims[0], ast.Constant) and dims[0].value in (0, -1)):
        return None
    counts = value.func.value
    while call_name(counts) in ("cpu", "numpy") and isinstance(counts.func, ast.Attribute):
        counts = counts.func.value
    return counts if call_name(counts) == "bincount" or is_count(counts, assignments) else None


def _previous_offset(body: list[ast.stmt], index: str, offsets: str) -> str | None:
    """S for `S = 0 if i == 0 else offsets[i - 1]` among the leading bindings of the body."""
    for stmt in body:
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
            return None
        value = stmt.value
        if (isinstance(value, ast.IfExp) and ast.unparse(value.test) == f"{index} == 0"
                and isinstance(value.body, ast.Constant) and value.body.value == 0
                and ast.unparse(value.orelse) == f"{offsets}[{index} - 1]"):
            return stmt.targets[0].id
    return None


def _skips_equal(stmt: ast.stmt, start: str, end: str) -> bool:
    """`if start == end: continue` (either order)."""
    test = skip_test(stmt)
    if test is None:
        return False
    return (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)
            and {ast.unparse(test.left), ast.unparse(test.comparators[0])} == {start, end})


def _is_cut(value: ast.AST, start: str, end: str) -> bool:
    """`X[start:end]`."""
    return (isinstance(value, ast.Subscript) and isinstance(value.slice, ast.Slice) and value.slice.step is None
            and isinstance(value.slice.lower, ast.Name) and value.slice.lower.id == start
            and isinstance(value.slice.upper, ast.Name) and value.slice.upper.id == end)


def _accumulated_rows(call: ast.Call) -> ast.AST | None:
    """The rows argument of `out.index_add_(0, rows, y)`, `out.index_put_((rows,), y, accumulate=True)`,
    or `out.scatter_add_(0, idx, y)` / `out.scatter_reduce_(0, idx, y, reduce="sum")` (idx, the rows
    broadcast over the hidden dim); None for other accumulations."""
    method, args = call.func.attr, call.args
    keywords = {k.arg: k.value for k in call.keywords}
    if method == "index_put_":
        accumulate = args[2] if len(args) > 2 else keywords.get("accumulate")
        indices = args[0] if args else keywords.get("indices")
        if isinstance(accumulate, ast.Constant) and accumulate.value is True and isinstance(
                indices, ast.Tuple | ast.List) and len(indices.elts) == 1:
            return indices.elts[0]
        return None
    dim = args[0] if args else keywords.get("dim")
    if not (isinstance(dim, ast.Constant) and dim.value == 0):
        return None
    if method == "scatter_reduce_":
        reduce = args[3] if len(args) > 3 else keywords.get("reduce")
        if not (isinstance(reduce, ast.Constant) and reduce.value == "sum") or "include_self" in keywords:
            return None
    return args[1] if len(args) > 1 else keywords.get("index")


def _derives_from(expr: ast.AST, cut: set[str]) -> bool:
    """`expr` has a row per row of a cut (names in `cut`), so none when the cut is empty: the name,
    through view-like methods, `repeat`/`expand`, arithmetic with it (`slots // k`) and gathers indexed
    by it (`token_of[slots]`)."""
    expr = strip_methods(expr, VIEW_METHODS | {"repeat", "expand", "unsqueeze", "squeeze", "flatten"})
    if isinstance(expr, ast.BinOp):
        return _derives_from(expr.left, cut) or _derives_from(expr.right, cut)
    if isinstance(expr, ast.Subscript) and not isinstance(expr.slice, ast.Slice | ast.Tuple):
        return _derives_from(expr.slice, cut)
    return isinstance(expr, ast.Name) and expr.id in cut


def _fixed_counts(counts: ast.AST, loop: ast.For, index: str) -> FixedCounts | None:
    """The bincount to count into one bin per expert, the experts being the module list the loop
    indexes with its index (`self.experts[i]`); None for counts of a fixed length already."""
    if call_name(counts) != "bincount":
        return None
    is_function = isinstance(counts.func, ast.Attribute) and isinstance(counts.func.value, ast.Name) and (
        counts.func.value.id == "torch")
    if counts.keywords or len(counts.args) != (1 if is_function else 0):
        raise NotAdaptable(f"line {counts.lineno}: `{ast.unparse(counts)[:50]}` is not a plain count of the ids")
    containers = {ast.unparse(n.value) for n in ast.walk(loop) if isinstance(n, ast.Subscript)
                  and isinstance(n.slice, ast.Name) and n.slice.id == index and isinstance(n.value, ast.Attribute)}
    if len(containers) != 1:
        raise NotAdaptable(f"line {loop.lineno}: the bincount's length is data-dependent, and the loop indexes no one "
                           "expert list with its index")
    where = span(counts)
    return FixedCounts(where, f"len({containers.pop()})")


def split_counts(sizes: str, assignments: dict) -> FixedCounts | None:
    """For split sizes `sizes` bound once to `bincount(X, minlength=M).tolist()`: the bincount counted
    into M bins, where X is proved below M; None for sizes of a fixed length already (`M.sum(0)`,
    `histc`). A bincount whose ids are not proved below M is NotAdaptable: its length is then
    data-dependent, and a list of data-dependent length cannot be traced."""
    bound = defining_bindings(sizes, assignments) if sizes.isidentifier() else None
    if not bound or len(bound) != 1 or not isinstance(bound[0], ast.Assign):
        return None
    value = bound[0].value
    while call_name(value) in ("cpu", "numpy", "tolist") and isinstance(value.func, ast.Attribute):
        value = value.func.value
    if call_name(value) != "bincount" or any(k.arg == "weights" for k in value.keywords):
        return None
    is_function = isinstance(value.func, ast.Attribute) and isinstance(value.func.value, ast.Name) and (
        value.func.value.id == "torch")
    ids = value.args[0] if is_function and value.args else (value.func.value if not is_function else None)
    minlength = next((k.value for k in value.keywords if k.arg == "minlength"), None)
    if minlength is None and len(value.args) > (2 if is_function else 1):
        minlength = value.args[-1]
    if ids is None or minlength is None or not _ids_below(ids, minlength, assignments):
        raise NotAdaptable(
            f"line {value.lineno}: the split sizes come from `{ast.unparse(value)[:50]}`, whose length depends on "
            "the ids (not proved below its minlength)"
        )
    where = span(value)
    return FixedCounts(where, ast.unparse(minlength))


def _ids_below(ids: ast.AST, bound: ast.AST, assignments: dict) -> bool:
    """`ids` are the first of `torch.where(A == R)` (R on either side), R being `arange(bound)` made the
    leading dim of the comparison (`.view(bound, 1, 1)`, `[:, None, None]`): positions along R, so each
    is below `bound`."""
    if not isinstance(ids, ast.Name):
        return False
    defined = defining_bindings(ids.id, assignments)
    if not defined or len(defined) != 1 or not isinstance(defined[0], ast.Assign):
        return False
    target, value = defined[0].targets[0], defined[0].value
    if not (isinstance(target, ast.Tuple) and target.elts and isinstance(target.elts[0], ast.Name)
            and target.elts[0].id == ids.id and call_name(value) == "where" and len(value.args) == 1):
        return False
    test = value.args[0]
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    return any(_leading_arange(side, bound, assignments) for side in (test.left, test.comparators[0]))


def _leading_arange(expr: ast.AST, bound: ast.AST, assignments: dict) -> bool:
    if isinstance(expr, ast.Name):
        defined = defining_bindings(expr.id, assignments)
        if not defined or len(defined) != 1 or not isinstance(defined[0], ast.Assign):
            return False
        expr = defined[0].value
    if call_name(expr) in ("view", "reshape") and isinstance(expr.func, ast.Attribute):
        dims = expr.args[0].elts if len(expr.args) == 1 and isinstance(expr.args[0], ast.Tuple) else expr.args
        if not (dims and ast.unparse(dims[0]) == ast.unparse(bound)
                and all(isinstance(d, ast.Constant) and d.value == 1 for d in dims[1:])):
            return False
        inner = expr.func.value
    elif isinstance(expr, ast.Subscript) and isinstance(expr.slice, ast.Tuple):
        first, *rest = expr.slice.elts
        if not (isinstance(first, ast.Slice) and first.lower is None and first.upper is None
                and all(isinstance(r, ast.Constant) and r.value is None for r in rest)):
            return False
        inner = expr.value
    else:
        return False
    return (call_name(inner) == "arange" and len(inner.args) == 1
            and ast.unparse(inner.args[0]) == ast.unparse(bound))
