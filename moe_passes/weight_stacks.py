"""Per-expert weights for the portable op: the compiled graph takes them as stacks, or they are moved
into one storage, and the call becomes the overload that takes stacks. One concern, one module, one
entry point: `stack_weights`, run once by the backend's "stack weights" pass (backend_passes.py).

    stack_weights(graph, example_inputs, take_inputs) -> Stacking
        take_inputs (inductor, eager, aot_eager): the graph takes the lists as stacked inputs
            (`take_stacks`), and the callable handed back finds the stacks on every call
        after the inner compile (every inner backend): lists still passed as separate tensors are
            moved into one allocation each (`restack_weight_lists`)
    stacked_overload(target, overload)  the overload that takes stacks (the rewrite emits it directly
            for weights that are stacked parameters already)

What a stack is in memory (finding one from its slices, making one, undoing it) is `stacks.py`, which
the op itself reads at run time.

Taking stacked inputs
---------------------
The compiled graph takes a fused layer's per-expert weight lists as stacks, found on each call as views.

Why: a ModuleList layer hands the portable op 3 x E separate graph inputs, and each costs on every call:
inductor's generated code asserts every input's size and stride, the call marshals three E-long lists,
the op checks again that each list is one stack, and a CUDA graph replay checks every static input's
address. Here the inner graph takes one [E, ...] input per list and calls the stacked overload; the
callable handed back to dynamo finds each stack from the caller's tensors on every call: they must
still be consecutive slices of one stack laid out as compiled, each with the same shape, stride and
dtype (while nothing changed, two C calls per list: dynamo's tensor check and an address comparison;
guards cannot be relied on for this, a `guard_filter_fn` may drop them).

Nothing goes stale: the stack is a view built from the parameters on every call, so an in-place update
is read, and a parameter pointed elsewhere (`p.data = other`) stops being a slice, after which the
tensors are stacked on each call (a copy: right, slower, with a warning).

Where: calls of the portable op's list overloads whose every weight list is made of graph inputs used by
that call alone, each list either one stack already or movable into one (`restack.movable`, moved here,
before the inner compile, which never sees those inputs). The stack inputs are marked static, as
parameters are, so CUDA graph replays read them in place (and re-record if one ever moves).

Moving lists into stacks after the compile
------------------------------------------
Per-expert weights held in separate allocations become slices of one stacked tensor, once per compile.

Why: the portable op runs its fused kernel (or its grouped matmuls) on stacked weights. Handed the E
separate tensors of a ModuleList of Linears, it has to loop over the experts with a host sync, and
stacking them on every call would copy every expert's weights per step. So, when the rewrite hands
the portable op lists of graph inputs that live in separate allocations, their data is moved once
into one [E, ...] allocation and each tensor is pointed at its slice (`stacks.restack`): no
memory is added once the move is done, and nothing is copied per call.

Nothing can go stale, because the fused call still receives the parameters themselves and finds
the stack through them (`stacks.stacked_view` checks, on each call, that they are consecutive
slices): an in-place update of a parameter (`copy_`, `load_state_dict`, an optimizer step) writes
into the stack, and a parameter later pointed elsewhere (`param.data = other`,
`load_state_dict(assign=True)`) only makes the op take its per-expert path again, still right.

Only tensors that nothing else can see into are moved: plain tensors or Parameters (no subclass),
contiguous, each the sole user of its own storage (no view of it elsewhere would keep the old data),
distinct, and of one shape, dtype and device.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Callable, Sequence

import torch
from torch._guards import detect_fake_mode
from torch.fx import Graph, GraphModule, Node

from .fused_op import NAMESPACE
from .fx_utils import arguments
from .stacks import movable, restack, stacked_view, unstack

LIST_ARGUMENTS = ("w1", "w2", "w3", "w12")  # the weight lists of `.default` and `.fused_weights`
LIST_OVERLOADS = ("default", "fused_weights")


def fused_list_calls(graph: Graph) -> list[Node]:
    """The calls of the op's list overloads (per-expert weight lists) in `graph`."""
    return [
        node
        for node in graph.nodes
        if node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and node.target.namespace == NAMESPACE
        and node.target._overloadname in LIST_OVERLOADS
    ]


def restack_weight_lists(graph: Graph, example_inputs) -> dict[Node, int]:
    """Move the per-expert weight lists of the portable op's calls in `graph` into stacks, where safe.

    Returns {fused call: tensors moved}. `example_inputs` are the real values of the graph's inputs,
    in placeholder order, as dynamo hands them to the backend.
    """
    placeholders = graph.find_nodes(op="placeholder")
    if len(placeholders) != len(example_inputs):
        return {}
    values = dict(zip(placeholders, example_inputs, strict=True))
    moved = {}
    for call in fused_list_calls(graph):
        call_args = arguments(call) or {}
        for name in LIST_ARGUMENTS:
            nodes = call_args.get(name)
            if not isinstance(nodes, list | tuple) or not all(isinstance(n, Node) and n in values for n in nodes):
                continue
            tensors = [values[n] for n in nodes]
            if movable(tensors):
                restack(tensors)
                moved[call] = moved.get(call, 0) + len(tensors)
    return moved


