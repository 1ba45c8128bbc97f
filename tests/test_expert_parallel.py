"""Expert parallelism: a block holding a contiguous range of the router's experts lowers with that range
as experts_min/experts_max, and the ranks' outputs sum to the single-device model's.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from form_catalog import dynamo_config
from form_catalog import expert_parallel_sparse_loop as ep
from tests.helpers import assert_close_for_dtype, eager_output, run_hpu_moe
from tests.test_gaudi_contract import ROOT, SCRIPT


def range_arguments(node) -> tuple[int, int]:
    names = [a.name for a in node.target._schema.arguments]
    return node.args[names.index("experts_min")], node.args[names.index("experts_max")]


def run_rank(rank: int, world_size: int, **overrides):
    model, inputs = ep.build(rank=rank, world_size=world_size, layers=1, **overrides)
    with dynamo_config(ep):
        report, output, recorder = run_hpu_moe(model, inputs)
    return model, inputs, report, output, recorder


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_rank_lowers_with_its_expert_range_and_the_ranks_sum_to_one_device(world_size):
    experts = 8
    full, inputs = ep.build(world_size=1, rank=0, layers=1, num_experts=experts, top_k=3)
    (x,) = inputs
    shares = []
    for rank in range(world_size):
        model, _, report, output, recorder = run_rank(rank, world_size, num_experts=experts, top_k=3)
        local = experts // world_size
        (node,) = recorder.fused_nodes()
        assert range_arguments(node) == (rank * local, (rank + 1) * local - 1), str(report)
        assert [f.num_experts for f in report.fused] == [local]
        window = f"ids {rank * local}..{(rank + 1) * local - 1} of the router's {experts} (expert-parallel rank {rank})"
        assert f"{local} experts: {window}" in str(report)
        assert_close_for_dtype(output, eager_output(model, inputs))
        shares.append(output - x)  # one layer: x + moe(norm(x)); the share is this rank's moe output
    torch.testing.assert_close(x + sum(shares), eager_output(full, inputs), atol=1e-5, rtol=1e-4)


def test_a_rank_holding_fewer_experts_than_top_k_is_fused():
    model, inputs, report, output, recorder = run_rank(3, 4, num_experts=8, top_k=4)
    (node,) = recorder.fused_nodes()
    assert range_arguments(node) == (6, 7)
    assert_close_for_dtype(output, eager_output(model, inputs))


def test_rank_zero_of_a_wider_router_is_fused_with_the_ids_above_it_contributing_zero():
    model, inputs, report, output, recorder = run_rank(0, 2, num_experts=6, top_k=2)
    (node,) = recorder.fused_nodes()
    assert range_arguments(node) == (0, 2)
    assert_close_for_dtype(output, eager_output(model, inputs))


def test_a_loop_skipping_an_expert_of_its_range_is_declined():
    """Experts 2 and 4 of 6 (3 missing) are not a contiguous range: left as they are, with the reason."""
    model, inputs = ep.build(rank=0, world_size=1, layers=1, num_experts=6)
    moe = model.moes[0]

    def skipping(x):
        shape = x.size()
        flat = x.view(-1, shape[-1])
        weights, indices = moe.router(flat)
        y = torch.zeros_like(flat)
        for i in (2, 4):
            idx, top = torch.where(indices == i)
            y[idx] += moe.experts[i](flat[idx]) * weights[idx, top, None]
        return y.view(shape)

    moe.forward = skipping
    with dynamo_config(ep):
        report, output, recorder = run_hpu_moe(model, inputs)
    assert not recorder.fused_nodes(), str(report)
    assert any("contiguous range" in d.reason for d in report.declined), str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


def test_the_gaudi_op_receives_the_expert_range():
    code = SCRIPT.format(
        root=str(ROOT), form="expert_parallel_sparse_loop", dtype="bfloat16", inner="eager", target="auto"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(out["overloads"]) == {"hpu::mixture_of_experts.default"}
    local = 4 // ep.WORLD_SIZE
    assert [(c["experts_min"], c["experts_max"]) for c in out["calls"]] == [
        (ep.RANK * local, 2 * local - 1)
    ] * 2
    assert all(c["num_weights"] == local for c in out["calls"])
    assert out["max_error"] < 5e-2


def test_build_checks_rank_and_world_size():
    with pytest.raises(ValueError, match="divisible"):
        ep.build(world_size=3)
    with pytest.raises(ValueError, match="rank"):
        ep.build(rank=2, world_size=2)
