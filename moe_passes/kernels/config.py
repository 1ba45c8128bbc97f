"""Tile shapes for the fused MoE kernel, chosen from the problem's shape alone (no autotuning at run time).

Why a table and not an autotuner: the op is called once per layer per step with shapes that change with
the batch, and an autotuner would time every new shape inside the user's step. The table follows the
usual split of MoE GEMMs (vLLM's tuned configurations for the H100 show the same pattern): few rows per
expert (decode) stream weights, so tiles are short in M and the grid is spread over N; many rows per
expert (prefill) are matrix-unit bound, so tiles are large and deeply pipelined. Every entry was timed
on an H100 with `tools/bench_kernel.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TileConfig:
    """One GEMM's tiles: rows per block (shared by both GEMMs: the alignment pads to it), N, K, warps."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    persistent_tma: bool = False  # the down GEMM only: `_down_kernel_tma` where the device and operands allow


@dataclass(frozen=True)
class MoEConfig:
    """The tiles of the gate/up GEMM (block_n per half) and of the down GEMM; block_m is shared."""

    gate_up: TileConfig
    down: TileConfig

    @property
    def block_m(self) -> int:
        return self.gate_up.block_m


def rows_per_expert(pairs: int, experts: int) -> float:
    """Mean routed rows per expert: the M of each expert's GEMM."""
    return pairs / max(experts, 1)


def choose_config(pairs: int, experts: int, permuted: bool = True) -> MoEConfig:
    """The tiles for `pairs` routed (token, expert) pairs spread over `experts` experts, weights stored
    [E, out, in] if `permuted` (nn.Linear's layout) else [E, in, out]."""
    m = rows_per_expert(pairs, experts)
    if m <= 16:
        return MoEConfig(TileConfig(16, 64, 128, 1, 4, 4), TileConfig(16, 64, 128, 1, 4, 4))
    if m <= 32:
        return MoEConfig(TileConfig(32, 64, 128, 4, 4, 4), TileConfig(32, 64, 128, 4, 4, 4))
    if m <= 128:
        group_m = _group_m(experts, 4)
        return MoEConfig(TileConfig(64, 64, 64, group_m, 4, 4), TileConfig(64, 128, 64, group_m, 8, 4))
    # Weights [E, in, out] (contiguous along N) pipeline better 3 deep at these tiles: 5-9% on the gate/up
    # GEMM at Mixtral and Qwen3 sizes, T = 8192, where 4 stages stay best for [E, out, in] (H100, 11-25).
    stages = 4 if permuted else 3
    group_m = _group_m(experts, 8)
    return MoEConfig(
        TileConfig(128, 128, 64, group_m, 8, stages),
        TileConfig(128, 256, 64, group_m, 8, 4, persistent_tma=True),
    )


def _group_m(experts: int, many_experts: int) -> int:
    """Row blocks that share each column sweep. With few experts the row blocks are few and each weight
    tile is read by several of them: one sweep over all of them lets the later reads come from L2.
    `tools/bench_kernel.py --group-m --in-out` (H100, 11-25, `docs/bench/kernel_group_m_1125.log`, GPU
    time per call), Mixtral sizes (8 experts), 32 against 8, both weight layouts: 4.2-5.0% less at
    T = 1024, 5.0-5.8% at T = 512 (11% against the 4 that bracket had); at T = 8192, where the row blocks
    are many, the groups differ by less than the run-to-run noise. Qwen3 sizes (128 experts): the
    table's 4 or 8 is the fastest or within 1% of it, and 32 is 1-5% slower."""
    return 32 if experts <= 16 else many_experts


def padded_capacity(pairs: int, experts: int, block_m: int) -> int:
    """Rows the expert-sorted, block-padded layout may need: each non-empty expert wastes < block_m rows.

    At most min(pairs, experts) experts are non-empty, so this bound needs no look at the routing (and
    no host sync). `torch.sym_min`: `pairs` is symbolic when inductor traces the kernel, and a plain
    `min` would add a guard (and a recompile) on it.
    """
    return pairs + torch.sym_min(pairs, experts) * (block_m - 1)