# The portable op's overloads that take each weight role as one stacked [E, ...] tensor (fused_op.py)
STACKED_OVERLOADS = {"default": "stacked", "fused_weights": "stacked_fused_weights"}


def stacked_overload(target: str, overload: str) -> str | None:
    """The overload taking stacked weights in place of per-expert lists, where the target has one.

    Only the portable op has them: the Gaudi op's schema takes lists, and its call is kept exactly.
    """
    return STACKED_OVERLOADS.get(overload) if target == "portable" else None


@dataclasses.dataclass(frozen=True)
class ListCall:
    """A fused call whose weight lists can all become stacked graph inputs."""

    call: Node
    lists: dict[str, tuple[int, ...]]  # argument name -> caller input positions, in expert order


try:  # dynamo's C++ check of many tensors' dtype, device, requires_grad, sizes and strides in one call
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover - every torch this package supports has it
    _TensorGuards = None
# One C call comparing many tensors' addresses (CUDA builds of torch; what CUDA graph replays use).
_pointers_equal = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


class _Slices:
    """The tensors a stack was found from, as they were then (never the tensors themselves), and a cheap
    check that they still are.

    Reading the same bytes the same way needs the same address, dtype, sizes and strides (and device):
    compared in two C calls (dynamo's `TensorGuards`, then the addresses) where this torch has them,
    else per tensor. A failed check costs nothing but the full check, so a spurious mismatch (dispatch
    keys, `requires_grad`) is harmless.
    """

    __slots__ = ("guards", "pointers", "indices", "layout")

    def __init__(self, tensors: list[torch.Tensor]):
        self.guards = None
        if _TensorGuards is not None:
            try:
                self.guards = _TensorGuards(*tensors, dynamic_dims_sizes=[list(t.size()) for t in tensors],
                                            dynamic_dims_strides=[list(t.stride()) for t in tensors])
            except Exception:  # noqa: BLE001 - a private API whose signature may change: check per tensor
                self.guards = None
        self.pointers = [t.data_ptr() for t in tensors]
        self.indices = list(range(len(tensors)))
        self.layout = None if self.guards is not None else list(map(_layout_of, tensors))

    def still(self, tensors: list[torch.Tensor]) -> bool:
        if self.guards is None:
            return list(map(_layout_of, tensors)) == self.layout
        if not self.guards.check(*tensors):
            return False
        if _pointers_equal is not None:
            return _pointers_equal(tensors, self.pointers, self.indices)
        return list(map(torch.Tensor.data_ptr, tensors)) == self.pointers


