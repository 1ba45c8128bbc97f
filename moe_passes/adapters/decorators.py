"""Decorated methods: the function a decorator's wrapper holds, and a copy of the wrapper holding another.

A decorator's wrapper made with `functools.wraps` names what it wraps (`__wrapped__`) and, being a
closure, holds it in a cell: torch's `@no_grad()` (`with ctx(): return func(*args, **kwargs)`),
transformers 5's `@use_experts_implementation` (it hands the method to the config's experts interface
and calls what comes back), a user's timing or logging decorator. The expert-loop proof reads the
function at the end of that chain; what hpu_moe traces is a copy of the outermost wrapper in which the
one cell holding the next level holds its copy instead, down to the adapted function. Each wrapper's own
code runs as written, and calls the copy where it called the original.

That is the same computation only where a wrapper does nothing with the function but call it: a wrapper
that keys a registry by it, reads its attributes or its code, or hands it to a function whose result it
does not simply call, would see the copy, another object. Each wrapper's source is read for that (every
read of the cell is a call of it, or an argument of a call whose result is called, directly or through
a name bound once), and a wrapper that does anything else is named and left as written, as is a method
excluded from tracing (`torch.compiler.disable`). A cell rebound after the decision (`nonlocal`) makes
hpu_moe trace the wrapper as written from the next trace on; a frame compiled before keeps the copy
until `torch._dynamo.reset()` (dynamo guards the copy's cells, not the original's).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types
from collections.abc import Callable

import torch

from .source_ast import NotAdaptable


def decorated(fn: types.FunctionType) -> tuple[types.FunctionType, Callable[[types.FunctionType], types.FunctionType]]:
    """(the function that `fn` runs under its decorators, how to make what hpu_moe traces for `fn` from a
    copy of that function). An undecorated function gives itself and the identity."""
    levels: list[tuple[types.FunctionType, int]] = []  # (wrapper, index of the cell holding the next level)
    level = fn
    while (inner := getattr(level, "__wrapped__", None)) is not None:
        name = getattr(level, "__qualname__", repr(level))
        if getattr(level, "_torchdynamo_disable", False):
            raise NotAdaptable(f"{name} is excluded from tracing (torch.compiler.disable)")
        if not isinstance(level, types.FunctionType) or not isinstance(inner, types.FunctionType):
            raise NotAdaptable(f"{name} is wrapped by a decorator that is no plain function, or wraps none")
        cells = [i for i, cell in enumerate(level.__closure__ or ()) if _contents(cell) is inner]
        if len(cells) != 1:
            raise NotAdaptable(f"{name}: its decorator's wrapper holds the function it wraps in {len(cells)} "
                               "closure cells, not one")
        _check_only_called(level, level.__code__.co_freevars[cells[0]])
        levels.append((level, cells[0]))
        level = inner
    if not levels:
        return fn, lambda copy: copy
    if getattr(level, "_torchdynamo_disable", False):
        raise NotAdaptable(f"{level.__qualname__} is excluded from tracing (torch.compiler.disable)")
    held_then = [(wrapper.__closure__[index], _contents(wrapper.__closure__[index])) for wrapper, index in levels]

    def rewrap(copy: types.FunctionType) -> types.FunctionType:
        outer = copy
        for wrapper, index in reversed(levels):
            outer = _holding(wrapper, index, outer)

        @torch.compiler.assume_constant_result
        def still_held() -> bool:
            """Runs in plain Python while dynamo traces (a trace-time constant)."""
            return all(_contents(cell) is value for cell, value in held_then)

        def traced(*args, **kwargs):
            return (outer if still_held() else fn)(*args, **kwargs)

        traced.__name__, traced.__qualname__, traced.__module__ = fn.__name__, fn.__qualname__, fn.__module__
        return traced

    return level, rewrap


def _holding(wrapper: types.FunctionType, index: int, value: types.FunctionType) -> types.FunctionType:
    """`wrapper` with its cell `index` holding `value` (its other cells shared)."""
    closure = tuple(types.CellType(value) if i == index else cell for i, cell in enumerate(wrapper.__closure__))
    copy = types.FunctionType(wrapper.__code__, wrapper.__globals__, wrapper.__name__, wrapper.__defaults__, closure)
    copy.__kwdefaults__ = dict(wrapper.__kwdefaults__) if wrapper.__kwdefaults__ else None
    copy.__dict__.update(wrapper.__dict__)
    copy.__qualname__, copy.__doc__, copy.__module__ = wrapper.__qualname__, wrapper.__doc__, wrapper.__module__
    return copy


def _contents(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _check_only_called(wrapper: types.FunctionType, name: str) -> None:
    """Every read of `name` in the wrapper's body is a call of it, or an argument of a call whose result
    is called (directly, or through a name bound once and only called); else NotAdaptable naming it."""
    try:
        lines, first = inspect.getsourcelines(wrapper.__code__)
    except (OSError, TypeError) as exc:
        raise NotAdaptable(f"source of the decorator's wrapper {wrapper.__qualname__} is not available ({exc})") from None
    tree = ast.parse(textwrap.dedent("".join(lines)))
    wrapper_def = tree.body[0]
    if not isinstance(wrapper_def, ast.FunctionDef | ast.AsyncFunctionDef):
        raise NotAdaptable(f"the decorator's wrapper {wrapper.__qualname__} is not a plain function definition")
    body = ast.Module(body=wrapper_def.body, type_ignores=[])
    where = getattr(wrapper.__code__, "co_qualname", wrapper.__code__.co_name)  # not the name `wraps` copied
    parents = {id(child): node for node in ast.walk(body) for child in ast.iter_child_nodes(node)}
    bound: dict[str, list[ast.AST]] = {}
    for node in ast.walk(body):
        for target in node.targets if isinstance(node, ast.Assign) else ():
            for n in ast.walk(target):
                if isinstance(n, ast.Name):
                    bound.setdefault(n.id, []).append(node)

    def called(node: ast.AST) -> bool:
        parent = parents.get(id(node))
        return isinstance(parent, ast.Call) and parent.func is node

    def only_called(result: ast.Call) -> bool:
        if called(result):
            return True
        parent = parents.get(id(result))
        if not (isinstance(parent, ast.Assign) and len(parent.targets) == 1 and isinstance(parent.targets[0], ast.Name)):
            return False
        local = parent.targets[0].id
        reads = [n for n in ast.walk(body) if isinstance(n, ast.Name) and n.id == local and isinstance(n.ctx, ast.Load)]
        return len(bound.get(local, [])) == 1 and all(called(n) for n in reads)

    for node in ast.walk(body):
        if not (isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Load)) or called(node):
            continue
        parent = parents.get(id(node))
        if isinstance(parent, ast.keyword):
            parent = parents.get(id(parent))
        if isinstance(parent, ast.Call) and parent.func is not node and only_called(parent):
            continue
        line = first + node.lineno - 1
        raise NotAdaptable(f"line {line}: the decorator's wrapper {where} reads `{name}`, the function "
                           f"it wraps, other than by calling it (`{ast.unparse(parent or node)[:60]}`)")
