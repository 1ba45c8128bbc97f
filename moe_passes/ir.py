"""The canonical IR the passes read: a functional ATen inference graph traced from dynamo's graph.

Dynamo graphs hold torch-level calls in many spellings (methods, functionals, modules inlined,
in-place updates). Tracing them once with `make_fx` under functionalization gives one spelling:
ATen ops, no mutation, parameters as placeholders in dynamo's order, and fake values with the same
symbolic shapes on every node. Every inner backend accepts such a graph as if dynamo had produced it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator

import torch
import torch.fx.traceback as fx_traceback
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import DataDependentOutputException
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, statically_known_true
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .fx_utils import source_line
from .subclass_inputs import SubclassInputs


def fake_inputs(example_inputs, fake_mode):
    """Fake twins of the backend's example inputs in the compile's fake mode.

    Dynamo records a symbolic context for every tensor it fakified; reusing it keeps the dynamic
    dimensions of the captured graph symbolic here too (the same step AOTAutograd takes).
    """
    context = torch._guards.TracingContext.try_get()
    out = []
    with fake_mode:
        for value in example_inputs:
            if not isinstance(value, torch.Tensor):
                out.append(value)
            elif isinstance(value, torch._subclasses.FakeTensor) and value.fake_mode is fake_mode:
                out.append(value)
            elif context is not None and value in context.tensor_to_context:
                symbolic = context.tensor_to_context[value]
                out.append(
                    fake_mode.from_tensor(value, symbolic_context=symbolic, source=symbolic.tensor_source)
                )
            else:
                out.append(fake_mode.from_tensor(value))
    return out


def to_canonical_aten(gm: torch.fx.GraphModule, example_inputs) -> torch.fx.GraphModule:
    """Trace `gm` to functional ATen with the placeholders of `gm`, one per example input."""
    fake_mode = detect_fake_mode(example_inputs)
    if fake_mode is None:
        fake_mode = torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True)
    args = fake_inputs(example_inputs, fake_mode)
    # Tensor-subclass inputs (DTensor parameters under tensor or expert parallelism) are traced as their
    # inner tensors, the way AOTAutograd desugars them: the canonical graph computes on local shards.
    layout = SubclassInputs.of(args)

    def run(*flat):
        # Running node by node under preserve_node_meta carries dynamo's nn_module_stack and stack
        # traces onto the ATen nodes, which is how reports name the layer each rewrite came from.
        outputs = _CanonicalInterpreter(gm).run(*layout.rebuild(flat))
        layout.check_outputs(outputs)
        return outputs

    in_python = layout.any or makes_subclasses(gm) or uses_functorch_transforms(gm) or mutates_through_custom_ops(gm)
    functionalize = _python_functionalize if in_python else _functorch_functionalize
    depth = _functorch_depth()
    try:
        with fake_mode, fx_traceback.preserve_node_meta(), _data_dependent_shapes_allowed(fake_mode.shape_env):
            traced = make_fx(functionalize(run))(*layout.flatten(args))
    except BaseException:
        # A trace that fails inside a functorch transform can leave its interpreter levels pushed, and
        # dynamo then rejects the frame it is compiling ("Guard failed on the same frame"): undo them
        # so that the fallback to the captured graph really is harmless.
        _restore_functorch_depth(depth)
        raise
    layout.restore_placeholders(traced.graph, args)
    _drop_whole_slices(traced.graph)
    _drop_round_trip_views(traced.graph)
    traced.graph.eliminate_dead_code()
    traced.recompile()
    return traced


_TO_THE_END = 2**63 - 1  # the end a slice written without one gets


def _drop_whole_slices(graph: torch.fx.Graph) -> None:
    """Read `x[:, None]` as `x.unsqueeze(1)` under dynamic shapes: there, `:` reaches the graph as
    `slice(x, 0, 0, 2**63 - 1)`, a view of every element in order, which the finders would have to see
    through one by one. A slice from 0 with step 1 to an end known to be past the size is `x` itself
    (the graph is functional: nothing writes through the view)."""
    for node in graph.find_nodes(op="call_function", target=torch.ops.aten.slice.Tensor):
        if node.kwargs:
            continue
        source, dim, start, end, step = (*node.args, *(0, None, None, 1)[len(node.args) - 1:])
        if isinstance(end, torch.fx.Node):
            end = end.meta.get("val")
        value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor) or start not in (0, None) or step != 1:
            continue
        size = value.shape[dim]
        if end is None or (isinstance(end, int) and end == _TO_THE_END) or (
                isinstance(end, int | torch.SymInt) and statically_known_true(end >= size)):
            node.replace_all_uses_with(source)


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default)


def _drop_round_trip_views(graph: torch.fx.Graph) -> None:
    """Read `t.view(s).view(t.shape)` as t: a store through a flattened view of a buffer (`_setitem`)
    functionalizes to `view(index_put(view(buf, [-1, H]), ...), [B, S, H])`, and the next store flattens
    that again; without the pair, the stores would not be one chain of writes into one buffer. Views
    keep every element in order, so viewing back to the shape t had gives t's values."""
    for node in graph.find_nodes(op="call_function", target=_VIEWS[0]) + [
            n for target in _VIEWS[1:] for n in graph.find_nodes(op="call_function", target=target)]:
        inner = node.args[0]
        if not (isinstance(inner, torch.fx.Node) and inner.op == "call_function" and inner.target in _VIEWS):
            continue
        source = inner.args[0]
        want = node.meta.get("val")
        have = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
        if not (isinstance(want, torch.Tensor) and isinstance(have, torch.Tensor) and want.dim() == have.dim()):
            continue
        if all(statically_known_true(a == b) for a, b in zip(want.shape, have.shape, strict=True)) and want.dtype == have.dtype:
            node.replace_all_uses_with(source)


