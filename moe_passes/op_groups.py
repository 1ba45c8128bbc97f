"""Routed pairs grouped by expert: the one sort the portable op's forward and backward both read.

A pair is (token, position in the token's routing row); its slot is token * top_k + position. Pairs
whose id lies outside experts_min..experts_max go to one extra bucket past every group, which no path
ever runs, so an expert-parallel rank computes only its own experts.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

# Where torch._grouped_mm runs, and in which dtypes (what each device's kernel takes).
GROUPED_DEVICES = {"cuda", "cpu"}
GROUPED_DTYPES = {"cuda": (torch.bfloat16,), "cpu": (torch.bfloat16, torch.float32)}
# On CPU the grouped path wins while experts get few rows each, the loop of plain matmuls beyond
# (timed with 8 experts, top-2, float32, 2 threads: 16 rows 1.41 vs 1.70 ms, 64 rows 15.0 vs 15.9 ms,
# 512 rows 25.9 vs 18.4 ms per call).
CPU_GROUPED_MAX_ROWS = 128


@dataclass(frozen=True)
class SortedPairs:
    """The routed pairs in expert order. Built from traceable ops only (no data-dependent shape), so that
    AOTAutograd can trace a backward that sorts the pairs again."""

    order: torch.Tensor  # [T*k] slots, sorted by local expert (stable), out-of-range pairs last
    outside: torch.Tensor  # [T*k] bool, by slot: the pair's id is not one of the range's experts
    ends: torch.Tensor  # [count] int32: where each local expert's group ends in sorted order
    top_k: int

    @property
    def tokens(self) -> torch.Tensor:
        """The token of each sorted pair."""
        return self.order // self.top_k

    def offsets(self) -> torch.Tensor:
        """torch._grouped_mm's group ends (int32), one per expert of the range."""
        return self.ends

    def outside_sorted(self) -> torch.Tensor:
        """[T*k, 1] bool in sorted order: rows no group covers (grouped_mm leaves them unwritten)."""
        return self.outside[self.order].unsqueeze(-1)

    def slot_order(self) -> torch.Tensor:
        """The inverse permutation: each slot's position in sorted order (a gather brings rows back)."""
        positions = torch.arange(self.order.shape[0], device=self.order.device)
        return torch.empty_like(self.order).scatter_(0, self.order, positions)

    def groups(self) -> Iterator[tuple[int, torch.Tensor]]:
        """(local expert, its slots) for each expert of the range that received pairs.

        Reads the group ends on the host: the loop path's one sync.
        """
        start = 0
        for expert, end in enumerate(self.ends.tolist()):
            if end > start:
                yield expert, self.order[start:end]
            start = end


def sort_pairs(table: torch.Tensor, experts_min: int, count: int) -> SortedPairs:
    """Sort the routing table's pairs by the local expert they go to."""
    local = table.reshape(-1).long() - experts_min
    outside = (local < 0) | (local >= count)
    local = local.masked_fill(outside, count)
    order = torch.argsort(local, stable=True)
    experts = torch.arange(count, device=local.device, dtype=local.dtype)
    ends = torch.searchsorted(local[order], experts, right=True).to(torch.int32)
    return SortedPairs(order, outside, ends, table.shape[1])


def grouped_mm_applies(hidden_states: torch.Tensor, table: torch.Tensor, count: int) -> bool:
    """Whether grouped matmuls over stacked weights are the path for these inputs (else the loop)."""
    device = hidden_states.device.type
    if getattr(torch, "_grouped_mm", None) is None or device not in GROUPED_DEVICES:
        return False
    if hidden_states.dtype not in GROUPED_DTYPES.get(device, ()):
        return False
    # Many rows per expert: the loop's plain matmuls are faster on CPU.
    return device != "cpu" or table.numel() <= CPU_GROUPED_MAX_ROWS * count


def sum_slots(per_slot: torch.Tensor, tokens: int, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """[T * k, H] contributions in slot order -> [T, H]: a plain reduction over k.

    Cheaper than `index_add_` into [T, H] (serial on CPU, atomic on CUDA) and the same float32 sum.
    """
    return per_slot.view(tokens, top_k, per_slot.shape[-1]).sum(1).to(dtype)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for the half types and float32, float64 for float64 (what gradcheck needs)."""
    return torch.promote_types(torch.float32, dtype)
