"""The fused MoE forward on CUDA in Triton: align, gate/up GEMM with the activation, down GEMM, combine.

Design (after vLLM's fused_moe, written anew for this op's semantics):
1. Alignment: count the routed pairs per expert, pad each count to block_m, write each block's expert
   and each expert's first padded row, then place every pair in its expert's group with an atomic
   cursor. For few pairs over few experts one program does it all (`_align_counts`); else a histogram over
   chunks (`_align_histogram`), the offsets (`_align_offsets`) and the placement (`_align_scatter`)
   each run over many programs. Nothing leaves the device.
2. `_gate_up_kernel`: per block of block_m same-expert rows, gathers the token rows of x and computes
   the gate and up tiles of the same columns in one pass over K, then writes act(gate) * up (float32
   math, one rounding) in the padded layout.
3. `_down_kernel`: the down projection of those rows, written unweighted to row `pair` of [T*k, H];
   at prefill sizes on Hopper, `_down_kernel_tma` does the same persistently through TMA descriptors.
4. `_combine_kernel`: out[t] = sum over slots of router_weight * y, in float32, skipping pairs routed
   outside the expert range (selected away, so unwritten rows never leak NaN).
Weights are read through strides, so both layouts (`permuted_weights`) and views of stacked tensors
run without copies.
"""

from __future__ import annotations

import functools
import inspect

import torch
import triton
import triton.language as tl

from .align import block_count
from .config import MoEConfig, choose_config

ACTIVATION_CODES = {"silu": 0, "gelu": 1, "relu": 2}
DTYPES = (torch.bfloat16, torch.float16)
ALIGN_CHUNK = 1024  # one program builds the layout for at most this many pairs (fewer with many experts)
HISTOGRAM_CHUNK = 1024  # beyond: pairs (and rows to fill) per program of the parallel histogram
SCATTER_CHUNK = 256  # pairs per program placing them (small: many programs share the atomic cursors)


@triton.jit
def _write_layout(
    counts, cursor_ptr, block_expert_ptr, used_ptr, experts, first_block, last_block,
    BLOCK_M: tl.constexpr, BINS: tl.constexpr, BLOCK_CHUNK: tl.constexpr,
):
    """From the pairs per expert: each expert's first padded row (the scatter's cursor) and the used rows
    (written by the program with first_block 0), and the expert of blocks [first_block, last_block)
    (-1 past the used rows)."""
    bins = tl.arange(0, BINS)
    counts = tl.where(bins < experts, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)
    used = tl.sum(padded, 0)
    if first_block == 0:
        tl.store(cursor_ptr + bins, padded_end - padded, mask=bins < experts)
        tl.store(used_ptr, used)
    for start in range(first_block, last_block, BLOCK_CHUNK):
        block = start + tl.arange(0, BLOCK_CHUNK)
        row = block * BLOCK_M
        expert = tl.sum((padded_end[None, :] <= row[:, None]).to(tl.int32), 1)
        expert = tl.where(row < used, expert, -1)
        tl.store(block_expert_ptr + block, expert, mask=block < last_block)


@triton.jit
def _local_experts(table_ptr, offs, pairs, experts_min, experts, BINS: tl.constexpr):
    """The local expert of pairs `offs`, or the spare bin BINS - 1 for a pair out of range (or past the end)."""
    inside = offs < pairs
    local = tl.load(table_ptr + offs, mask=inside, other=-1).to(tl.int32) - experts_min
    return tl.where((local >= 0) & (local < experts) & inside, local, BINS - 1)


@triton.jit
def _align_counts(
    table_ptr, cursor_ptr, block_expert_ptr, used_ptr, sorted_ptr,
    pairs, experts_min, experts, blocks,
    BLOCK_M: tl.constexpr, BINS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_CHUNK: tl.constexpr,
):
    """Few pairs (one chunk): the whole layout in one program, one launch."""
    offs = tl.arange(0, CHUNK)
    counts = tl.histogram(_local_experts(table_ptr, offs, pairs, experts_min, experts, BINS), BINS)
    _write_layout(counts, cursor_ptr, block_expert_ptr, used_ptr, experts, 0, blocks, BLOCK_M, BINS, BLOCK_CHUNK)
    for start in range(0, blocks * BLOCK_M, CHUNK):
        rows = start + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + rows, tl.zeros([CHUNK], dtype=tl.int32) + pairs, mask=rows < blocks * BLOCK_M)
    tl.debug_barrier()
    _place_pairs(table_ptr, cursor_ptr, sorted_ptr, offs, pairs, experts_min, experts)


