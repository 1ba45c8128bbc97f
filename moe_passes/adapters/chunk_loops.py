"""Loops over chunks of one expert's rows (MiniMax-M2's remote code, which bounds its memory so).

    idx_full, top_x_full = torch.where(expert_mask[expert_idx].squeeze(0))
    for i in range(0, top_x_full.size(0), CHUNK):           # CHUNK an int literal, or a name bound once to one
        top_x = top_x_full[i : i + CHUNK]
        idx = idx_full[i : i + CHUNK]
        y = expert(x.index_select(0, top_x))
        y.mul_(w[top_x, idx].unsqueeze(-1))
        out.index_add_(0, top_x, y)

The chunk count depends on the data, so dynamo cannot unroll the loop in one graph. The traced copy runs
the body once over all the rows (`top_x = top_x_full`): the loop is replaced by its body, with every
`X[i : i + CHUNK]` read as `X`.

Why that is the same computation (checked on the source, else the loop is left as written and named):
the chunks partition the rows in order; the body's only effect is one accumulation at the chunk's rows
(the expert-loop proof, `hit_expert_loops._check_body`, run on this loop with the sliced names as rows,
which also shows an empty chunk adds nothing); and every value the body computes is computed row by row
(`row_wise`): gathers at the chunk's rows, calls of the experts (modules, taken to map each row alone, the
premise of every expert loop), casts, `unsqueeze` after the rows, and elementwise arithmetic. So each row
gets the same value added whichever chunk holds it; only the order of additions into the output may
differ (float rounding). Every sliced name is an element of the one `torch.where` / `nonzero(as_tuple=True)`
tuple whose first element's length bounds the range, so all have that length.
"""

from __future__ import annotations

import ast
import dataclasses

from .source_ast import NotAdaptable, call_name, stored_names

_SIZE_READS = {"size", "numel"}
# Methods that compute each row from the same row of their operands (dtype casts, elementwise arithmetic,
# in-place forms included); `unsqueeze` and `squeeze` are read for their dim
_ROW_WISE_METHODS = frozenset({
    "to", "float", "half", "bfloat16", "double", "type_as", "contiguous", "mul", "mul_", "div", "div_", "add",
    "add_", "sub", "sub_", "neg", "exp", "sigmoid", "relu", "clamp", "clamp_min",
})


@dataclasses.dataclass(frozen=True)
class ChunkLoop:
    """A loop over chunks of rows: `for var in range(0, len(rows[0]), step)` slicing `rows` by `[var : var + step]`."""

    loop: ast.For
    var: str
    step: ast.expr  # as written: an int literal or a name bound once to one
    rows: tuple[str, ...]  # the names of the one `torch.where` tuple the body slices
    bound_at: int  # the line that bound them


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
    return ChunkLoop(loop, loop.target.id, step, rows, tuples[0].lineno)


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


def row_wise(chunk: ChunkLoop, is_expert) -> None:
    """Every value the body computes is computed row by row from the chunk's rows (see the module's
    docstring); `is_expert(func)` tells a call of an expert. Raises NotAdaptable naming the first that is not."""
    rows = set(_sliced_names(chunk))
    experts = {id(n.func) for stmt in chunk.loop.body for n in ast.walk(stmt)
               if isinstance(n, ast.Call) and is_expert(n.func)}  # `self.experts[e]`: a module, not a gather
    for stmt in chunk.loop.body:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and id(node) not in experts and (
                    not _at_rows(node, rows, chunk)):
                if not (isinstance(node.slice, ast.Slice) and _chunk_slice(node, chunk)):
                    raise NotAdaptable(f"line {node.lineno}: `{ast.unparse(node)[:50]}` in the chunk loop is not "
                                       "a gather at the chunk's rows")
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
                raise NotAdaptable(f"line {node.lineno}: `@` in the chunk loop may mix rows")
            if isinstance(node, ast.Call) and not _row_wise_call(node, rows, is_expert):
                raise NotAdaptable(f"line {node.lineno}: `{ast.unparse(node)[:50]}` in the chunk loop may mix "
                                   "the rows of a chunk")


