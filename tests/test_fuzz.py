"""Differential fuzzing: random MoE blocks compiled with hpu_moe equal eager, fused or declined with a reason.

The generator and the check live in tests/fuzz_models.py. This test runs a bounded, derandomized budget
(MOE_FUZZ_CASES, default 100: about two minutes of one CI worker); tools/fuzz.py runs long budgets and
reports every failure at once, and the GPU machine's 16 cores run MOE_FUZZ_CASES=300.
"""

from __future__ import annotations

import collections
import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from tests.fuzz_models import Case, cases, expect_fused, run_case

BUDGET = int(os.environ.get("MOE_FUZZ_CASES", "100"))


def test_fuzzed_moe_blocks_are_fused_and_equal_or_declined_with_a_reason():
    kinds: collections.Counter[str] = collections.Counter()

    @settings(
        max_examples=BUDGET,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(cases())
    def check(case):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outcome = run_case(case)
        kinds[outcome.kind] += 1
        assert not outcome.failed, str(outcome)

    check()
    print(f"fuzz: {sum(kinds.values())} cases: {dict(kinds)}")
    assert sum(kinds.values()) >= BUDGET
    assert kinds["fused"] > BUDGET // 4 and kinds["declined"] > 0, dict(kinds)  # not vacuous


REGRESSIONS = [
    # grouped_mm with one token and top-1: the inverse permutation's arange(1) is viewed as a scalar
    Case(
        "grouped_mm", "stacked", "topk_softmax", False, 9, 1, 8, 24, "silu", "bfloat16", "none", 1, False, 0
    ),
    # grouped_mm with one expert: make_fx drops histc's default max=0, and the bins were misread
    Case("grouped_mm", "stacked", "softmax_topk", False, 1, 1, 8, 8, "gelu", "bfloat16", "none", 5, False, 0),
    # a shared expert added after a dense loop stays beside the fused call
    Case(
        "dense_mask", "stacked", "softmax_topk", True, 12, 3, 40, 6, "silu", "float32", "plain", 5, False, 1
    ),
    Case(
        "dense_scatter",
        "modulelist",
        "sigmoid_bias_renorm",
        True,
        4,
        3,
        3,
        18,
        "relu",
        "bfloat16",
        "gated",
        3,
        False,
        205,
    ),
    # one token, k < E: the routing probes must still reach every expert (decode)
    Case(
        "sparse_loop",
        "modulelist",
        "sigmoid_bias",
        False,
        8,
        3,
        17,
        22,
        "silu",
        "float32",
        "none",
        1,
        False,
        4560,
    ),
    Case(
        "dense_mask",
        "separate",
        "softmax_topk_renorm",
        True,
        12,
        1,
        16,
        8,
        "silu",
        "float32",
        "none",
        1,
        False,
        3,
    ),
]


@pytest.mark.parametrize(
    "case", REGRESSIONS, ids=lambda c: f"{c.experts}-{c.storage}-E{c.num_experts}-T{c.tokens}"
)
def test_fuzz_regressions(case):
    outcome = run_case(case)
    assert expect_fused(case) and outcome.kind == "fused", str(outcome)


def test_empty_batch_loops_are_declined_with_the_reason():
    case = Case(
        "sparse_loop", "modulelist", "softmax_topk", False, 2, 1, 4, 4, "gelu", "float32", "none", 0, False, 0
    )
    outcome = run_case(case)
    assert outcome.kind == "declined" and "batch is empty" in outcome.detail, str(outcome)


def test_the_check_catches_a_wrong_rewrite(monkeypatch):
    """The oracle is not vacuous: a rewrite with the wrong activation is reported as a mismatch."""
    import dataclasses

    import moe_passes.passes.pipeline as pipeline

    original = pipeline.rewrite_experts
    monkeypatch.setattr(
        pipeline,
        "rewrite_experts",
        lambda graph, match, target: original(graph, dataclasses.replace(match, activation="relu"), target),
    )
    case = REGRESSIONS[1]
    outcome = run_case(case)
    assert outcome.kind == "mismatch", str(outcome)
    assert torch.isfinite(torch.tensor(outcome.max_diff))
