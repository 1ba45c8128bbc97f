"""Loops over chunks of one expert's rows (MiniMax-M2's remote code, which bounds its memory so).

    idx_full, top_x_full = torch.where(expert_mask[expert_idx].squeeze(0))
    for i in range(0, top_x_full.size(0), CHUNK):           # CHUNK an int literal, or a name bound once to one
        top_x = top_x_full[i : i + CHUNK]
        idx = idx_full[i : i + CHUNK]
        y = expert(x.index_select(0, top_x))
        y.mul_(w[top_x, idx].unsqueeze(-1))
        out.index_add_(0, top_x, y)

The chunk count depends on the data, so dynamo cannot unroll the loop in one graph. The traced copy
chooses, from the shape of what `torch.where` read (static, or guarded), between the body run once over
all the rows (`X[i : i + CHUNK]` read as `X`) and the loop as written:

    if expert_mask[expert_idx].squeeze(0).numel() <= CHUNK:
        <the body, the slices read as the whole rows>
    else:
        <the loop as written>

Why the first arm is the same computation (checked on the source, else the loop is left as written and
named): `torch.where(M)` gives at most `M.numel()` rows, so where that is at most CHUNK the loop runs
once, on chunks that are the whole rows, or not at all, for no rows; and the body's only effect is one
accumulation at a chunk of the rows (the expert-loop proof, `hit_expert_loops._check_body`, run on this
loop with the sliced names as rows), which adds nothing for no rows. Nothing about the experts is assumed
beyond what every expert loop assumes. M is evaluated again for its size: it may only read names not bound
between the `torch.where` and the loop, through views and comparisons. Every sliced name is an element of
the one `torch.where` / `nonzero(as_tuple=True)` tuple whose first element's length bounds the range. The
loop variable is read only in the slices.
"""

from __future__ import annotations

import ast
import dataclasses
from copy import deepcopy

from .source_ast import NotAdaptable, call_name, sized_name, stored_names

# Calls that keep what a tensor's shape is read from: views and comparisons of the where operand
_SHAPE_KEEPING = frozenset({"squeeze", "unsqueeze", "view", "reshape", "flatten", "permute", "transpose", "contiguous",
                            "eq", "ne", "gt", "ge", "lt", "le", "bool", "int", "long", "float", "to"})


@dataclasses.dataclass(frozen=True)
class ChunkLoop:
    """A loop over chunks of rows: `for var in range(0, len(rows[0]), step)` slicing `rows` by `[var : var + step]`."""

    loop: ast.For
    var: str
    step: ast.expr  # as written: an int literal or a name bound once to one
    rows: tuple[str, ...]  # the names of the one `torch.where` tuple the body slices
    bound_at: int  # the line that bound them
    operand: ast.expr  # what that `torch.where` (or `nonzero`) reads, as written


def chunk_loop(loop: ast.For, assignments: dict[str, list[ast.AST]]) -> ChunkLoop | None:
    """The chunk loop `loop` is, or None where it is not one (a loop of another kind)."""
    if not isinstance(loop.target, ast.Name) or loop.orelse or call_name(loop.iter) != "range":
        return None
    args = loop.iter.args
    if len(args) != 3 or loop.iter.keywords or not (isinstance(args[0], ast.Constant) and args[0].value == 0):
        return None
    length_of, step = _length_read(args[1]), args[2]
    if length_of is None or _positive_int(step, assignments) is None:
        return None
    tuples = assignments.get(length_of, [])
    if len(tuples) != 1 or not isinstance(tuples[0], ast.Assign) or not _selects_positions(tuples[0].value):
        return None
    rows = tuple(n for t in tuples[0].targets for n in stored_names(t))
    if any(len(assignments.get(name, [])) != 1 for name in rows):
        return None  # a name of the tuple bound again may have another length
    return ChunkLoop(loop, loop.target.id, step, rows, tuples[0].lineno, _positions_operand(tuples[0].value))


def check_slices(chunk: ChunkLoop) -> None:
    """The loop variable is read only as `X[var : var + step]` with X one of the chunk's rows."""
    var = chunk.var
    sliced = {id(n) for s in _chunk_slices(chunk) for n in (s.slice.lower, s.slice.upper.left)}
    for node in ast.walk(ast.Module(chunk.loop.body, [])):
        if isinstance(node, ast.Name) and node.id == var and id(node) not in sliced:
            raise NotAdaptable(f"line {node.lineno}: the chunk start {var} is read other than as "
                               f"`X[{var} : {var} + {ast.unparse(chunk.step)}]` of the rows")
        if isinstance(node, ast.Name) and node.id == var and isinstance(node.ctx, ast.Store):
            raise NotAdaptable(f"line {node.lineno}: the chunk start {var} is bound again")


