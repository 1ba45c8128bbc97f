"""Reading a method's source for the loop adapters: the parsed definition and small AST queries."""

from __future__ import annotations

import ast
import collections
import inspect
import logging
import textwrap
import weakref

log = logging.getLogger(__name__)

# Methods that view, cast or copy a tensor without changing which values it holds where.
VIEW_METHODS = {"permute", "transpose", "view", "reshape", "contiguous", "to", "int", "long", "bool", "float"}


class NotAdaptable(Exception):
    """The source does not prove the loop equivalent; the message names the construct and its line."""


def function_source(fn) -> tuple[ast.FunctionDef, str]:
    """The function's definition (line numbers as in its file) and the file's name."""
    try:
        lines, first = inspect.getsourcelines(fn)
        filename = inspect.getsourcefile(fn) or fn.__code__.co_filename
    except (OSError, TypeError) as exc:
        raise NotAdaptable(f"source of {fn.__qualname__} is not available ({exc})") from None
    tree = ast.parse(textwrap.dedent("".join(lines)))
    fn_def = tree.body[0]
    if not isinstance(fn_def, ast.FunctionDef):
        raise NotAdaptable(f"{fn.__qualname__} is not a plain function definition")
    ast.increment_lineno(tree, first - 1)
    return fn_def, filename


def namespace_of(fn) -> collections.ChainMap:
    """What the free names of `fn` stand for: its closure's cells (an empty cell, a name not yet bound, is
    left out) over its module's globals, read live (a global replaced later is seen). A decorated
    function's are those of the function it wraps, whose source `function_source` reads."""
    fn = inspect.unwrap(fn)
    cells = {}
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
        try:
            cells[name] = cell.cell_contents
        except ValueError:
            pass
    return collections.ChainMap(cells, getattr(fn, "__globals__", {}))


def walk_function(fn_def: ast.FunctionDef):
    """Nodes of the function body, not descending into nested functions, lambdas or classes."""
    stack = list(fn_def.body)
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
                stack.append(child)


def stored_names(target: ast.AST) -> list[str]:
    """The names an assignment target binds; NotAdaptable for attribute or subscript targets."""
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Tuple | ast.List):
        return [n for element in target.elts for n in stored_names(element)]
    if isinstance(target, ast.Starred):
        return stored_names(target.value)
    raise NotAdaptable(f"line {target.lineno}: assignment to `{ast.unparse(target)[:40]}` (only names allowed)")


def bindings(fn_def: ast.FunctionDef) -> dict[str, list[ast.AST]]:
    """{name: every statement of the function that binds it}."""
    found: dict[str, list[ast.AST]] = {}
    for node in walk_function(fn_def):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                for name in names_in_target(target):
                    found.setdefault(name, []).append(node)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign | ast.For | ast.With | ast.NamedExpr):
            targets = [node.target] if not isinstance(node, ast.With) else [
                item.optional_vars for item in node.items if item.optional_vars is not None
            ]
            for target in targets:
                for name in names_in_target(target):
                    found.setdefault(name, []).append(node)
    return found


def names_in_target(target: ast.AST) -> list[str]:
    return [n.id for n in ast.walk(target) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]


def span(node: ast.AST) -> tuple[int, int, int, int]:
    """Where `node` stands in the source (line, column, end line, end column): chained calls share their
    start, so the end tells `a.bincount()` from `a.bincount().cumsum(0)`."""
    return node.lineno, node.col_offset, node.end_lineno, node.end_col_offset


def call_name(call: ast.AST) -> str | None:
    """`torch.nn.functional.one_hot(...)` -> "one_hot"; `x.nonzero()` -> "nonzero"."""
    if not isinstance(call, ast.Call):
        return None
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


# Tensor methods and torch functions whose result is boolean whatever their operands hold
_BOOLEAN_RESULTS = {"eq", "ne", "lt", "le", "gt", "ge", "any", "all", "isnan", "isinf", "isfinite", "isin",
                    "logical_and", "logical_or", "logical_not", "logical_xor"}


