"""Device kernels for the portable op. Triton is optional: it is imported only when a CUDA tensor asks.

`fused_moe_cuda` returns None whenever the fused kernel does not apply (no Triton, a dtype or
activation it does not cover, weights that are not views of one stacked tensor); the caller then runs
the portable implementation, so the op's result never depends on whether the kernel is there.
"""

from __future__ import annotations

import functools
import importlib

import torch

from ..reference import ACTIVATIONS
from .config import MoEConfig, TileConfig, choose_config

KERNEL_DTYPES = (torch.bfloat16, torch.float16)
KERNEL_ACTIVATIONS = tuple(ACTIVATIONS)  # the Triton kernel implements every one


def _load(name: str):
    """A Triton kernel module of this package, or None where Triton is missing or broken."""
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except Exception:  # ImportError, or a Triton that fails to initialise on this machine
        return None


@functools.cache
def triton_kernels():
    """The fused MoE kernels' module (imported once, on first CUDA use), or None without a working Triton."""
    return _load("triton_moe")


@functools.cache
def routing_kernels():
    """The routing kernel's module, or None without a working Triton (as `triton_kernels`)."""
    return _load("triton_routing")


def routing_kernel_applies(router_logits: torch.Tensor, k: int, dtype: torch.dtype) -> bool:
    """Whether `moe_passes::softmax_topk` runs its Triton kernel for these arguments."""
    return router_logits.is_cuda and routing_kernels() is not None and routing_kernels().applies(router_logits, k, dtype)


def kernel_applies(hidden_states: torch.Tensor, activation: str, gate: torch.Tensor, up: torch.Tensor) -> bool:
    """The conditions the Triton kernel covers; anything else takes the portable path."""
    return (
        hidden_states.is_cuda
        and hidden_states.dtype in KERNEL_DTYPES
        and activation in KERNEL_ACTIVATIONS
        and gate.stride() == up.stride()
        and triton_kernels() is not None
    )


def wrap_triton_available() -> bool:
    """Whether this torch lets a custom op's Triton launches be traced (torch.library.wrap_triton, 2.6+)."""
    return hasattr(torch.library, "wrap_triton") and hasattr(torch.library, "register_torch_dispatch")


def traced_fused_moe(hidden_states, table, router_weights, gate, up, down, permuted, activation, experts_min):
    """The kernel's allocations and launches as traceable ops (`wrap_triton`), for inductor to compile."""
    return triton_kernels().fused_moe(
        hidden_states, table, router_weights, gate, up, down, permuted, activation, experts_min,
        launch=torch.library.wrap_triton,
    )


def fused_moe_cuda(hidden_states, table, router_weights, gate, up, down, permuted, activation, experts_min):
    """The op's result from the fused Triton kernel, or None when the kernel does not apply."""
    if not kernel_applies(hidden_states, activation, gate, up):
        return None
    return triton_kernels().fused_moe(
        hidden_states, table, router_weights, gate, up, down, permuted, activation, experts_min
    )


__all__ = [
    "MoEConfig", "TileConfig", "choose_config", "fused_moe_cuda", "kernel_applies", "routing_kernel_applies",
    "routing_kernels", "traced_fused_moe", "triton_kernels", "wrap_triton_available",
]
