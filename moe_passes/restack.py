"""Per-expert weights held in separate allocations become slices of one stacked tensor, once per compile.

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

import torch
from torch.fx import Graph, Node

from .fused_op import NAMESPACE
from .fx_utils import arguments
from .stacks import movable, restack

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
