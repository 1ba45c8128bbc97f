"""The expert-sorted, block-padded layout both fused GEMMs read, and checks of it (runs anywhere).

Layout (for pairs p = token * top_k + slot, routed to local expert e = id - experts_min):
- `sorted_pairs` [num_blocks * block_m] int32: the pairs grouped by expert, each expert's group padded
  with the sentinel `pairs` to a multiple of `block_m`, so a block of rows never mixes experts;
- `block_expert` [num_blocks] int32: the local expert of each block, -1 past the used blocks;
- `used_rows` [1] int32: the padded rows in use (a multiple of block_m).
Pairs routed outside [experts_min, experts_max] are left out: they contribute nothing.

`align_reference` builds it with plain torch ops (the CPU tests' oracle); the CUDA kernel builds the
same layout except for the order of pairs inside one expert's group, which `check_alignment` ignores.
"""

from __future__ import annotations

import torch

from .config import padded_capacity


def block_count(pairs: int, experts: int, block_m: int) -> int:
    return -(-padded_capacity(pairs, experts, block_m) // block_m)


def align_reference(table: torch.Tensor, experts_min: int, experts: int, block_m: int):
    """(sorted_pairs, block_expert, used_rows) for a [T, k] routing table, with torch ops only."""
    pairs = table.numel()
    blocks = block_count(pairs, experts, block_m)
    device = table.device
    local = table.reshape(-1).long() - experts_min
    valid = (local >= 0) & (local < experts)
    local = torch.where(valid, local, experts)
    counts = torch.zeros(experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, local, torch.ones_like(local))
    counts = counts[:experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    order = torch.argsort(local, stable=True)
    sorted_local = local[order]
    group_start = torch.cumsum(counts, 0) - counts
    kept = sorted_local < experts
    expert_of = sorted_local.clamp(max=max(experts - 1, 0))
    rank = torch.arange(pairs, device=device) - group_start[expert_of]
    destination = torch.where(kept, padded_start[expert_of] + rank, blocks * block_m)
    sorted_pairs = torch.full((blocks * block_m + 1,), pairs, dtype=torch.int32, device=device)
    sorted_pairs[destination] = order.to(torch.int32)
    used = padded_end[-1:] if experts else torch.zeros(1, dtype=torch.int64, device=device)
    block_start = torch.arange(blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_start < used, block_expert, -1)
    return sorted_pairs[:-1], block_expert.to(torch.int32), used.to(torch.int32)


def check_alignment(table, experts_min: int, experts: int, block_m: int, sorted_pairs, block_expert, used):
    """Raise AssertionError unless the three tensors are a valid layout for `table` (any in-group order)."""
    flat = table.reshape(-1).long().cpu() - experts_min
    pairs = flat.numel()
    sorted_pairs, block_expert = sorted_pairs.long().cpu(), block_expert.long().cpu()
    used = int(used.reshape(-1)[0])
    blocks = block_count(pairs, experts, block_m)
    assert sorted_pairs.shape == (blocks * block_m,) and block_expert.shape == (blocks,)
    assert used % block_m == 0 and used <= blocks * block_m
    assert bool((block_expert[used // block_m :] == -1).all()), "blocks past used rows must be -1"
    assert bool((sorted_pairs[used:] == pairs).all()), "rows past used rows must hold the sentinel"
    seen = torch.zeros(pairs, dtype=torch.int64)
    previous = -1
    for block in range(used // block_m):
        expert = int(block_expert[block])
        assert 0 <= expert < experts and expert >= previous, "blocks must go by expert, ascending"
        previous = expert
        rows = sorted_pairs[block * block_m : (block + 1) * block_m]
        real = rows[rows < pairs]
        assert bool((flat[real] == expert).all()), "a block holds a pair of another expert"
        seen[real] += 1
    in_range = (flat >= 0) & (flat < experts)
    assert bool((seen[in_range] == 1).all()), "every routed pair must appear exactly once"
    assert bool((seen[~in_range] == 0).all()), "pairs outside the expert range must be left out"
    counts = torch.bincount(flat[in_range], minlength=experts) if experts else torch.zeros(0)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum()), "padding must be minimal"