@contextlib.contextmanager
def _data_dependent_shapes_allowed(shape_env):
    """The frame's ShapeEnv accepting ops with data-dependent output shapes, and tensor values read as
    numbers, while the captured graph is traced again. Dynamo put such an op (`nonzero` of an expert
    loop, `.item()` of a count) in the graph only where it was allowed at that point of its trace; the
    expert-loop adapter allows them after the frame's ShapeEnv was made (and shapes around its loop
    alone), so the ShapeEnv may not allow them by the time the backend runs."""
    settings = getattr(shape_env, "settings", None)
    wanted = ("allow_dynamic_output_shape_ops", "allow_scalar_outputs")
    if settings is None or not dataclasses.is_dataclass(settings) or all(
        getattr(settings, name, True) for name in wanted
    ):
        yield
        return
    shape_env.settings = dataclasses.replace(settings, **{name: True for name in wanted if hasattr(settings, name)})
    try:
        yield
    finally:
        shape_env.settings = settings


def _one_hot(ids: torch.Tensor, num_classes: int = -1) -> torch.Tensor:
    """one_hot with a known class count as `ids[..., None] == arange(n)`: what newer torch traces it to.

    Older torch (2.9) runs its C++ one_hot under fake tensors with data-dependent range checks, which
    fail under symbolic shapes; the comparison form computes the same for every valid id.
    """
    if num_classes < 0:
        return torch.nn.functional.one_hot(ids, num_classes)
    return (ids.unsqueeze(-1) == torch.arange(num_classes, device=ids.device)).to(torch.int64)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear of rows with a data-dependent count and more than two dims (`x[idx]` for an [n, 1] column
    of indices) as linear of the flattened rows, viewed back: the same values and ATen ops (view, mm,
    view). Older torch (2.9) reads the input's numel() in its C++ linear, which fails for such sizes."""
    if x.dim() <= 2 or not free_unbacked_symbols(x.shape):
        return torch.nn.functional.linear(x, weight, bias)
    rows = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), weight, bias)
    return rows.view(*x.shape[:-1], rows.shape[-1])


def _matmul(a, b, **kwargs):
    """matmul of rows with a data-dependent count and more than two dims by a matrix, as mm of the
    flattened rows viewed back: what matmul itself does for these shapes (fold, mm, view), spelled so
    that older torch (2.9), whose C++ matmul reads numel() there, can trace it (Megatron's legacy
    `SwitchMLP` feeds its experts `x[nonzero]` rows of [n, 1, h])."""
    if kwargs or not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() > 2
                      and b.dim() == 2 and free_unbacked_symbols(a.shape)):
        return torch.matmul(a, b, **kwargs)  # `out=` included, as written
    return torch.mm(a.reshape(-1, a.shape[-1]), b).view(*a.shape[:-1], b.shape[-1])