def _layout_of(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.shape, t.stride(), t.dtype, t.device


class _LastStack:
    """The stack found on the last call with the `_Slices` it was found from (one tuple, replaced whole,
    so a concurrent caller never sees half of an update). It is let go when the first tensor it was found
    from dies, so that a deleted model's memory is freed with it."""

    __slots__ = ("entry", "release", "__weakref__")

    def __init__(self):
        self.entry: tuple[torch.Tensor, _Slices] | None = None
        self.release: weakref.finalize | None = None

    def keep(self, stack: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        self.forget()
        self.entry = (stack, _Slices(tensors))
        self.release = weakref.finalize(tensors[0], _forget, weakref.ref(self))

    def forget(self) -> None:
        self.entry = None
        if self.release is not None:
            self.release.detach()
            self.release = None


def _forget(last: weakref.ref) -> None:
    holder = last()
    if holder is not None:
        holder.forget()


@dataclasses.dataclass(frozen=True)
class StackedGroup:
    """Caller inputs the inner graph takes as one stack, and how that stack was laid out when compiled."""

    positions: tuple[int, ...]
    size: tuple[int, ...]  # of the stack
    stride: tuple[int, ...]
    dtype: torch.dtype
    last: _LastStack = dataclasses.field(default_factory=_LastStack, compare=False, repr=False)

    def stack(self, args: Sequence) -> torch.Tensor:
        """The stack the inputs are slices of, as a view where they still are one laid out as compiled;
        else a copy, laid out as the compiled graph expects. Guards can be filtered away, so every input is
        checked on each call: while each still has the address, dtype, sizes and strides it was last found
        with (`_Slices`, two C calls for the whole list), the last stack is reused; otherwise
        `stacks.stacked_view` checks every input's address, shape, stride and dtype."""
        tensors = [args[i] for i in self.positions]
        entry = self.last.entry
        if entry is not None:
            stack, slices = entry
            if slices.still(tensors):
                return stack
            self.last.forget()  # let go of a stack the inputs have left
        view = stacked_view(tensors)
        if view is not None and self._laid_out_as_compiled(view) and view.dtype == self.dtype:
            self.last.keep(view, tensors)
            return view
        warnings.warn(
            "hpu_moe: per-expert weights are no longer slices of one stack laid out as compiled (a parameter "
            "was pointed elsewhere); they are stacked on every call until the next compile",
            RuntimeWarning,
            stacklevel=3,
        )
        stack = torch.stack(tensors)
        if self._laid_out_as_compiled(stack):
            return stack
        laid_out = torch.empty_strided(self.size, self.stride, dtype=stack.dtype, device=stack.device)
        return laid_out.copy_(stack)

    def _laid_out_as_compiled(self, stack: torch.Tensor) -> bool:
        return stack.shape == self.size and stack.stride() == self.stride


@dataclasses.dataclass(frozen=True)
class InputPlan:
    """How the caller's inputs become the inner graph's: the kept positions, then one stack per group."""

    kept: tuple[int, ...]
    groups: tuple[StackedGroup, ...]

    def inner_inputs(self, args: Sequence) -> list:
        return [args[i] for i in self.kept] + [group.stack(args) for group in self.groups]


@dataclasses.dataclass(frozen=True)
class Taken:
    """What `take_stacks` did: the inner graph's example inputs (the stacks themselves: AOTAutograd finds
    their static fake values by identity), the input plan, the tensors this compile moved into stacks
    per fused call, and each fused call's stacked replacement."""

    inputs: list
    plan: InputPlan
    moved: dict[Node, list[torch.Tensor]]
    replaced: dict[Node, Node]


STATIC_INPUT_TYPE = "_dynamo_static_input_type"  # how dynamo marks an input AOTAutograd treats as static


def find_list_calls(gm: GraphModule, example_inputs: Sequence) -> list[ListCall]:
    """The portable list calls whose every weight list can be taken as one stacked input."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    if len(placeholders) != len(example_inputs):
        return []
    position = {node: index for index, node in enumerate(placeholders)}
    found = []
    for call in fused_list_calls(gm.graph):
        values = arguments(call)
        if values is None or stacked_overload("portable", call.target._overloadname) is None:
            continue
        lists = {}
        for name in LIST_ARGUMENTS:
            nodes = values.get(name)
            if nodes is None:
                continue
            if not isinstance(nodes, list | tuple) or not all(
                isinstance(n, Node) and n in position and len(n.users) == 1 for n in nodes
            ) or len(set(nodes)) != len(nodes):
                break
            tensors = [example_inputs[position[n]] for n in nodes]
            if stacked_view(tensors) is None and not movable(tensors):
                break
            lists[name] = tuple(position[n] for n in nodes)
        else:
            if lists:
                found.append(ListCall(call, lists))
    return found


def take_stacks(gm: GraphModule, example_inputs: Sequence, found: list[ListCall]) -> Taken | None:
    """Rewrite `gm` in place so each found list is one stacked input, or return None (nothing changed).

    Movable lists are moved into stacks here (`restack`): the inner graph no longer has those inputs, so
    their new storage offsets reach no compiler. Everything the rewrite needs is worked out before the
    graph changes: a failure there moves the tensors back and leaves the lists (with a warning); one while
    changing the graph moves them back and propagates, and the backend compiles the captured graph.
    """
    placeholders = gm.graph.find_nodes(op="placeholder")
    fake_mode = detect_fake_mode([node.meta.get("val") for node in placeholders])
    if fake_mode is None or not found:
        return None
    moved: dict[Node, list[torch.Tensor]] = {}
    try:
        for item in found:
            for positions in item.lists.values():
                tensors = [example_inputs[i] for i in positions]
                if stacked_view(tensors) is None:
                    restack(tensors)
                    moved.setdefault(item.call, []).extend(tensors)
        prepared = [_prepare(item, example_inputs, fake_mode) for item in found]
    except Exception as error:  # noqa: BLE001 - the lists still work: keep them
        unstack([t for tensors in moved.values() for t in tensors])
        warnings.warn(f"hpu_moe: internal error while taking weight lists as stacked inputs, lists kept: "
                      f"{type(error).__name__}: {error}", RuntimeWarning, stacklevel=3)
        return None
    try:
        return _rewrite(gm, example_inputs, prepared, moved)
    except Exception:
        unstack([t for tensors in moved.values() for t in tensors])
        raise


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """One call's rewrite, worked out: its stacked overload and, per list, the stack and its fake value."""

    item: ListCall
    overload: torch._ops.OpOverload
    stacks: dict[str, tuple[torch.Tensor, torch.Tensor]]


def _prepare(item: ListCall, example_inputs: Sequence, fake_mode) -> _Prepared:
    stacks = {}
    for name, positions in item.lists.items():
        stack = stacked_view([example_inputs[i] for i in positions])
        stacks[name] = (stack, fake_mode.from_tensor(stack, static_shapes=True))
    stacked = stacked_overload("portable", item.call.target._overloadname)
    return _Prepared(item, getattr(item.call.target.overloadpacket, stacked), stacks)


def _rewrite(gm: GraphModule, example_inputs: Sequence, prepared: list[_Prepared], moved) -> Taken:
    """Each prepared call becomes its stacked overload on new stack inputs; the list inputs are removed."""
    graph = gm.graph
    placeholders = graph.find_nodes(op="placeholder")
    from_dynamo = hasattr(placeholders[0], "_dynamo_source")
    replaced: dict[Node, Node] = {}
    groups: list[StackedGroup] = []
    stacks: list[torch.Tensor] = []
    last = placeholders[-1]
    for ready in prepared:
        call = ready.item.call
        values = arguments(call)
        list_nodes = [node for name in ready.item.lists for node in values[name]]
        for name, positions in ready.item.lists.items():
            stack, fake = ready.stacks[name]
            with graph.inserting_after(last):
                last = graph.placeholder(f"{call.name}_{name}_stack")
            last.meta["val"] = fake
            if from_dynamo:
                last._dynamo_source = None  # an input dynamo never saw: AOTAutograd takes None as "no source"
            # A fixed address, as parameters have: CUDA graph replays read it in place (and re-record
            # if it ever moves) instead of copying the stack into the graph's buffer on every replay.
            last.meta["tensor_dict"] = {STATIC_INPUT_TYPE: "unguarded"}
            values[name] = last
            groups.append(StackedGroup(positions, tuple(stack.shape), stack.stride(), stack.dtype))
            stacks.append(stack)
        with graph.inserting_after(call):
            args = tuple(values[a.name] for a in ready.overload._schema.arguments)
            replacement = graph.call_function(ready.overload, args)
        replacement.meta.update(call.meta)
        replaced[call] = replacement
        call.replace_all_uses_with(replacement)
        graph.erase_node(call)
        for node in list_nodes:
            graph.erase_node(node)
    dropped = {i for group in groups for i in group.positions}
    plan = InputPlan(tuple(i for i in range(len(example_inputs)) if i not in dropped), tuple(groups))
    gm.recompile()
    return Taken([example_inputs[i] for i in plan.kept] + stacks, plan, moved, replaced)


def with_stacked_inputs(compiled, plan: InputPlan):
    """The callable dynamo calls with the captured graph's inputs: finds the stacks, then runs `compiled`."""

    def run(*args):
        return compiled(*plan.inner_inputs(args))

    return run


@dataclasses.dataclass
class Stacking:
    """What `stack_weights` did to one rewritten graph, and what is left to do after its compile."""

    graph: GraphModule
    inputs: Sequence  # the inner graph's example inputs
    taken: Taken | None = None
    moved_after_compile: dict[Node, int] = dataclasses.field(default_factory=dict)

    def replaced(self) -> dict[Node, Node]:
        return self.taken.replaced if self.taken else {}

    def wrap(self, compiled: Callable) -> Callable:
        """The callable for dynamo: finds the stacks in the caller's inputs when the graph takes them."""
        return compiled if self.taken is None else with_stacked_inputs(compiled, self.taken.plan)

    def after_compile(self) -> None:
        """Move the lists still passed as separate tensors into stacks. After the inner compile: the
        compilers read the inputs' layouts (storage offsets included) as dynamo recorded them, and the
        move changes only where the data lives, not shapes or values."""
        self.moved_after_compile = restack_weight_lists(self.graph.graph, self.inputs)

    def undo(self) -> None:
        """Give the tensors this compile moved their own allocations again (a later step failed)."""
        if self.taken is not None:
            unstack([t for tensors in self.taken.moved.values() for t in tensors])


def stack_weights(graph: GraphModule, example_inputs: Sequence, take_inputs: bool) -> Stacking:
    """Stack the portable calls' per-expert weight lists in `graph` (rewritten in place where the graph
    takes them as inputs). `take_inputs`: the inner backend compiles any graph of aten ops."""
    taken = take_stacks(graph, example_inputs, find_list_calls(graph, example_inputs)) if take_inputs else None
    return Stacking(graph, taken.inputs if taken is not None else example_inputs, taken)