def boolean_by_construction(expr: ast.AST) -> bool:
    """A tensor expression whose values are booleans whatever its operands hold: a comparison, `&`, `|`,
    `^` or `~` of such expressions, `.bool()`, or a comparing or reducing call (`M.any(-1)`, `x.eq(e)`)."""
    if isinstance(expr, ast.Compare):
        return True
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.BitAnd | ast.BitOr | ast.BitXor):
        return boolean_by_construction(expr.left) and boolean_by_construction(expr.right)
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Invert):
        return boolean_by_construction(expr.operand)
    if not isinstance(expr, ast.Call) or not isinstance(expr.func, ast.Attribute):
        return False
    return (expr.func.attr == "bool" and not expr.args) or expr.func.attr in _BOOLEAN_RESULTS


def sized_name(test: ast.AST) -> str | None:
    """r for `r.numel()`, `len(r)` or `r.shape[0]`, r a name; else None."""
    if call_name(test) == "numel" and isinstance(test.func, ast.Attribute) and not test.args:
        subject = test.func.value
    elif call_name(test) == "len" and isinstance(test.func, ast.Name) and len(test.args) == 1:
        subject = test.args[0]
    elif (
        isinstance(test, ast.Subscript)
        and isinstance(test.value, ast.Attribute)
        and test.value.attr == "shape"
        and isinstance(test.slice, ast.Constant)
        and test.slice.value == 0
    ):
        subject = test.value.value
    else:
        return None
    return subject.id if isinstance(subject, ast.Name) else None


def skip_test(stmt: ast.stmt) -> ast.expr | None:
    """T for `if T: continue` with no other statement and no else (a skip of one iteration), else None."""
    if not isinstance(stmt, ast.If) or stmt.orelse or len(stmt.body) != 1 or not isinstance(stmt.body[0], ast.Continue):
        return None
    return stmt.test


def number_read(expr: ast.AST) -> ast.AST | None:
    """X for `X.item()` or `int(X)`: a tensor's value read on the host as a Python number; else None."""
    if call_name(expr) == "item" and isinstance(expr.func, ast.Attribute) and not expr.args and not expr.keywords:
        return expr.func.value
    if call_name(expr) == "int" and isinstance(expr.func, ast.Name) and len(expr.args) == 1 and not expr.keywords:
        return expr.args[0]
    return None


def in_place_name(method: str) -> bool:
    """`add_`, `mul_`: a tensor method that changes its tensor (dunders aside)."""
    return method.endswith("_") and not method.startswith("__")


def changes_in_place(node: ast.AST, name: str) -> bool:
    """`name[...] = v`, `name[...] += v` or `name.op_(...)`: the tensor bound to `name` changed where it is."""
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
        return isinstance(node.value, ast.Name) and node.value.id == name
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
            and node.func.value.id == name and in_place_name(node.func.attr))


_MOVES = {"to", "cpu", "cuda", "contiguous"}