@triton.jit
def _align_histogram(
    table_ptr, counts_ptr, sorted_ptr, pairs, rows, experts_min, experts,
    BINS: tl.constexpr, CHUNK: tl.constexpr,
):
    """Many pairs, one chunk per program: fills its rows with the sentinel and adds its chunk's pairs
    per expert to `counts` (one atomic per expert hit, not one per pair)."""
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    tl.store(sorted_ptr + offs, tl.zeros([CHUNK], dtype=tl.int32) + pairs, mask=offs < rows)
    counts = tl.histogram(_local_experts(table_ptr, offs, pairs, experts_min, experts, BINS), BINS)
    bins = tl.arange(0, BINS)
    tl.atomic_add(counts_ptr + bins, counts, mask=(bins < experts) & (counts > 0))


@triton.jit
def _align_offsets(
    counts_ptr, cursor_ptr, block_expert_ptr, used_ptr, experts, blocks,
    BLOCK_M: tl.constexpr, BINS: tl.constexpr, BLOCK_CHUNK: tl.constexpr,
):
    """One chunk of blocks per program (each redoes the cheap prefix sum over experts)."""
    bins = tl.arange(0, BINS)
    counts = tl.load(counts_ptr + bins, mask=bins < experts, other=0)
    first = tl.program_id(0) * BLOCK_CHUNK
    last = tl.minimum(first + BLOCK_CHUNK, blocks)
    _write_layout(counts, cursor_ptr, block_expert_ptr, used_ptr, experts, first, last, BLOCK_M, BINS, BLOCK_CHUNK)


@triton.jit
def _place_pairs(table_ptr, cursor_ptr, sorted_ptr, offs, pairs, experts_min, experts):
    """Each in-range pair `offs` takes the next row of its expert's group (an atomic cursor per expert)."""
    inside = offs < pairs
    local = tl.load(table_ptr + offs, mask=inside, other=-1).to(tl.int32) - experts_min
    keep = inside & (local >= 0) & (local < experts)
    slot = tl.atomic_add(cursor_ptr + local, 1, mask=keep)
    tl.store(sorted_ptr + slot, offs, mask=keep)


@triton.jit
def _align_scatter(table_ptr, cursor_ptr, sorted_ptr, pairs, experts_min, experts, CHUNK: tl.constexpr):
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    _place_pairs(table_ptr, cursor_ptr, sorted_ptr, offs, pairs, experts_min, experts)


@triton.jit
def _activation(x, ACT: tl.constexpr):
    if ACT == 0:
        return x * tl.sigmoid(x)
    elif ACT == 1:  # tanh GELU, tanh(u) = 2 sigmoid(2u) - 1
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        return x * tl.sigmoid(2.0 * u)
    else:
        return tl.maximum(x, 0.0)