def _leading_mask(x, index) -> int:
    """d when `index` is a boolean mask over x's first d >= 2 dims (`x[mask]`, mask [B, S] on [B, S, H]);
    else 0."""
    if not (isinstance(x, torch.Tensor) and isinstance(index, torch.Tensor) and index.dtype == torch.bool):
        return 0
    d = index.dim()
    return d if 2 <= d <= x.dim() and all(statically_known_true(a == b) for a, b in zip(index.shape, x.shape[:d], strict=True)) else 0


def _getitem(x, index):
    """`x[mask]` with a mask over several leading dims as the same rows of x flattened there
    (`x.flatten(0, d - 1)[mask.flatten()]`: row-major order both ways), the one-dim mask the finders read."""
    d = _leading_mask(x, index)
    if d:
        return x.flatten(0, d - 1)[index.flatten()]
    return operator.getitem(x, index)


def _setitem(x, index, value):
    """`x[mask] = v` with a mask over several leading dims, written through the flattened view of x (the
    same elements, in the same order, as `_getitem` reads)."""
    d = _leading_mask(x, index)
    if d and _surely_contiguous(x):  # else no view may flatten those dims: stored as written
        x.view(-1, *x.shape[d:])[index.flatten()] = value
        return None
    return operator.setitem(x, index, value)


def _surely_contiguous(x: torch.Tensor) -> bool:
    """x is contiguous, decided without guarding where a size made from data leaves it open (then False:
    the store is traced as written)."""
    try:
        flag = x.is_contiguous()
    except Exception:  # noqa: BLE001 - a data-dependent guard on this torch: undecided
        return False
    if isinstance(flag, torch.SymBool):
        try:
            from torch.fx.experimental.symbolic_shapes import guard_or_false
        except ImportError:
            return False
        return guard_or_false(flag)
    return bool(flag)


def _no_mode_change(*_args):
    """`torch.inference_mode(...)` entered or left inside the graph (torch 2.9's dynamo records the switch
    as calls): the canonical trace computes the same values without it, and switching it inside functorch's
    functionalization breaks functorch's layer stack (an internal assert once the backend returns)."""
    return None


def _in_place(method: str, fallback):
    """`a op= b` on a tensor as its in-place ATen method (`|=` -> `bitwise_or_`): the `__ior__` family
    are ATen ops functionalization does not take (their output aliases the input)."""

    def run(a, b):
        return getattr(a, method)(b) if isinstance(a, torch.Tensor) else fallback(a, b)

    return run


_TRACED_AS = {torch._C._nn.one_hot: _one_hot, torch.nn.functional.one_hot: _one_hot,
              torch._C._nn.linear: _linear, torch.nn.functional.linear: _linear,
              torch.matmul: _matmul, operator.matmul: _matmul,
              operator.getitem: _getitem, operator.setitem: _setitem}
_TRACED_AS.update({
    operator.ior: _in_place("bitwise_or_", operator.ior),
    operator.iand: _in_place("bitwise_and_", operator.iand),
    operator.ixor: _in_place("bitwise_xor_", operator.ixor),
    operator.ilshift: _in_place("bitwise_left_shift_", operator.ilshift),
    operator.irshift: _in_place("bitwise_right_shift_", operator.irshift),
})
_TRACED_AS.update(
    {getattr(torch.autograd.grad_mode, name): _no_mode_change for name in ("_enter_inference_mode", "_exit_inference_mode")
     if hasattr(torch.autograd.grad_mode, name)}
)