def inline(chunk: ChunkLoop, parent_body: list[ast.stmt]) -> None:
    """Replace the loop in `parent_body` by `if <M>.numel() <= step: <body, slices read whole> else: <loop>`."""
    as_written = deepcopy(chunk.loop)
    for sub in _chunk_slices(chunk):
        sub.slice = ast.copy_location(ast.Slice(None, None, None), sub.slice)
    test = ast.Compare(ast.Call(ast.Attribute(deepcopy(chunk.operand), "numel", ast.Load()), [], []), [ast.LtE()],
                       [deepcopy(chunk.step)])
    choice = ast.copy_location(ast.If(test, chunk.loop.body, [as_written]), chunk.loop)
    choice.moe_passes_chunk_choice = True  # read by the expert-loop proof: the first arm is the loop's body
    at = next(i for i, stmt in enumerate(parent_body) if stmt is chunk.loop)
    parent_body[at] = choice
    ast.fix_missing_locations(choice)


def is_chunk_choice(stmt: ast.stmt) -> bool:
    """`stmt` is the `if` that `inline` made."""
    return getattr(stmt, "moe_passes_chunk_choice", False)


def check_operand(chunk: ChunkLoop, fn_def: ast.FunctionDef) -> None:
    """The `torch.where` operand may be evaluated again at the loop for its size: views, lookups and
    comparisons of names none of which is bound between the two."""
    for node in ast.walk(chunk.operand):
        if isinstance(node, ast.Call) and call_name(node) not in _SHAPE_KEEPING:
            raise NotAdaptable(f"line {chunk.bound_at}: `{ast.unparse(node)[:50]}` in what `torch.where` reads is "
                               "not a view or a comparison, so it is not evaluated again for its size")
        if isinstance(node, ast.NamedExpr | ast.Lambda | ast.Await | ast.Yield):
            raise NotAdaptable(f"line {chunk.bound_at}: what `torch.where` reads binds or defers names")
    read = {n.id for n in ast.walk(chunk.operand) if isinstance(n, ast.Name)}
    between = range(chunk.bound_at + 1, chunk.loop.lineno)
    for node in ast.walk(fn_def):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id in read and node.lineno in between:
            raise NotAdaptable(f"line {node.lineno}: {node.id}, read by the `torch.where` at line {chunk.bound_at}, "
                               "is bound again before the chunk loop")


def _length_read(expr: ast.expr) -> str | None:
    """N of `N.size(0)`, or of `N.numel()`, `len(N)`, `N.shape[0]` (`sized_name`)."""
    if (call_name(expr) == "size" and isinstance(expr.func, ast.Attribute) and isinstance(expr.func.value, ast.Name)
            and not expr.keywords and len(expr.args) == 1 and isinstance(expr.args[0], ast.Constant)
            and expr.args[0].value == 0):
        return expr.func.value.id
    return sized_name(expr)


def _positive_int(expr: ast.expr, assignments) -> int | None:
    if isinstance(expr, ast.Name):
        bound = assignments.get(expr.id, [])
        if len(bound) != 1 or not isinstance(bound[0], ast.Assign) or len(bound[0].targets) != 1:
            return None
        expr = bound[0].value
    if isinstance(expr, ast.Constant) and type(expr.value) is int and expr.value > 0:
        return expr.value
    return None


def _selects_positions(value: ast.expr) -> bool:
    """`torch.where(M)` (one argument) or `M.nonzero(as_tuple=True)`: a tuple of equal-length positions."""
    name = call_name(value)
    if name == "where":
        return len(value.args) == 1 and not value.keywords
    return name == "nonzero" and any(
        k.arg == "as_tuple" and isinstance(k.value, ast.Constant) and k.value.value is True for k in value.keywords)


def _positions_operand(value: ast.Call) -> ast.expr:
    """M of `torch.where(M)`, `M.nonzero(as_tuple=True)` or `torch.nonzero(M, as_tuple=True)`."""
    if call_name(value) == "nonzero" and isinstance(value.func, ast.Attribute) and not value.args:
        return value.func.value
    return value.args[0]


def _chunk_slice(node: ast.Subscript, chunk: ChunkLoop) -> bool:
    """`X[var : var + step]` with X one of the chunk's rows."""
    s = node.slice
    return (isinstance(node.value, ast.Name) and node.value.id in chunk.rows and isinstance(s, ast.Slice)
            and s.step is None and isinstance(s.lower, ast.Name) and s.lower.id == chunk.var
            and isinstance(s.upper, ast.BinOp) and isinstance(s.upper.op, ast.Add)
            and isinstance(s.upper.left, ast.Name) and s.upper.left.id == chunk.var
            and ast.dump(s.upper.right) == ast.dump(chunk.step))


def _chunk_slices(chunk: ChunkLoop) -> list[ast.Subscript]:
    return [n for stmt in chunk.loop.body for n in ast.walk(stmt)
            if isinstance(n, ast.Subscript) and _chunk_slice(n, chunk)]


