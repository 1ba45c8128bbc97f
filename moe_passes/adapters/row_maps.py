"""Whether a value computed from an expert's rows has no rows when those rows are none.

Removing an `if n == 0: continue` skip (adapters/count_loops.py) is exact when what the loop appends for
an expert with no rows has no rows either: `torch.cat` then adds nothing for it. Ops that can break that:
reductions (a sum over no rows is zeros, a mean NaN) unless over a later dim, and ops that move the rows
off dim 0. Modules (the experts) are taken to map rows to rows, as every MLP does; any other call is read
where its code can be found (a function's body, a few calls deep), and anything that cannot be read keeps
the skip, named.
"""

from __future__ import annotations

import ast
import builtins
import functools
import inspect
import types
from collections.abc import Mapping

import torch

from .source_ast import NotAdaptable, call_name, function_source, in_place_name, namespace_of

REDUCTIONS = frozenset({
    "sum", "mean", "prod", "max", "min", "amax", "amin", "aminmax", "std", "var", "std_mean", "var_mean",
    "norm", "logsumexp", "any", "all", "argmax", "argmin", "median", "nanmedian", "nanmean", "nansum",
    "mode", "kthvalue", "quantile", "nanquantile", "count_nonzero", "vector_norm", "matrix_norm",
})
_MOVES_ROWS = frozenset({"einsum", "t", "movedim", "moveaxis", "swapaxes", "swapdims", "pad", "cat", "concat",
                         "concatenate"})
_TRANSPOSED = frozenset({"T", "mT", "H", "mH"})
_MADE = frozenset({"ones", "zeros", "full", "eye", "rand", "randn", "empty", "tensor", "ones_like", "zeros_like",
                   "full_like", "new_ones", "new_zeros", "new_full", "new_tensor"})
_MATMULS = frozenset({"matmul", "mm", "bmm"})
# Builtins that reduce or walk their argument's rows (`sum(y)`, `next(iter(y))`) or look up a callee
# (`getattr(torch, name)`); others (`min(end, total)` of offsets, `len`, `int`) are trusted
_ROW_BUILTINS = frozenset({"sum", "next", "iter", "getattr", "map", "filter", "reversed", "sorted"})
_DEPTH = 3


def row_dropping(value: ast.AST, callees: Callees) -> str | None:
    """The first op in `value` that may leave rows where its input has none, named, or None."""
    for node in ast.walk(value):
        if isinstance(node, ast.Attribute) and node.attr in _TRANSPOSED:
            return f"`.{node.attr}`"
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult) and callees.made(node.left):
            return "`@`"  # `ones(1, n) @ y`: a sum over the rows, one row even for none
        if isinstance(node, ast.Subscript):
            first = node.slice.elts[0] if isinstance(node.slice, ast.Tuple) and node.slice.elts else node.slice
            if isinstance(first, ast.Constant) and first.value is None:
                return "`[None]`"  # a new leading dim
            if _int_literal(first) and not _picks_from_a_container(node.value, callees):
                return f"`[{ast.unparse(first)}]`"  # one row picked: an IndexError where there are none
        if isinstance(node, ast.Call) and (found := callees.call_dropping(node)) is not None:
            return found
    return None


