"""softmax → top-k → renormalise over each token's router logits in one Triton program per block of tokens.

What inductor makes of the same routing is three launches: a fused softmax, ATen's top-k (a sort-based
kernel of its own, the longest of the three: 18 us at 1024 tokens x 128 experts on the H100) and the
renormalisation. Here each program holds a [block_t, experts] tile in registers: the float32 softmax,
then k rounds of "largest, lowest expert id among equals", then the division by the k weights' sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_EXPERTS = 1024  # one tile row holds every expert's logit
MAX_TOP_K = 64
TILE_ELEMENTS = 4096  # logits per program: block_t x next_power_of_2(experts)


@triton.jit
def _softmax_topk_kernel(
    logits, weights, ids, tokens, experts, stride_logits,
    K: tl.constexpr, K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    in_rows = rows < tokens
    present = in_rows[:, None] & (cols[None, :] < experts)
    x = tl.load(logits + rows[:, None].to(tl.int64) * stride_logits + cols[None, :], mask=present,
                other=float("-inf")).to(tl.float32)
    shifted = tl.exp(x - tl.max(x, 1)[:, None])  # padding: exp(-inf) = 0
    probabilities = shifted / tl.sum(shifted, 1)[:, None]
    remaining = tl.where(present, probabilities, -1.0)  # below every probability: never chosen
    slots = tl.arange(0, K_PAD)
    chosen = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
    chosen_ids = tl.zeros((BLOCK_T, K_PAD), dtype=tl.int64)
    for slot in tl.static_range(K):
        best = tl.max(remaining, 1)
        expert = tl.min(tl.where(remaining == best[:, None], cols[None, :], BLOCK_E), 1)
        chosen = tl.where(slots[None, :] == slot, best[:, None], chosen)
        chosen_ids = tl.where(slots[None, :] == slot, expert[:, None].to(tl.int64), chosen_ids)
        remaining = tl.where(cols[None, :] == expert[:, None], -2.0, remaining)
    if RENORMALIZE:
        chosen = chosen / tl.sum(chosen, 1)[:, None]  # unused slots hold 0
    out = rows[:, None].to(tl.int64) * K + slots[None, :]
    stored = in_rows[:, None] & (slots[None, :] < K)
    tl.store(weights + out, chosen.to(weights.dtype.element_ty), mask=stored)
    tl.store(ids + out, chosen_ids, mask=stored)


def applies(router_logits: torch.Tensor, k: int, dtype: torch.dtype) -> bool:
    """The cases the kernel covers: [T, E] floating logits on CUDA, contiguous rows, E and k it can hold."""
    return (
        router_logits.is_cuda
        and router_logits.dim() == 2
        and router_logits.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and dtype in (torch.float32, torch.bfloat16, torch.float16)
        and router_logits.stride(1) == 1
        and 0 < k <= min(MAX_TOP_K, router_logits.shape[1])
        and router_logits.shape[1] <= MAX_EXPERTS
    )


def _direct(kernel):
    return kernel


def softmax_topk(router_logits: torch.Tensor, k: int, renormalize: bool, dtype: torch.dtype, launch=_direct):
    """(weights [T, k] in `dtype`, expert ids [T, k] int64), largest first. `launch` as in `triton_moe`."""
    tokens, experts = router_logits.shape
    weights = torch.empty(tokens, k, dtype=dtype, device=router_logits.device)
    ids = torch.empty(tokens, k, dtype=torch.int64, device=router_logits.device)
    if tokens == 0:
        return weights, ids
    block_e = triton.next_power_of_2(experts)
    block_t = max(1, min(64, TILE_ELEMENTS // block_e))
    launch(_softmax_topk_kernel)[(triton.cdiv(tokens, block_t),)](
        router_logits, weights, ids, tokens, experts, router_logits.stride(0),
        K=k, K_PAD=triton.next_power_of_2(k), RENORMALIZE=renormalize, BLOCK_T=block_t, BLOCK_E=block_e,
        num_warps=4,
    )
    return weights, ids
