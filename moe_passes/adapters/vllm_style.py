"""The adapter for vLLM's FusedMoE calling convention (and classes that follow it).

The convention: `forward(hidden_states, router_logits)` passes `self.layer_name` to an opaque custom op
that looks the layer up in the forward context and calls `forward_impl(hidden_states, router_logits)`,
where routing and experts run. The adapted forward calls `forward_impl` on the layer it was called on,
so neither the name, nor the context, nor the opaque op is on the traced path (the fix vllm-gaudi's
`patched_fused_moe_forward` makes by hand, here without changing what eager runs).
"""

from __future__ import annotations

import torch

NAME = "vllm-style FusedMoE (layer by reference)"


def follows_convention(cls: type) -> bool:
    """An nn.Module class whose forward reads `layer_name` and that has a `forward_impl` to call."""
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        return False
    forward = cls.__dict__.get("forward")
    code = getattr(forward, "__code__", None)
    return code is not None and "layer_name" in code.co_names and callable(getattr(cls, "forward_impl", None))


def traceable_forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
    """Routing and experts of this very layer, visible to dynamo."""
    return self.forward_impl(hidden_states, router_logits)