def effect_of(node: ast.AST, callees: Callees) -> str | None:
    """The first construct in `node` that may act beyond the value it computes, named, or None: a store
    into an attribute or an item (of anything but a tensor made in the function), `global`/`nonlocal`, an
    in-place op or a container's mutator, `print` and the like, and calls whose code does any of these or
    cannot be read. Modules are taken to compute their output alone, as for rows (`Callees`)."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Global | ast.Nonlocal):
            return f"`{type(sub).__name__.lower()}`"
        if (isinstance(sub, ast.Attribute | ast.Subscript) and isinstance(sub.ctx, ast.Store | ast.Del)
                and not callees.made(_root(sub))):
            return f"a store into `{ast.unparse(sub)[:40]}`"
        if isinstance(sub, ast.Call) and (found := callees.call_dropping(sub)) is not None:
            return found
    return None


# Builtins whose call acts beyond its value (output, attributes, iterators); others compute a value
_EFFECT_BUILTINS = frozenset({"print", "setattr", "delattr", "exec", "eval", "open", "input", "breakpoint", "next",
                              "__import__", "compile", "globals", "locals", "vars"})
# Methods that change their object: containers' mutators (tensor in-place ops end in "_")
_MUTATORS = frozenset({"append", "extend", "insert", "pop", "remove", "clear", "update", "add", "discard",
                       "setdefault", "popitem", "sort", "reverse", "register_buffer", "register_parameter"})


def _acts_in_place(name: str) -> bool:
    return name in _MUTATORS or in_place_name(name)


def acting_call(statements: list[ast.stmt], skipped: set[int], callees: Callees) -> tuple[ast.Call, str] | None:
    """The first call in `statements` (other than those whose id is in `skipped`, read by the caller) that
    may act beyond its value, with what `callees` (reading for effects) found, or None."""
    for node in (n for stmt in statements for n in ast.walk(stmt)):
        if isinstance(node, ast.Call) and id(node) not in skipped and (found := callees.call_dropping(node)):
            return node, found
    return None


def _int_literal(expr: ast.AST) -> bool:
    """`0`, `-1`: an int index, written as a literal."""
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.USub):
        expr = expr.operand
    return isinstance(expr, ast.Constant) and type(expr.value) is int


def _picks_from_a_container(value: ast.AST, callees: Callees) -> bool:
    """`value[0]` picks no row: a submodule of the instance (`self.experts[0]`), a shape (`y.shape[0]`,
    `y.size()[0]`)."""
    if callees._of_instance(value):
        return True
    if isinstance(value, ast.Attribute) and value.attr == "shape":
        return True
    return call_name(value) == "size"


def _op_dropping(name: str, call: ast.Call | None, made=lambda expr: call_name(expr) in _MADE) -> str | None:
    """`name` when a tensor op of that name (called as `call`, read for its dims) may leave rows where its
    input has none; `made` tells a tensor made in the function (`ones(1, n)`, or a name bound to one)."""
    dims, args = (_dim_arguments(call), call.args) if call is not None else ([], [])
    if name in _MOVES_ROWS:
        return name
    if name in _MATMULS and (call is None or (args and made(args[0]))):
        return name  # `matmul(ones(1, n), y)`
    if name in ("view", "reshape") and args and isinstance(args[0], ast.Constant) and args[0].value != -1:
        return name  # `view(1, -1, h)`: the rows off dim 0
    if name in REDUCTIONS and not _all_later(dims):
        return name
    if name in ("transpose", "swapdims") and not (len(dims) == 2 and _all_later(dims)):
        return name
    if name == "permute" and not (dims and isinstance(dims[0], ast.Constant) and dims[0].value == 0):
        return name
    if name in ("unsqueeze", "stack") and not _all_later(dims[:1]):
        return name
    return None


def _dim_arguments(call: ast.Call) -> list[ast.expr]:
    """The dim arguments of a torch call, spelled as a method (`x.sum(1)`) or a function (`torch.sum(x, 1)`)."""
    func = call.func
    function = isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in ("torch", "F")
    function = function or isinstance(func, ast.Name)  # `mean(y, 0)` imported from torch
    positional = list(call.args[1:] if function else call.args)  # torch.stack(tensors, dim) too
    if call_name(call) == "permute" and len(positional) == 1 and isinstance(positional[0], ast.Tuple | ast.List):
        positional = list(positional[0].elts)
    keywords = [k.value for k in call.keywords if k.arg in ("dim", "dim0", "dim1", "dims", "axis")]
    found = positional + keywords
    if len(found) == 1 and isinstance(found[0], ast.Tuple | ast.List):
        return list(found[0].elts)
    return found


def _all_later(dims: list[ast.expr]) -> bool:
    """Every dim is a literal int >= 1 (a negative one may be dim 0 of a 1-D value); none given is False."""
    return bool(dims) and all(isinstance(d, ast.Constant) and type(d.value) is int and d.value >= 1 for d in dims)


def _root(expr: ast.AST) -> ast.AST:
    """`a` of `a.b[i].c`."""
    while isinstance(expr, ast.Attribute | ast.Subscript):
        expr = expr.value
    return expr


def _torch_namespace(obj: object) -> bool:
    return isinstance(obj, types.ModuleType) and (obj.__name__ == "torch" or obj.__name__.startswith("torch."))


def _is_module_class(obj: object) -> bool:
    return isinstance(obj, type) and issubclass(obj, torch.nn.Module)


class Callees:
    """What the calls of a function stand for, as far as rows go, resolved with the function's scoping:
    its parameters, imports and other local bindings shadow the module's globals and closure (`namespace`).

    Trusted to map rows to rows: a module (the experts' premise, as for `self.experts[i](...)`: an
    attribute of the instance or an item of one, a local bound to such, a loop variable over one, a
    module made in the function, an `nn.Module` of the namespace), a builtin other than those in
    _ROW_BUILTINS, a torch op its name and dims show keeps rows, a tensor method likewise, and a
    function, method of `owner` or lambda whose own body has no op that may drop rows (read the same way,
    a few calls deep). Anything else keeps the skip: a parameter, a callee read from elsewhere, a
    decorated function (its source is the wrapped one), a lambda defined elsewhere, a function without
    readable source."""

    def __init__(self, fn_def: ast.FunctionDef | ast.Lambda, namespace: Mapping[str, object],
                 owner: type | None = None, depth: int = 0, instance: bool = True, trusted: list | None = None,
                 effects: bool = False):
        self.fn_def, self.namespace, self.owner, self.depth = fn_def, namespace, owner, depth
        # what the reading looks for: ops that may leave rows where there are none (False), or effects
        # beyond a call's value (True: `effect_of`)
        self.effects = effects
        # (look-up, key, object) for every object of a namespace or class the reading relied on: the proof
        # holds only while each look-up still gives that object (see still_trusted)
        self.trusted = trusted if trusted is not None else []
        arguments = fn_def.args
        params = [a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs]
        params += [a.arg for a in (arguments.vararg, arguments.kwarg) if a is not None]
        # the first parameter of a method, or of a module function handed the layer (SGLang's
        # `moe_forward_native(layer, ...)`): calls through it are the layer's submodules
        self.this = params[0] if instance and params else None
        self.params = set(params) - {self.this}
        self.local: dict[str, list[ast.AST]] = {}  # name -> the nodes of this scope that bind it
        self.globals: set[str] = set()
        body = fn_def.body if isinstance(fn_def, ast.FunctionDef) else [fn_def.body]
        for node in _own_scope(body):
            for name, binding in _bound_by(node):
                self.local.setdefault(name, []).append(binding)
            if isinstance(node, ast.Global):
                self.globals.update(node.names)

    def call_dropping(self, call: ast.Call) -> str | None:
        func = call.func
        if isinstance(func, ast.Name):
            return self.name_dropping(func.id, call)
        if isinstance(func, ast.Subscript):
            return None if self._of_instance(func) else f"`{ast.unparse(func)[:40]}`, whose callee is not known here"
        if self._named_submodule(func):
            return None  # `getattr(self.experts, f"expert_{i}")(x)`: a submodule, as `self.experts[i](x)`
        if not isinstance(func, ast.Attribute):
            return f"`{ast.unparse(func)[:40]}`, whose callee is not known here"
        root = _root(func)
        if self._of_instance(func):
            if self.effects and _acts_in_place(func.attr):
                return f"`{ast.unparse(func)[:40]}`"  # `self.stats.append(y)`, `self.buffer.add_(y)`
            if isinstance(func.value, ast.Name) and self.owner is not None:
                return self._method_dropping(func.attr)
            return None  # `self.experts[i].forward(x)`, `self.shared.act(x)`: submodules
        if isinstance(root, ast.Name) and root.id not in self.local and root.id not in self.params:
            resolved = self._resolved(func.value)
            if resolved is not _UNKNOWN and not _torch_namespace(resolved) and resolved is not torch.Tensor:
                obj = getattr(resolved, func.attr, _UNKNOWN)  # `helpers.pool(y)`, `Pool.apply(y)`
                if obj is not _UNKNOWN:
                    self.trusted.append((functools.partial(getattr, resolved), func.attr, obj))
                    return self._object_dropping(ast.unparse(func), inspect.getattr_static(resolved, func.attr, obj))
        if self.effects:  # a torch function or a tensor method: in place, or a container's mutator
            return f"`{ast.unparse(func)[:40]}`" if _acts_in_place(func.attr) else None
        found = _op_dropping(func.attr, call, self.made)  # a torch function or a tensor method (`y.mean(0)`)
        return f"`{found}`" if found is not None else None

    def made(self, expr: ast.AST) -> bool:
        """`expr` is a tensor made in the function (`ones(1, n)`, or a name some binding of which is one)."""
        if isinstance(expr, ast.Name) and expr.id in self.local:
            return any(isinstance(b, ast.Assign) and call_name(b.value) in _MADE for b in self.local[expr.id])
        return call_name(expr) in _MADE

    def name_dropping(self, name: str, call: ast.Call | None = None) -> str | None:
        if name in self.params:
            return f"`{name}`, a parameter, which is not known here"
        if name in self.local and name not in self.globals:
            found = (self._binding_dropping(name, binding) for binding in self.local[name])
            return next(filter(None, found), None)
        if name in self.namespace:
            self.trusted.append((self.namespace.get, name, self.namespace[name]))
            return self._object_dropping(name, self.namespace[name], call)
        if isinstance(getattr(builtins, name, None), types.BuiltinFunctionType | type):
            return f"`{name}`" if name in (_EFFECT_BUILTINS if self.effects else _ROW_BUILTINS) else None
        return f"`{name}`, which is not known here"

    def an_expert(self, func: ast.expr) -> bool:
        """`func` is `self.experts[e]`, or a local bound only to such an item: a module of the instance's."""
        if isinstance(func, ast.Subscript):
            return self._of_instance(func)
        if isinstance(func, ast.Name) and func.id in self.local and func.id not in self.params:
            return all(isinstance(b, ast.Assign) and isinstance(b.value, ast.Subscript) and self._of_instance(b.value)
                       for b in self.local[func.id])
        return False

    def _named_submodule(self, expr: ast.AST) -> bool:
        """`getattr(self.<container>, name)` with the builtin getattr and no default (HF Switch
        Transformers' `getattr(self.experts, f"expert_{idx}")`): an item of a container the instance holds,
        as `self.experts[i]` is (`getattr(self, name)`, which may be a method, is not)."""
        return (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "getattr"
                and expr.func.id not in self.local and expr.func.id not in self.params
                and expr.func.id not in self.namespace and len(expr.args) == 2 and not expr.keywords
                and isinstance(expr.args[0], ast.Attribute) and self._of_instance(expr.args[0]))  # not `self`

    def _of_instance(self, expr: ast.AST) -> bool:
        root = _root(expr)
        return self.this is not None and isinstance(root, ast.Name) and root.id == self.this

    def _binding_dropping(self, name: str, binding: ast.AST) -> str | None:
        if isinstance(binding, ast.FunctionDef):
            return self._body_dropping(name, binding, self.namespace)
        if isinstance(binding, ast.For):  # `for expert in self.experts`: an item of the instance's
            iterated = _iterated_for(name, binding.target, binding.iter)
            if iterated is not None and self._of_instance(iterated):
                return None
            return f"`{name}`, a loop variable whose callee is not known here"
        value = binding.value if isinstance(binding, ast.Assign) and len(binding.targets) == 1 else None
        if isinstance(value, ast.Lambda):
            return self._body_dropping(name, value, self.namespace)
        if isinstance(value, ast.Attribute | ast.Subscript) and self._of_instance(value):
            return None  # `expert = self.experts[i]`: as `self.experts[i](x)`
        if isinstance(value, ast.Name):
            return self.name_dropping(value.id)  # `act = F.silu` spelled through another name
        if isinstance(value, ast.Attribute) and not isinstance(_root(value), ast.Name | ast.Attribute):
            return f"`{name}`, a local whose callee is not known here"
        if isinstance(value, ast.Attribute) and (resolved := self._resolved(value)) is not _UNKNOWN:
            return self._object_dropping(name, resolved)  # `pool = torch.mean`
        if isinstance(value, ast.Call) and _is_module_class(self._resolved(value.func)):
            return None  # `act = SiluAndMul()` (SGLang): a module made in the function
        return f"`{name}`, a local whose callee is not known here"

    def resolved(self, expr: ast.expr) -> object | None:
        """The object a global or dotted name of the namespace stands for, or None."""
        found = self._resolved(expr)
        return None if found is _UNKNOWN else found

    def _resolved(self, expr: ast.expr) -> object:
        """The object a global name or a dotted name of the namespace stands for (_UNKNOWN otherwise)."""
        if isinstance(expr, ast.Name):
            if expr.id in self.params or (expr.id in self.local and expr.id not in self.globals):
                return _UNKNOWN
            return self.namespace.get(expr.id, _UNKNOWN)
        if isinstance(expr, ast.Attribute):
            owner = self._resolved(expr.value)
            return _UNKNOWN if owner is _UNKNOWN else getattr(owner, expr.attr, _UNKNOWN)
        return _UNKNOWN

    def _method_dropping(self, attr: str) -> str | None:
        """`self.attr(...)`: a method of the class is read; an attribute the class does not define is the
        instance's (a submodule set in `__init__`: the module premise)."""
        found = inspect.getattr_static(self.owner, attr, _UNKNOWN)
        self.trusted.append((functools.partial(inspect.getattr_static, self.owner), attr, found))
        if found is _UNKNOWN or isinstance(found, torch.nn.Module):
            return None
        if isinstance(found, staticmethod):
            return self._object_dropping(f"self.{attr}", found.__func__)
        if isinstance(found, types.FunctionType):
            return self._function_dropping(f"self.{attr}", found, method=True)
        return f"`self.{attr}`, whose callee is not known here"

    def _object_dropping(self, name: str, obj: object, call: ast.Call | None = None) -> str | None:
        if isinstance(obj, staticmethod | classmethod):
            obj = obj.__func__
        if isinstance(obj, functools.partial):
            obj, call = obj.func, None
        if isinstance(obj, torch.nn.Module) or _is_module_class(obj):
            return None
        if getattr(builtins, getattr(obj, "__name__", ""), None) is obj:
            return f"`{name}`" if obj.__name__ in (_EFFECT_BUILTINS if self.effects else _ROW_BUILTINS) else None
        if any(getattr(owner, getattr(obj, "__name__", ""), None) is obj for owner in (torch, torch.nn.functional)):
            if self.effects:
                return f"`{name}`" if _acts_in_place(obj.__name__) else None
            found = _op_dropping(obj.__name__, call)
            return f"`{name}` (torch's `{found}`)" if found is not None else None
        if isinstance(obj, types.FunctionType):
            return self._function_dropping(name, obj)
        return f"`{name}`, which is not known here"

    def _function_dropping(self, name: str, fn: types.FunctionType, method: bool = False) -> str | None:
        if getattr(fn, "__wrapped__", None) is not None:
            return f"`{name}`, a decorated function, whose wrapper is not read"
        if fn.__name__ == "<lambda>":
            return f"`{name}`, a lambda defined elsewhere, which is not read"
        if self.depth >= _DEPTH:
            return f"`{name}`, a call too deep to read"
        try:
            definition, _ = function_source(fn)
        except (NotAdaptable, SyntaxError):
            return f"`{name}`, whose source cannot be read"
        return self._body_dropping(name, definition, namespace_of(fn), owner=self.owner if method else None)

    def _body_dropping(self, name: str, definition: ast.FunctionDef | ast.Lambda, namespace,
                       owner: type | None = None) -> str | None:
        if self.depth >= _DEPTH:
            return f"`{name}`, a call too deep to read"
        if isinstance(definition, ast.Lambda):  # a lambda of this scope: its free names are ours
            inner = Callees(definition, namespace, None, self.depth + 1, instance=False, trusted=self.trusted,
                            effects=self.effects)
            inner.local = {**self.local, **inner.local}
            inner.params |= self.params
            inner.this = self.this
        else:
            inner = Callees(definition, namespace, owner, self.depth + 1, instance=owner is not None,
                            trusted=self.trusted, effects=self.effects)
        body = definition.body if isinstance(definition, ast.FunctionDef) else [definition.body]
        read = effect_of if self.effects else row_dropping
        found = next(filter(None, (read(stmt, inner) for stmt in body)), None)
        return f"`{name}` ({found} in its body)" if found is not None else None


