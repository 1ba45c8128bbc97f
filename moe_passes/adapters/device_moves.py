"""Modules moved to a device in the forward (`expert.to(device)`): not moved where they already are.

Offloading code moves modules between devices as it runs. st-moe does it for every expert at every
forward, keeping on the CPU the experts a rank does not hold:

    for expert in self.experts:
        expert.to(self.device if expert in keep else "cpu")

Dynamo of torch 2.9 cannot trace `nn.Module.to` (it parses its arguments with
`torch._C._nn._parse_to`, whose result is no tensor; 2.13's dynamo traces it), so the graph breaks at
each such call, once per module moved, and the MoE layer around the loop is split (st-moe: 4 graphs).

Why skipping it is exact: `Module.to(device)` on a module whose parameters and buffers are all on that
device changes nothing (`_apply` puts back each tensor `Tensor.to` returned, which is the tensor
itself). The copy traced for `hpu_moe` calls `moved(module, *args)` for each `X.to(...)` statement
(its result unused: the call is made for its effect on a module). `moved` tests, on values dynamo
knows while tracing and guards on, whether the one argument is a device every tensor of the module
is already on; only then does it skip the call. Any other call (a dtype, a tensor, `non_blocking`, a
device some tensor is not on, a device named without its index, or `X` not a module) is made as
written, and breaks the graph there as it does without hpu_moe.
"""

from __future__ import annotations

import ast
import dis
import types

import torch

from .offset_slices import compile_with_helpers
from .source_ast import Decisions, NotAdaptable, decided, function_source, walk_function

NAME = "device_moves"
_HELPERS = "__moe_passes_device_moves"


def moved(obj, *args, **kwargs):
    """`obj.to(*args, **kwargs)`, or `obj` itself where that call would move nothing: `obj` is a module
    whose class keeps nn.Module's `to` (a module of its own `to`, residency bookkeeping, is called as
    written), the one argument (positional or `device=`) a device, as a string or a torch.device, and
    every parameter and buffer of the module on it."""
    device = args[0] if len(args) == 1 and not kwargs else kwargs["device"] if not args and set(kwargs) == {"device"} else None
    module = isinstance(obj, torch.nn.Module) and type(obj).to is torch.nn.Module.to
    if module and isinstance(device, (str, torch.device)):  # isinstance with a tuple: dynamo 2.9
        target = torch.device(device)
        if all(t.device == target for t in obj.parameters()) and all(t.device == target for t in obj.buffers()):
            return obj
    return obj.to(*args, **kwargs)


class _MoveStatements(ast.NodeTransformer):
    """Each of `statements` (`X.to(...)`) -> `moved(X, ...)`."""

    def __init__(self, helper: str, statements: list[ast.Expr]):
        self.helper = ast.parse(helper, mode="eval").body
        self.statements = {id(node) for node in statements}

    def visit_Expr(self, node: ast.Expr):
        if id(node) not in self.statements:
            return node
        call = node.value
        moved_call = ast.copy_location(ast.Call(self.helper, [call.func.value, *call.args], call.keywords), call)
        return ast.copy_location(ast.Expr(moved_call), node)


def _is_move(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "to"


def discards_a_to_call(code: types.CodeType) -> bool:
    """Cheap bytecode filter: `code` looks up a `to` attribute and drops the result of some call."""
    if "to" not in code.co_names:
        return False
    previous = None
    for instruction in dis.get_instructions(code):
        if instruction.opname == "POP_TOP" and previous is not None and previous.opname.startswith("CALL"):
            return True
        previous = instruction
    return False


def move_statements(fn_def: ast.FunctionDef) -> list[ast.Expr]:
    """The `X.to(...)` statements of the function's own body that move each module of one of the
    instance's containers in turn (`for expert in self.experts: expert.to(...)`, also over a slice of
    it): the offloading construct. Other moves are left as written."""
    this = fn_def.args.args[0].arg if fn_def.args.args else None
    found = []
    for loop in walk_function(fn_def):
        if not isinstance(loop, ast.For) or not isinstance(loop.target, ast.Name) or not _of_instance(loop.iter, this):
            continue
        for node in ast.walk(ast.Module(body=loop.body, type_ignores=[])):
            if (
                isinstance(node, ast.Expr) and _is_move(node.value)
                and isinstance(node.value.func.value, ast.Name) and node.value.func.value.id == loop.target.id
            ):
                found.append(node)
    return found


def _of_instance(expr: ast.AST, this: str | None) -> bool:
    """`self.attr`, or a subscript of it (`self.experts[:n]`)."""
    if isinstance(expr, ast.Subscript):
        expr = expr.value
    return isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id == this


_DECISIONS = Decisions("device_move_copies")  # per class, keyed by (method name, function)


def adaptations_of(cls: type, taken: set[str] = frozenset()) -> dict[str, types.FunctionType]:
    """{method name: the copy to trace under hpu_moe} for `forward` and the methods it names (other than
    `taken`) that move the modules of a container of the instance one by one."""
    forward = getattr(cls.__dict__.get("forward"), "__moe_passes_original__", cls.__dict__.get("forward"))
    reached = {"forward", *getattr(getattr(forward, "__code__", None), "co_names", ())}  # what forward calls
    found = {}
    for name, fn in list(cls.__dict__.items()):
        fn = getattr(fn, "__moe_passes_original__", fn)
        if name in taken or name not in reached or name.startswith("__"):
            continue
        if not isinstance(fn, types.FunctionType) or not discards_a_to_call(fn.__code__):
            continue
        where = f"{cls.__module__}.{cls.__qualname__}.{name}"
        decision = decided(_DECISIONS.of(cls), (name, fn), where, lambda fn=fn: _copy(fn), "device move")
        if isinstance(decision, types.FunctionType):
            found[name] = decision
    return found


def _copy(fn: types.FunctionType) -> types.FunctionType | str:
    if getattr(fn, "__wrapped__", None) is not None:
        raise NotAdaptable(f"{fn.__qualname__} is wrapped by a decorator")
    fn_def, filename = function_source(fn)
    statements = move_statements(fn_def)
    if not statements:
        return "nothing to adapt"
    new_def = _MoveStatements(f"{_HELPERS}.moved", statements).visit(fn_def)
    new_def.decorator_list = []
    return compile_with_helpers(fn, new_def, filename, _HELPERS, types.SimpleNamespace(moved=moved))
