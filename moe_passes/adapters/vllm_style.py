"""The adapter for vLLM's FusedMoE calling convention (and classes that follow it).

The convention: `forward(hidden_states, router_logits)` passes `self.layer_name` to an opaque custom op
that looks the layer up in the forward context and calls `forward_impl(hidden_states, router_logits)`,
where routing and experts run. The adapted forward calls `forward_impl` on the layer it was called on,
so neither the name, nor the context, nor the opaque op is on the traced path (the fix vllm-gaudi's
`patched_fused_moe_forward` makes by hand, here without changing what eager runs).
"""

from __future__ import annotations

import inspect

import torch

NAME = "vllm-style FusedMoE (layer by reference)"


MOE_ARGUMENTS = ["hidden_states", "router_logits"]


def _leading_parameters(function, count: int) -> list[str]:
    try:
        parameters = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return []
    return parameters[1 : 1 + count]  # after self


def follows_convention(cls: type) -> bool:
    """An nn.Module class whose forward(hidden_states, router_logits) reads `layer_name` and whose
    `forward_impl(hidden_states, router_logits)` runs routing and experts.

    Both signatures are checked: other vLLM layers also read `layer_name` and define a `forward_impl`
    (MLA attention: `forward_impl(q, k_c_normed, ...)`, Mamba: `forward_impl(hidden_states, output)`)
    and must never be rerouted.
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        return False
    forward = cls.__dict__.get("forward")
    code = getattr(forward, "__code__", None)
    forward_impl = getattr(cls, "forward_impl", None)
    return (
        code is not None
        and "layer_name" in code.co_names
        and callable(forward_impl)
        and _leading_parameters(forward, 2) == MOE_ARGUMENTS
        and _leading_parameters(forward_impl, 2) == MOE_ARGUMENTS
    )


def traceable_forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
    """Routing and experts of this very layer, visible to dynamo."""
    return self.forward_impl(hidden_states, router_logits)
