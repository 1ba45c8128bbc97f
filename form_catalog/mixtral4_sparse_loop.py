"""transformers 4.x Mixtral: the sparse expert loop over experts named w1 (gate), w3 (up), w2 (DOWN).

Mirrors transformers 4.44.2 (release wheel) `src/transformers/models/mixtral/modeling_mixtral.py`:
`MixtralSparseMoeBlock.forward`, the `for expert_idx in range(self.num_experts)` loop with
`torch.where` and `index_add_` (shell in `_sparse_loop.py`; PR #32429 later iterated over the hit
experts only, which dynamo cannot capture at all), and `MixtralBlockSparseTop2MLP`:
`w2(act(w1(x)) * w3(x))`. Captured in one graph with `capture_dynamic_output_shape_ops=True`.

Mixtral's names are the trap: its `w2` is the DOWN projection and `w3` the up one, while the Gaudi
kernel's w2 is up and w3 is down (optimum-habana passes `w1=w1, w2=w3, w3=w2`). The rewrite reads
roles from the graph, never from names, and must emit ONE `default` call per layer with
w1 = experts[e].w1, w2 = experts[e].w3, w3 = experts[e].w2.
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import ACTIVATIONS, TinyDecoder, finish, settings
from ._expected import Expected
from ._sparse_loop import DYNAMO_CONFIG, SparseLoopMoE

EXPECTED = Expected(fused=2, overload="default")
__all__ = ["DYNAMO_CONFIG", "EXPECTED", "MixtralExpert", "build"]


class MixtralExpert(nn.Module):
    """`MixtralBlockSparseTop2MLP`: w1 = gate [I, H], w3 = up [I, H], w2 = down [H, I]."""

    def __init__(self, hidden: int, intermediate: int, activation: str = "silu"):
        super().__init__()
        self.w1 = nn.Linear(hidden, intermediate, bias=False)
        self.w2 = nn.Linear(intermediate, hidden, bias=False)
        self.w3 = nn.Linear(hidden, intermediate, bias=False)
        self.act_fn = ACTIVATIONS[activation]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        current_hidden_states = self.act_fn(self.w1(hidden_states)) * self.w3(hidden_states)
        return self.w2(current_hidden_states)


def build(**overrides):
    """(TinyDecoder of SparseLoopMoE layers of MixtralExperts, (x [1, T, H],)); every DEFAULTS key applies."""
    cfg = settings(overrides)
    make_expert = lambda c: MixtralExpert(c["hidden"], c["intermediate"], c["activation"])  # noqa: E731
    return finish(TinyDecoder(lambda c: SparseLoopMoE(c, make_expert), cfg), cfg)
