"""`torch.ops.moe_passes.softmax_topk`: the softmax → top-k → renormalise routing as one op.

Why: the portable op's Triton kernel leaves the routing to inductor, which runs ATen's top-k as a
separate sort-based kernel between the softmax and the renormalisation; at 1024 tokens x 128 experts
that top-k alone takes 18 us of a 540 us layer on the H100. The routing fusion pass
(`passes/routing_fusion.py`) puts this op in place of that chain where its logits are on CUDA, and on
CUDA the op is one Triton program per block of tokens (`kernels/triton_routing.py`), traced into
inductor's generated code like the stacked MoE overloads.

Semantics, those of the chain it replaces: the softmax over the last dimension in float32, the k
largest probabilities in descending order with their expert ids (int64), divided by their sum when
`renormalize`, cast to `dtype`. Among equal probabilities the lowest expert id comes first (torch.topk
leaves that order unspecified).
"""

from __future__ import annotations

import torch
from torch._subclasses.functional_tensor import FunctionalTensorMode

from . import kernels
from .fused_op import NAMESPACE, plain_tensors

SCHEMA = "softmax_topk(Tensor router_logits, int k, bool renormalize, ScalarType dtype) -> (Tensor, Tensor)"
NAME = f"{NAMESPACE}::softmax_topk"


def _check(router_logits: torch.Tensor, k: int) -> None:
    if router_logits.dim() < 1 or not router_logits.is_floating_point():
        raise ValueError(f"softmax_topk: router_logits must be a floating tensor of rank >= 1, got "
                         f"{router_logits.dtype} of rank {router_logits.dim()}")
    if not 0 < k <= router_logits.shape[-1]:
        raise ValueError(f"softmax_topk: k must be in [1, {router_logits.shape[-1]}] (the number of experts), "
                         f"got {k}")


def reference(router_logits: torch.Tensor, k: int, renormalize: bool, dtype: torch.dtype):
    """The routing as torch ops: what the op computes wherever its kernel does not apply."""
    weights, ids = torch.topk(torch.softmax(router_logits.float(), dim=-1), k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


def softmax_topk(router_logits: torch.Tensor, k: int, renormalize: bool, dtype: torch.dtype):
    _check(router_logits, k)
    if kernels.routing_kernel_applies(router_logits, k, dtype):
        return kernels.routing_kernels().softmax_topk(router_logits, k, renormalize, dtype)
    return reference(router_logits, k, renormalize, dtype)


def _fake(router_logits: torch.Tensor, k: int, renormalize: bool, dtype: torch.dtype):
    _check(router_logits, k)
    shape = (*router_logits.shape[:-1], k)
    return router_logits.new_empty(shape, dtype=dtype), router_logits.new_empty(shape, dtype=torch.int64)


def _trace_into_kernel(mode, func, types, args, kwargs):
    """AOTAutograd's functionalization of the op: on CUDA, its Triton launch (`wrap_triton`), so inductor
    launches the kernel from its generated code; anything else stays the opaque op."""
    router_logits, k, renormalize, dtype = args
    if plain_tensors(types) and not kwargs and kernels.routing_kernel_applies(router_logits, k, dtype):
        with mode:
            return kernels.routing_kernels().softmax_topk(
                router_logits, k, renormalize, dtype, launch=torch.library.wrap_triton
            )
    return mode.__torch_dispatch__(func, types, args, kwargs)


def _register() -> torch.library.Library | None:
    """Define the op with CPU and CUDA kernels, a fake kernel and inductor's view of the Triton kernel."""
    try:
        torch._C._dispatch_find_schema_or_throw(NAME, "")
        return None  # another copy of this module already owns the definition
    except RuntimeError:
        pass
    library = torch.library.Library(NAMESPACE, "FRAGMENT")
    library.define(SCHEMA)
    for device in ("CPU", "CUDA"):
        library.impl("softmax_topk", softmax_topk, device)
    torch.library.register_fake(NAME, _fake, lib=library)
    if kernels.wrap_triton_available():
        torch.library.register_torch_dispatch(NAME, FunctionalTensorMode, _trace_into_kernel, lib=library)
    return library


_LIBRARY = globals().get("_LIBRARY") or _register()
OP = torch.ops.moe_passes.softmax_topk.default
