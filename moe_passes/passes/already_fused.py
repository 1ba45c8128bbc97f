"""Calls of the fused MoE kernel the model already makes (optimum-habana, vllm-gaudi, this package).

Such a layer needs nothing: its call is left exactly as written and reported as already fused, so that
a user reading the report sees every MoE layer accounted for.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.fx import Node

KERNEL_NAMESPACES = ("hpu", "moe_passes")


@dataclasses.dataclass(frozen=True)
class ExistingCall:
    """One call of `<namespace>::mixture_of_experts.<overload>` found in a captured graph."""

    node: Node
    overload: str  # "hpu::mixture_of_experts.default"
    num_experts: int | None  # experts of the first weight list (or stack), when known
    experts_min: int | None
    experts_max: int | None


def _is_kernel(target) -> bool:
    return (
        isinstance(target, torch._ops.OpOverload)
        and target.namespace in KERNEL_NAMESPACES
        and target._schema.name.split("::")[-1] == "mixture_of_experts"
    )


def _expert_count(weights) -> int | None:
    """Experts held: a weight list's length, or a stacked weight's first size (the stacked overloads)."""
    if isinstance(weights, list | tuple):
        return len(weights)
    if isinstance(weights, Node) and isinstance(weights.meta.get("val"), torch.Tensor):
        size = weights.meta["val"].shape[0]
        return size if isinstance(size, int) else None
    return None


def find(graph: torch.fx.Graph) -> list[ExistingCall]:
    calls = []
    for node in graph.nodes:
        if node.op != "call_function" or not _is_kernel(node.target):
            continue
        # arguments by name through the overload's own schema, whichever way the call spelled them
        named = torch.fx.operator_schemas.normalize_function(
            node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True
        )
        kwargs = named.kwargs if named is not None else {}
        num_experts = _expert_count(next((kwargs[k] for k in ("w1", "w12") if k in kwargs), None))
        calls.append(
            ExistingCall(
                node=node,
                overload=f"{node.target.namespace}::mixture_of_experts.{node.target._overloadname}",
                num_experts=num_experts,
                experts_min=kwargs.get("experts_min") if isinstance(kwargs.get("experts_min"), int) else None,
                experts_max=kwargs.get("experts_max") if isinstance(kwargs.get("experts_max"), int) else None,
            )
        )
    return calls
