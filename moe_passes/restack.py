"""Per-expert weights held in separate allocations become slices of one stacked tensor, once per compile.

Why: the portable op runs its fused kernel (or its grouped matmuls) on stacked weights. Handed the E
separate tensors of a ModuleList of Linears, it has to loop over the experts with a host sync, and
stacking them on every call would copy every expert's weights per step. So, when the rewrite hands
the portable op lists of graph inputs that live in separate allocations, their data is moved once
into one [E, ...] tensor and each tensor is pointed at its slice (`tensor.data = stack[e]`): no
memory is added once the move is done, and nothing is copied per call.

Nothing can go stale, because the fused call still receives the parameters themselves and finds
the stack through them (`fused_op._stacked_view` checks, on each call, that they are consecutive
slices): an in-place update of a parameter (`copy_`, `load_state_dict`, an optimizer step) writes
into the stack, and a parameter later pointed elsewhere (`param.data = other`,
`load_state_dict(assign=True)`) only makes the op take its per-expert path again, still right.

Only tensors that nothing else can see into are moved: plain tensors or Parameters (no subclass),
contiguous, each the sole user of its own storage (no view of it elsewhere would keep the old data),
distinct, and of one shape, dtype and device.
"""

from __future__ import annotations

import torch
from torch.fx import Graph, Node

from .fused_op import NAMESPACE, _stacked_view
from .fx_utils import arguments

LIST_ARGUMENTS = ("w1", "w2", "w3", "w12")  # the weight lists of `.default` and `.fused_weights`
LIST_OVERLOADS = ("default", "fused_weights")


def _sole_owner(tensor: torch.Tensor) -> bool:
    """The tensor covers its whole storage and no other tensor shares that storage."""
    storage = tensor.untyped_storage()
    return (
        tensor.storage_offset() == 0
        and storage.nbytes() == tensor.numel() * tensor.element_size()
        and torch._C._storage_Use_Count(storage._cdata) == 2  # the tensor and `storage` here
    )


def movable(tensors: list) -> bool:
    """Whether these per-expert tensors may be moved into one stack (see the module docstring)."""
    if len(tensors) < 2 or not all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors):
        return False
    first = tensors[0]
    if any(t.shape != first.shape or t.dtype != first.dtype or t.device != first.device for t in tensors):
        return False
    if len({t.data_ptr() for t in tensors}) != len(tensors) or _stacked_view(tensors) is not None:
        return False
    return all(t.is_contiguous() and t._base is None and _sole_owner(t) for t in tensors)


def restack(tensors: list[torch.Tensor]) -> None:
    """Move the tensors' data into one new [E, ...] tensor and point each tensor at its slice."""
    with torch.no_grad():
        stack = torch.stack([t.detach() for t in tensors])
        for index, tensor in enumerate(tensors):
            tensor.data = stack[index]


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


def unstack(tensors: list[torch.Tensor]) -> None:
    """Give each tensor its own allocation again (undoes `restack` where a compile must see the inputs as
    dynamo recorded them)."""
    with torch.no_grad():
        for tensor in tensors:
            tensor.data = tensor.detach().clone()