class UntraceableConstruct(Exception):
    """A node of the captured graph that the canonical trace could not run (a construct of the user's
    code, e.g. a DTensor op on data-dependent sizes), named as the user wrote it."""

    def __init__(self, node: torch.fx.Node, cause: BaseException):
        self.construct = construct_name(node)
        where = source_line(node)
        self.where = f" at {where}" if where else ""
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        self.cause = f"{type(cause).__name__}: {first}"
        super().__init__(f"the canonical trace cannot follow {self.construct}{self.where} ({self.cause})")

    def __str__(self) -> str:  # the interpreter appends its node dump to args; the message stays ours
        return f"the canonical trace cannot follow {self.construct}{self.where} ({self.cause})"


def construct_name(node: torch.fx.Node) -> str:
    """`torch.distributed.tensor._api.from_local`, `.clamp_()`, `Linear` as the captured graph calls it."""
    if node.op == "call_method":
        return f"`.{node.target}()`"
    if node.op == "call_module":
        return f"module `{node.target}`"
    target = node.target
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)
    module = getattr(target, "__module__", None)
    return f"`{module}.{name}`" if module and not isinstance(target, torch._ops.OpOverload) else f"`{name}`"


class _CanonicalInterpreter(torch.fx.Interpreter):
    """Runs the captured graph op by op, with the few ops older torch cannot trace symbolically swapped."""

    def call_function(self, target, args, kwargs):
        return super().call_function(_TRACED_AS.get(target, target), args, kwargs)

    def run_node(self, n):
        try:
            return super().run_node(n)
        except (UntraceableConstruct, DataDependentOutputException):
            raise  # already named, or reported as a data-dependent read by the backend
        except Exception as error:  # noqa: BLE001 - named after the node, then handled by the backend
            raise UntraceableConstruct(n, error) from error


def makes_subclasses(gm: torch.fx.GraphModule) -> bool:
    """Whether the graph computes with tensor subclasses (`DTensor.from_local` on a plain input, under
    tensor or expert parallelism). Their constructors are autograd.Functions without `setup_context`,
    which functorch's functionalize transform rejects; the Python functionalization traces them."""
    return any(is_traceable_wrapper_subclass(node.meta.get("example_value")) for node in gm.graph.nodes)


def uses_functorch_transforms(gm: torch.fx.GraphModule) -> bool:
    """Whether dynamo inlined a torch.func transform (vmap: `_vmap_increment_nesting`, `_add_batch_dim`)
    into the graph, as transformers' Mamba scans (`associative_scan` in generic mode) do.

    functorch's C++ functionalize transform cannot sit under such levels (an internal assert), so these
    graphs are functionalized in Python, the way AOTAutograd does it.
    """
    return any(
        node.op == "call_function" and getattr(node.target, "__module__", "") == "torch._functorch.predispatch"
        for node in gm.graph.nodes
    )


def mutates_through_custom_ops(gm: torch.fx.GraphModule) -> bool:
    """Whether the graph calls a non-ATen op that writes into an argument (vLLM's CPU kernel
    `_C::cpu_fused_moe(Tensor(a0!) output, ...) -> ()`, in-place custom kernels of other libraries).

    functorch's C++ functionalize rejects such ops; the Python functionalization wraps them in
    `auto_functionalized`, as AOTAutograd does, so the graph can still be read (and, unfused, it is
    handed on as captured).
    """
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverloadPacket | torch._ops.OpOverload):
            continue
        overloads = [target] if isinstance(target, torch._ops.OpOverload) else [
            getattr(target, name) for name in target.overloads()
        ]
        schemas = [overload._schema for overload in overloads]
        if any(s.is_mutable and s.name.split("::")[0] not in ("aten", "prims") for s in schemas):
            return True
    return False


def _functorch_functionalize(run):
    return torch.func.functionalize(run, remove="mutations")


def _python_functionalize(run):
    """`torch.func.functionalize(run, remove="mutations")` done by FunctionalTensorMode: mutations become
    functional ops, and an input that was mutated is written back with one `copy_` at the end."""
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    def unwrap(value):
        if not isinstance(value, FunctionalTensor):
            return value
        torch._sync(value)
        return torch._from_functional_tensor(value.elem)

    def functional(*flat):
        exclude = torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize))
        with exclude, FunctionalTensorMode():
            wrapped = [FunctionalTensor.to_functional(v) if isinstance(v, torch.Tensor) else v for v in flat]
            outputs = torch.utils._pytree.tree_map_only(FunctionalTensor, unwrap, run(*wrapped))
            for original, value in zip(flat, wrapped, strict=True):
                if isinstance(value, FunctionalTensor):
                    torch._sync(value)
                    if torch._functionalize_has_data_mutation(value.elem):
                        original.copy_(torch._from_functional_tensor(value.elem))
        return outputs

    return functional