_UNKNOWN = object()


def _iterated_for(name: str, target: ast.expr, iterated: ast.expr) -> ast.expr | None:
    """What `name` takes its values from in `for <target> in <iterated>`: `self.experts` for `expert` in
    `for expert in self.experts`, `for i, expert in enumerate(self.experts)` and `for expert, rows in
    zip(self.experts, pieces)`; None where that cannot be told."""
    if isinstance(target, ast.Name):
        return iterated if target.id == name else None
    if not isinstance(target, ast.Tuple) or not isinstance(iterated, ast.Call) or iterated.keywords and call_name(
            iterated) == "enumerate":
        return None
    position = next((i for i, t in enumerate(target.elts) if isinstance(t, ast.Name) and t.id == name), None)
    if position is None:
        return None
    if call_name(iterated) == "enumerate" and isinstance(iterated.func, ast.Name) and len(iterated.args) == 1:
        return iterated.args[0] if position == 1 else None
    if call_name(iterated) == "zip" and isinstance(iterated.func, ast.Name) and len(iterated.args) == len(target.elts):
        return iterated.args[position]
    return None


def still_trusted(trusted) -> bool:
    """Every name a proof read still gives the object it read (a helper replaced after the proof, a pool
    patched in, would make it wrong)."""
    return all(look_up(key, _UNKNOWN) is obj for look_up, key, obj in trusted)


def _own_scope(body: list[ast.AST]):
    """The nodes of a scope: nested functions, lambdas and classes are yielded, not entered."""
    stack = list(body)
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            stack.extend(ast.iter_child_nodes(node))


def _bound_by(node: ast.AST) -> list[tuple[str, ast.AST]]:
    """(name, binding node) for each name `node` binds in its scope."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [(node.name, node)]
    if isinstance(node, ast.Import | ast.ImportFrom):
        return [((a.asname or a.name).split(".")[0], node) for a in node.names]
    if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.For | ast.NamedExpr | ast.With):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.With):
            targets = [i.optional_vars for i in node.items if i.optional_vars is not None]
        else:
            targets = [node.target]
        return [(n.id, node) for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)
                and isinstance(n.ctx, ast.Store)]
    if isinstance(node, ast.comprehension):
        return [(n.id, node) for n in ast.walk(node.target) if isinstance(n, ast.Name)]
    if isinstance(node, ast.ExceptHandler) and node.name:
        return [(node.name, node)]
    return []
