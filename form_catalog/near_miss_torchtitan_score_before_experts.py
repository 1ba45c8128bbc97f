"""Near miss: torchtitan's `score_before_experts=True` scales each routed row before the experts.

Mirrors pytorch/torchtitan `torchtitan/models/moe/moe.py` at commit de335b3, `MoE.forward` with
`MoEArgs.score_before_experts=True` (that file's default, used by its Llama4 configuration): the gathered
rows are multiplied by their routing scores, `routed_input = (routed_input.float() * scores).to(dtype)`,
and the expert outputs are summed back with `scatter_add` unweighted. The experts are a non-linear MLP,
so MLP(w * x) != w * MLP(x): the fused kernel, which weights expert outputs, would compute something
else. The rewrite must leave each layer as it is and report it declined, naming the input scaling.
"""

from __future__ import annotations

import torch

from ._common import TinyDecoder, finish, settings
from ._expected import Expected
from .torchtitan_grouped_experts import GroupedExpertsMoE, check_can_compile

EXPECTED = Expected(fused=0, declined=2, reason="input")


def build(**overrides):
    """(TinyDecoder of GroupedExpertsMoE layers scoring inputs, (x [1, T, H],)); bfloat16."""
    cfg = settings({"dtype": torch.bfloat16, **overrides}, exclude=("routing", "router_fp32"))
    check_can_compile(cfg, "near_miss_torchtitan_score_before_experts")
    return finish(TinyDecoder(lambda c: GroupedExpertsMoE(c, score_before_experts=True), cfg), cfg)