def _functorch_depth() -> int | None:
    get_depth = getattr(torch._C._functorch, "get_dynamic_layer_stack_depth", None)
    return get_depth() if get_depth is not None else None


def _restore_functorch_depth(depth: int | None) -> None:
    undo = getattr(torch._C._functorch, "pop_dynamic_layer_stack_and_undo_to_depth", None)
    if depth is not None and undo is not None:
        undo(depth)


def views_to_reshapes(gm: torch.fx.GraphModule) -> None:
    """Turn `view`s into `reshape`s before the graph is handed on.

    The inner backend re-traces the graph with its own decompositions, which may lay intermediates out
    with other strides than this trace saw; a `view` recorded here can then be impossible there, while
    a `reshape` means the same values and copies only when it must.
    """
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (
            torch.ops.aten.view.default,
            torch.ops.aten._unsafe_view.default,
        ):
            node.target = torch.ops.aten.reshape.default
    gm.recompile()


def differentiable_copies(gm: torch.fx.GraphModule) -> int:
    """Write functional `copy(dst, src)` as `expand_as(src cast to dst's dtype, dst)`; returns how many.

    Functionalization turns `dst[...].copy_(src)` into `copy` + `slice_scatter`, and autograd has no
    formula for the functional `copy`: a training graph handed on with one fails in AOTAutograd. Its
    value is src broadcast to dst's shape in dst's dtype, and it takes no gradient from dst's values,
    which is exactly what the replacement computes.
    """
    rewritten = 0
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.copy.default):
        dst, src = node.args[0], node.args[1]
        dst_val, src_val = dst.meta.get("val"), getattr(src, "meta", {}).get("val")
        if node.kwargs.get("non_blocking") or not isinstance(dst_val, torch.Tensor) or not isinstance(src_val, torch.Tensor):
            continue
        if dst_val.device != src_val.device:
            continue
        with gm.graph.inserting_before(node):
            value = src
            if src_val.dtype != dst_val.dtype:
                value = gm.graph.call_function(torch.ops.aten._to_copy.default, (src,), {"dtype": dst_val.dtype})
            value = gm.graph.call_function(torch.ops.aten.expand_as.default, (value, dst))
        value.meta.update(node.meta)
        node.replace_all_uses_with(value)
        gm.graph.erase_node(node)
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten


def carry_dynamo_metadata(captured: torch.fx.GraphModule, canonical: torch.fx.GraphModule) -> bool:
    """Give `canonical` the metadata dynamo attached to `captured`, so AOTAutograd treats it as dynamo's.

    AOTAutograd reads which inputs are parameters (static addresses) from that metadata; without it,
    inductor's CUDA graphs (mode="reduce-overhead") copy every weight into the graph on each replay.
    Carried only when it matches one to one (same placeholders, no new parameters or buffers);
    returns whether it was carried.
    """
    if "dynamo_compile_id" not in captured.meta or not hasattr(captured, "_param_name_to_source"):
        return False
    old = captured.graph.find_nodes(op="placeholder")
    new = canonical.graph.find_nodes(op="placeholder")
    named = {name for name, _ in canonical.named_parameters(remove_duplicate=False)}
    named |= {name for name, _ in canonical.named_buffers(remove_duplicate=False)}
    if len(old) != len(new) or not named <= set(captured._param_name_to_source):
        return False
    if not all(hasattr(node, "_dynamo_source") for node in old):
        return False
    canonical.meta["dynamo_compile_id"] = captured.meta["dynamo_compile_id"]
    canonical._param_name_to_source = captured._param_name_to_source
    for before, after in zip(old, new, strict=True):
        after._dynamo_source = before._dynamo_source
        if "tensor_dict" in before.meta:
            after.meta["tensor_dict"] = before.meta["tensor_dict"]
    return True

