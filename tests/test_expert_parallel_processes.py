"""Expert parallelism across processes, with transformers' own EP on real process groups (gloo, CPU).

Every rank loads a tiny Mixtral / Qwen3-MoE with `DistributedConfig(ep_size=ranks)`: its experts are
DTensor parameters sharded by expert, and transformers' all-reduce EP remaps the router's ids to local
ids with a sentinel and masks the weights. On every rank each MoE layer must become one fused call on the
router's own ids with the rank's expert window, the all-reduce must stay in the graph after it (no graph
break), and the output must equal the single-process model. The runs are `tools/expert_parallel.py`,
the script behind the README's table; each rank count is one spawn of processes for all its cases.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import torch_release
from tools import expert_parallel as ep

pytestmark = [
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built"),
    pytest.mark.skipif(ep.transformers_expert_parallel() is not None, reason=str(ep.transformers_expert_parallel())),
]

CASES = [ep.Config(2, model, form) for model in ep.MODELS for form in ep.FORMS]
CASES += [ep.Config(4, "qwen3_moe", "grouped_mm"), ep.Config(4, "mixtral", "batched_mm")]
CASES += [ep.Config(2, "qwen3_moe", "batched_mm", attention="tensor_parallel")]
CASES += [ep.Config(2, "mixtral", "grouped_mm", "all_to_all")]


@pytest.fixture(scope="module")
def results():
    # The fake Gaudi bridge is registered in each rank (spawned processes), never in this one: the
    # v1.19 schemas on 2 ranks, the newest (with total_experts) on 4.
    two = ep.run([c for c in CASES if c.ranks == 2], setup="tests.hpu_contract:register_fake_gaudi_bridge")
    four = ep.run([c for c in CASES if c.ranks == 4], setup="tests.hpu_contract:register_newest_fake_gaudi_bridge")
    return dict(two + four)


@pytest.mark.parametrize("config", [c for c in CASES if c.ep_implementation == "all_reduce"], ids=str)
def test_every_rank_fuses_every_layer_with_its_window_and_equals_one_process(results, config):
    ranks = results[config]
    local = 8 // config.ranks
    for r in ranks:
        assert r.fused == r.moe_layers == 2, r.report
        window = f"ids {r.rank * local}..{(r.rank + 1) * local - 1} of the router's 8 (expert-parallel rank {r.rank})"
        assert all(window in w for w in r.windows), r.report
        assert r.graph_breaks == 0 and r.recompiles == 0 and r.compiles == 1, r.report
        assert r.fused_feeds_collective, "the all-reduce must follow each fused call in the same graph"
        assert not r.fallbacks and not r.declined, r.report
        assert r.max_difference < 1e-5, (r.max_difference, r.report)
        assert r.eager_difference < 1e-5  # transformers' EP itself equals one process


@pytest.mark.parametrize("config", [c for c in CASES if c.ep_implementation == "all_reduce"], ids=str)
def test_the_gaudi_kernel_gets_the_router_ids_the_window_and_the_global_count(results, config):
    for r in results[config]:
        local = 8 // config.ranks
        assert len(r.kernel_calls) == 2
        for call in r.kernel_calls:
            assert call["op"] == "hpu.mixture_of_experts.fused_weights"
            assert (call["experts_min"], call["experts_max"]) == (r.rank * local, (r.rank + 1) * local - 1)
            # The v1.19 schema has no total_experts (2 ranks); the newest bridge's gets the global count.
            assert call["total_experts"] == (8 if config.ranks == 4 else None), call
            assert call["ids_from"] == "aten.topk.default", call  # the router's own ids, not the remapped


def test_all_to_all_mode_is_reported_with_its_break_and_advice(results):
    (config,) = [c for c in CASES if c.ep_implementation == "all_to_all"]
    for r in results[config]:
        assert r.graph_breaks > 0 and r.fused == 0
        # torch 2.9's dynamo breaks earlier, at transformers' context manager around the experts, so the
        # exchange's .tolist() is never traced there; from 2.10 the break is the exchange's, with advice.
        if torch_release() >= (2, 10):
            assert any("exchanges tokens between ranks (all-to-all)" in a for a in r.advice), r.advice
        assert all("internal error" not in f for f in r.fallbacks), r.fallbacks
        assert r.max_difference < 1e-5


def test_the_readme_script_runs_as_written(tmp_path):
    """The README's "script of your own", under torchrun on 2 ranks, on a saved tiny model."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme[readme.index("## Expert parallel across processes") :]
    script = section[section.index("In a script of your own") :].split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "ep_example.py").write_text(script)
    model = ep.save_tiny_model("mixtral", str(tmp_path))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "ep_example.py", model]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    for window in ("ids 0..3 of the router's 8 (expert-parallel rank 0)", "ids 4..7 of the router's 8 (expert-parallel rank 1)"):
        assert result.stdout.count(window) == 2, result.stdout