@triton.jit
def _tile_ids(num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    return _tile_of(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)


@triton.jit
def _tile_of(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped tile order: GROUP_M row blocks share each column sweep, so weight tiles stay in L2."""
    per_group = GROUP_M * num_pid_n
    group = pid // per_group
    first_m = group * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def _gate_up_kernel(
    x_ptr, gate_ptr, up_ptr, inter_ptr, sorted_ptr, block_expert_ptr, used_ptr,
    pairs, top_k, K, N, num_pid_m,
    stride_xm, stride_xk, stride_we, stride_wk, stride_wn, stride_im,
    ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
):
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _tile_ids(num_pid_m, num_pid_n, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(used_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    real = pair < pairs
    token = (pair // top_k).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * stride_xm + ks[None, :] * stride_xk
    w_offs = expert * stride_we + ks[:, None] * stride_wk + cols[None, :].to(tl.int64) * stride_wn
    g_ptrs = gate_ptr + w_offs
    u_ptrs = up_ptr + w_offs
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:  # no K tail: only the row and column masks, which the compiler hoists
            a = tl.load(a_ptrs, mask=real[:, None], other=0.0)
            g = tl.load(g_ptrs, mask=col_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = ks < K - k0
            a = tl.load(a_ptrs, mask=real[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc_gate = tl.dot(a, g, acc_gate)
        acc_up = tl.dot(a, u, acc_up)
        a_ptrs += BLOCK_K * stride_xk
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    h = _activation(acc_gate, ACT) * acc_up
    out_ptrs = inter_ptr + rows[:, None].to(tl.int64) * stride_im + cols[None, :]
    tl.store(out_ptrs, h.to(inter_ptr.dtype.element_ty), mask=col_ok[None, :])


@triton.jit
def _down_kernel(
    inter_ptr, w_ptr, y_ptr, sorted_ptr, block_expert_ptr, used_ptr,
    pairs, K, N, num_pid_m,
    stride_im, stride_we, stride_wk, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _tile_ids(num_pid_m, num_pid_n, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(used_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    real = pair < pairs
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = inter_ptr + rows[:, None].to(tl.int64) * stride_im + ks[None, :]
    b_ptrs = w_ptr + expert * stride_we + ks[:, None] * stride_wk + cols[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = ks < K - k0
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_wk
    out_ptrs = y_ptr + pair[:, None].to(tl.int64) * stride_ym + cols[None, :]
    tl.store(out_ptrs, acc.to(y_ptr.dtype.element_ty), mask=real[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel_tma(
    inter_ptr, w_ptr, y_ptr, sorted_ptr, block_expert_ptr, used_ptr,
    pairs, K, N, rows, experts,
    stride_we, stride_wk, stride_wn, stride_ym,
    PERMUTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr,
):
    """The down GEMM as `_down_kernel`, persistent (PROGRAMS programs walk the used tiles, so one tile's
    store overlaps the next one's loads) and reading both operands through TMA descriptors (Hopper's
    bulk copy engine, out-of-bounds reads as zeros: no masks in the K loop)."""
    a_desc = tl.make_tensor_descriptor(inter_ptr, shape=[rows, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    if PERMUTED:  # [E, out, in]: contiguous along K
        b_desc = tl.make_tensor_descriptor(
            w_ptr, shape=[experts, N, K], strides=[stride_we, stride_wn, 1], block_shape=[1, BLOCK_N, BLOCK_K]
        )
    else:  # [E, in, out]: contiguous along N
        b_desc = tl.make_tensor_descriptor(
            w_ptr, shape=[experts, K, N], strides=[stride_we, stride_wk, 1], block_shape=[1, BLOCK_K, BLOCK_N]
        )
    num_pid_m = tl.load(used_ptr) // BLOCK_M
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, PROGRAMS, flatten=True):
        pid_m, pid_n = _tile_of(tile, num_pid_m, num_pid_n, GROUP_M)
        expert = tl.load(block_expert_ptr + pid_m)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])
            if PERMUTED:
                b = tl.trans(b_desc.load([expert, pid_n * BLOCK_N, ki * BLOCK_K]).reshape(BLOCK_N, BLOCK_K))
            else:
                b = b_desc.load([expert, ki * BLOCK_K, pid_n * BLOCK_N]).reshape(BLOCK_K, BLOCK_N)
            acc = tl.dot(a, b, acc)
        pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        out_ptrs = y_ptr + pair[:, None].to(tl.int64) * stride_ym + cols[None, :]
        tl.store(out_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(pair < pairs)[:, None] & (cols < N)[None, :])


@triton.jit
def _combine_kernel(
    y_ptr, table_ptr, weights_ptr, out_ptr, H, experts_min, experts,
    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        pair = token * TOP_K + slot
        local = tl.load(table_ptr + pair).to(tl.int32) - experts_min
        weight = tl.load(weights_ptr + pair).to(tl.float32)
        y = tl.load(y_ptr + pair * H + cols, mask=col_ok, other=0.0).to(tl.float32)
        inside = (local >= 0) & (local < experts)
        acc += tl.where(inside, y * weight, 0.0)
    tl.store(out_ptr + token * H + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def _direct(kernel):
    return kernel


def one_program_alignment(pairs: int, experts: int) -> bool:
    """Whether one program builds the layout (one launch) rather than the parallel path (three launches
    and a fill). One program's time grows with the pairs and with its histogram's bins (the experts);
    the parallel path's stays near its launches' latency. `tools/bench_kernel.py --align` (H100, 11-25,
    `docs/bench/align_1125.log`): with 8 and 64 experts one program is ahead up to 1024 pairs, with 128
    up to 256 (level at 512, behind at 1024), with 256 never. The bins are static, so with many experts
    no guard on the (maybe symbolic) pairs is added."""
    bins = triton.next_power_of_2(experts + 1)
    if bins > 256:
        return False
    return pairs <= (ALIGN_CHUNK if bins <= 128 else ALIGN_CHUNK // 4)


def align(table: torch.Tensor, experts_min: int, experts: int, block_m: int, launch=_direct,
          one_program: bool | None = None):
    """The block-padded, expert-sorted layout of `table` (see align.py), built on the device.

    One program (one launch) where `one_program_alignment` says so; otherwise a histogram over chunks,
    one program for the offsets and a scatter over chunks. Sizes may be symbolic (when inductor traces
    the launches), so nothing here branches on them but that choice. `one_program` forces a path (for
    the benchmark).
    """
    flat = table.reshape(-1)
    pairs = flat.numel()
    if one_program is None:
        one_program = one_program_alignment(pairs, experts)
    elif one_program and pairs > ALIGN_CHUNK:
        raise ValueError(f"one program aligns at most {ALIGN_CHUNK} pairs, got {pairs}")
    blocks = block_count(pairs, experts, block_m)
    rows = blocks * block_m
    device = table.device
    cursor = torch.empty(experts, dtype=torch.int32, device=device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
    used = torch.empty(1, dtype=torch.int32, device=device)
    sorted_pairs = torch.empty(rows, dtype=torch.int32, device=device)
    bins = triton.next_power_of_2(experts + 1)
    block_chunk = max(1, min(64, 8192 // bins))
    if one_program:
        launch(_align_counts)[(1,)](
            flat, cursor, block_expert, used, sorted_pairs, pairs, experts_min, experts, blocks,
            BLOCK_M=block_m, BINS=bins, CHUNK=ALIGN_CHUNK, BLOCK_CHUNK=block_chunk, num_warps=8,
        )
        return sorted_pairs, block_expert, used
    counts = torch.zeros(experts, dtype=torch.int32, device=device)
    launch(_align_histogram)[(triton.cdiv(rows, HISTOGRAM_CHUNK),)](
        flat, counts, sorted_pairs, pairs, rows, experts_min, experts, BINS=bins, CHUNK=HISTOGRAM_CHUNK,
        num_warps=4,
    )
    launch(_align_offsets)[(triton.cdiv(blocks, block_chunk),)](
        counts, cursor, block_expert, used, experts, blocks, BLOCK_M=block_m, BINS=bins,
        BLOCK_CHUNK=block_chunk, num_warps=4,
    )
    launch(_align_scatter)[(triton.cdiv(pairs, SCATTER_CHUNK),)](
        flat, cursor, sorted_pairs, pairs, experts_min, experts, CHUNK=SCATTER_CHUNK, num_warps=4
    )
    return sorted_pairs, block_expert, used


@functools.cache
def multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _tma_device(device: torch.device) -> bool:
    """Hopper or newer, and a Triton with device-side tensor descriptors and flattened persistent loops."""
    flatten = "flatten" in inspect.signature(tl.range).parameters
    return flatten and hasattr(tl, "make_tensor_descriptor") and torch.cuda.get_device_capability(device) >= (9, 0)


def _torch_allocation(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> bool:
    """Device-side descriptors live in scratch memory that Triton asks its allocator for. Set one that
    takes it from torch's caching allocator (so CUDA graphs capture it too) unless the caller set their
    own; False where this Triton's allocator cannot be inspected (then no descriptors are used)."""
    try:
        from triton.runtime import _allocation
    except ImportError:
        return False
    current = getattr(_allocation, "_allocator", None)
    null = getattr(_allocation, "NullAllocator", None)
    if current is None or null is None or not hasattr(triton, "set_allocator"):
        return False
    if isinstance(current.get(), null):
        triton.set_allocator(_torch_allocation)
    return True


def tma_ready(down: torch.Tensor, intermediate: torch.Tensor, traced: bool) -> bool:
    """Whether `_down_kernel_tma` can read these operands: a Hopper device, rows contiguous in their last
    dimension and 16-byte aligned (strides, offsets and, outside tracing, the address; storage from
    torch's CUDA allocator starts 512-byte aligned), and a Triton allocator for the descriptors."""
    if not _tma_device(down.device):
        return False
    per_16_bytes = 16 // down.element_size()
    offsets = (*down.stride()[:-1], down.storage_offset(), intermediate.stride(0))
    if down.stride(-1) != 1 or not all(isinstance(v, int) and v % per_16_bytes == 0 for v in offsets):
        return False
    if not traced and down.data_ptr() % 16:
        return False
    return _ensure_allocator()


def _weight_strides(stacked: torch.Tensor, permuted: bool) -> tuple[int, int, int]:
    """(expert, k, n) strides of a stacked weight read as [E, in, out], whichever layout it is in."""
    se, s1, s2 = stacked.stride()
    return (se, s2, s1) if permuted else (se, s1, s2)


def fused_moe(
    hidden_states: torch.Tensor,
    table: torch.Tensor,
    router_weights: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    permuted: bool,
    activation: str,
    experts_min: int,
    config: MoEConfig | None = None,
    launch=_direct,
) -> torch.Tensor:
    """The op's result for stacked gate/up/down views ([E, out, in] if permuted, else [E, in, out]).

    `launch` wraps each kernel before its launch: `torch.library.wrap_triton` when inductor traces the
    call (then every size may be symbolic), else the kernel itself.
    """
    tokens, hidden = hidden_states.shape
    experts = gate.shape[0]
    inter = gate.shape[1] if permuted else gate.shape[2]
    top_k = table.shape[1]
    pairs = tokens * top_k
    out = torch.empty(tokens, hidden, dtype=hidden_states.dtype, device=hidden_states.device)
    if tokens == 0:
        return out
    config = config or choose_config(pairs, experts, permuted)
    table = table.contiguous()
    sorted_pairs, block_expert, used = align(table, experts_min, experts, config.block_m, launch)
    num_pid_m = block_expert.numel()
    x = hidden_states
    cg, cd = config.gate_up, config.down
    intermediate = torch.empty(num_pid_m * config.block_m, inter, dtype=x.dtype, device=x.device)
    se, sk, sn = _weight_strides(gate, permuted)
    if up.stride() != gate.stride():
        raise ValueError("gate and up stacks must share strides")
    grid = (num_pid_m * triton.cdiv(inter, cg.block_n),)
    launch(_gate_up_kernel)[grid](
        x, gate, up, intermediate, sorted_pairs, block_expert, used,
        pairs, top_k, hidden, inter, num_pid_m,
        x.stride(0), x.stride(1), se, sk, sn, intermediate.stride(0),
        ACT=ACTIVATION_CODES[activation], BLOCK_M=cg.block_m, BLOCK_N=cg.block_n, BLOCK_K=cg.block_k,
        GROUP_M=cg.group_m, EVEN_K=hidden % cg.block_k == 0, num_warps=cg.num_warps,
        num_stages=cg.num_stages,
    )
    y = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    se, sk, sn = _weight_strides(down, permuted)
    tiles = num_pid_m * triton.cdiv(hidden, cd.block_n)
    if cd.persistent_tma and tma_ready(down, intermediate, traced=launch is not _direct):
        programs = multiprocessors(x.device)
        launch(_down_kernel_tma)[(torch.sym_min(tiles, programs),)](
            intermediate, down, y, sorted_pairs, block_expert, used,
            pairs, inter, hidden, intermediate.shape[0], experts,
            se, sk, sn, y.stride(0),
            PERMUTED=permuted, BLOCK_M=cd.block_m, BLOCK_N=cd.block_n, BLOCK_K=cd.block_k, GROUP_M=cd.group_m,
            PROGRAMS=programs, num_warps=cd.num_warps, num_stages=cd.num_stages,
        )
    else:
        launch(_down_kernel)[(tiles,)](
            intermediate, down, y, sorted_pairs, block_expert, used,
            pairs, inter, hidden, num_pid_m,
            intermediate.stride(0), se, sk, sn, y.stride(0),
            BLOCK_M=cd.block_m, BLOCK_N=cd.block_n, BLOCK_K=cd.block_k, GROUP_M=cd.group_m,
            EVEN_K=inter % cd.block_k == 0, num_warps=cd.num_warps, num_stages=cd.num_stages,
        )
    block_h = min(1024, triton.next_power_of_2(hidden))
    launch(_combine_kernel)[(tokens, triton.cdiv(hidden, block_h))](
        y, table, router_weights.contiguous(), out, hidden, experts_min, experts,
        TOP_K=top_k, BLOCK_H=block_h, num_warps=4,
    )
    return out