def inline(chunk: ChunkLoop, parent_body: list[ast.stmt]) -> None:
    """Replace the loop in `parent_body` by its body, each `X[var : var + step]` read as `X`."""
    for sub in _chunk_slices(chunk):
        sub.slice = ast.copy_location(ast.Slice(None, None, None), sub.slice)
    at = next(i for i, stmt in enumerate(parent_body) if stmt is chunk.loop)
    parent_body[at:at + 1] = chunk.loop.body


def _length_read(expr: ast.expr) -> str | None:
    """N of `N.size(0)`, `N.shape[0]`, `len(N)`, `N.numel()`."""
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "len" and len(expr.args) == 1:
        return expr.args[0].id if isinstance(expr.args[0], ast.Name) else None
    if isinstance(expr, ast.Call) and call_name(expr) in _SIZE_READS and isinstance(expr.func, ast.Attribute):
        zero = not expr.args or (len(expr.args) == 1 and isinstance(expr.args[0], ast.Constant) and expr.args[0].value == 0)
        if expr.func.attr == "size" and not expr.args:
            zero = False  # `size()` is a shape, not a length
        receiver = expr.func.value
        return receiver.id if zero and isinstance(receiver, ast.Name) and not expr.keywords else None
    if (isinstance(expr, ast.Subscript) and isinstance(expr.value, ast.Attribute) and expr.value.attr == "shape"
            and isinstance(expr.slice, ast.Constant) and expr.slice.value == 0 and isinstance(expr.value.value, ast.Name)):
        return expr.value.value.id
    return None


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


def _sliced_names(chunk: ChunkLoop) -> list[str]:
    """Names bound in the body to a chunk of the rows (`top_x = top_x_full[i : i + CHUNK]`)."""
    names = []
    for stmt in chunk.loop.body:
        if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
                and isinstance(stmt.value, ast.Subscript) and _chunk_slice(stmt.value, chunk)):
            names.append(stmt.targets[0].id)
    return names


def _at_rows(node: ast.Subscript, rows: set[str], chunk: ChunkLoop) -> bool:
    """`X[r]`, `X[r, s]`, `X[r, s, None]`: the first index a chunk of the rows, the others chunks of the rows,
    `None`, `...`, `:` or an int: a gather of the chunk's rows, each row from its own."""
    indices = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]

    def chunk_of_rows(index: ast.expr) -> bool:
        return (isinstance(index, ast.Name) and index.id in rows) or (
            isinstance(index, ast.Subscript) and _chunk_slice(index, chunk))

    def keeps_rows(index: ast.expr) -> bool:
        return chunk_of_rows(index) or _int_literal(index) is not None or (
            isinstance(index, ast.Constant) and index.value in (None, Ellipsis)) or (
            isinstance(index, ast.Slice) and index.lower is None and index.upper is None and index.step is None)

    return bool(indices) and chunk_of_rows(indices[0]) and all(keeps_rows(i) for i in indices[1:])


def _row_wise_call(call: ast.Call, rows: set[str], is_expert) -> bool:
    name = call_name(call)
    if is_expert(call.func):
        return True
    if name == "index_select":
        dim = call.args[1] if isinstance(call.func, ast.Name) or _torch_function(call) else (call.args[0] if call.args else None)
        return isinstance(dim, ast.Constant) and dim.value == 0
    if name in ("index_add_", "index_put_"):
        return True  # the accumulation, read by the expert-loop proof
    if name == "unsqueeze":  # a new dim after the rows: -1 of a value with rows, or a literal >= 1
        dim = _int_literal(call.args[-1]) if len(call.args) == 1 and not call.keywords else None
        return dim is not None and (dim >= 1 or dim == -1)
    return name in _ROW_WISE_METHODS and isinstance(call.func, ast.Attribute) and not _torch_function(call)


def _int_literal(expr: ast.expr) -> int | None:
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.USub):
        inner = _int_literal(expr.operand)
        return -inner if inner is not None else None
    return expr.value if isinstance(expr, ast.Constant) and type(expr.value) is int else None


def _torch_function(call: ast.Call) -> bool:
    return isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name) and call.func.value.id == "torch"