def moves_itself(stmt: ast.stmt) -> bool:
    """`N = N.to(...)` (or `.cpu()`, `.cuda()`, `.contiguous()`): a device move or layout change that keeps
    N's values (LLM Foundry moves its accumulator and weights to each expert's device in the loop)."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        return False
    value = stmt.value
    return (call_name(value) in _MOVES and isinstance(value.func, ast.Attribute)
            and isinstance(value.func.value, ast.Name) and value.func.value.id == stmt.targets[0].id
            and not any(isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value not in ("cpu", "cuda")
                        for a in value.args)
            and not any(k.arg == "dtype" for k in value.keywords))


def loads(node: ast.AST) -> set[str]:
    """Names read anywhere in `node`."""
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def loop_index(loop: ast.For) -> str | None:
    """`e` of `for e in ...` and of `for e, x in enumerate(...)`."""
    if isinstance(loop.target, ast.Name):
        return loop.target.id
    if call_name(loop.iter) == "enumerate" and isinstance(loop.target, ast.Tuple) and loop.target.elts:
        first = loop.target.elts[0]
        return first.id if isinstance(first, ast.Name) else None
    return None


def strip_methods(expr: ast.AST, methods) -> ast.AST:
    """`expr` without the trailing calls of `methods` on it: N for `N.view(...).cpu().tolist()`."""
    while isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr in methods:
        expr = expr.func.value
    return expr


def viewed_name(expr: ast.AST, methods=VIEW_METHODS) -> str | None:
    """N for `N`, `N.view(...)`, `N.permute(...).contiguous()`, ...: the name whose values `expr` holds."""
    expr = strip_methods(expr, methods)
    return expr.id if isinstance(expr, ast.Name) else None


def defining_bindings(name: str, assignments: dict) -> list | None:
    """The bindings of `name` that decide what it holds: all but re-bindings that view the name itself
    (`m = m.permute(2, 1, 0)`). None where a binding is not a plain assignment, or where only such
    re-bindings exist (the name is then a parameter or a global: nothing is known of it)."""
    bound = assignments.get(name, [])
    if not bound or not all(isinstance(b, ast.Assign) and len(b.targets) == 1 for b in bound):
        return None
    defining = [b for b in bound if viewed_name(b.value, VIEW_METHODS | {"cpu"}) != name]
    return defining or None


def adapted_callees(fn, wanted, traced_copy) -> dict:
    """{global name: traced copy} for the plain functions `fn` calls by a global name of its module that
    `wanted` (a cheap filter) flags and `traced_copy` adapts (None: left as written)."""
    found = {}
    for name in fn.__code__.co_names:
        callee = fn.__globals__.get(name)
        if wanted(callee) and (traced := traced_copy(callee)) is not None:
            found[name] = traced
    return found


class Decisions:
    """Decisions about a class's or a function's code, kept on that class or function (in its `__dict__`)
    so that they are freed with it. A module-level table would keep alive every class and function
    discovery looked at: a traced copy refers to its original (`__wrapped__`) and, through the `__class__`
    cell of a method that calls `super()`, to its class."""

    def __init__(self, name: str):
        self._attribute = f"__moe_passes_{name}__"
        self._owners: weakref.WeakSet = weakref.WeakSet()

    def of(self, owner) -> dict:
        """The decisions about `owner` (a class or a function), empty at first."""
        table = vars(owner).get(self._attribute)
        if table is None:
            table = {}
            try:
                setattr(owner, self._attribute, table)
                self._owners.add(owner)
            except Exception:  # noqa: BLE001 - takes no attributes (a metaclass may refuse): decided again each look
                pass
        return table

    def get(self, owner, key, default=None):
        """The decision kept about `owner` under `key`, without making a table."""
        return vars(owner).get(self._attribute, {}).get(key, default)

    def items(self):
        """(owner, key, decision) for every decision kept on a live owner."""
        for owner in list(self._owners):
            for key, decision in list(vars(owner).get(self._attribute, {}).items()):
                yield owner, key, decision


def decided(cache: dict, key, where: str, decide, kind: str):
    """`cache[key]`, from `decide()` the first time: its result, or the reason (naming `where`) when the
    source does not prove the adaptation or cannot be read. Never raises: unusual source is left as
    written and the compile goes on."""
    if key not in cache:
        try:
            cache[key] = decide()
        except NotAdaptable as exc:
            cache[key] = f"{where}: {exc}"
            log.info("%s not adapted: %s", kind, cache[key])
        except Exception as exc:  # noqa: BLE001 - unusual source: leave it as written, never fail the compile
            cache[key] = f"{where}: source not understood ({type(exc).__name__}: {exc})"
            log.info("%s not adapted: %s", kind, cache[key])
    return cache[key]


def placed(source: str, at: ast.AST, expression: bool = False) -> ast.AST:
    """`source` parsed (a statement, or an expression), every node of it reported at `at`'s line (code a
    traced copy adds)."""
    parsed = ast.parse(source, mode="eval").body if expression else ast.parse(source).body[0]
    for part in ast.walk(parsed):
        if isinstance(part, ast.expr | ast.stmt):
            ast.copy_location(part, at)
    return parsed
