"""kyegomez's SwitchMoE: a "switch" gate that scatters along the wrong axis, then every expert on every token.

Mirrors kyegomez/SwitchTransformers `switch_transformers/model.py` at commit 36a1ea0 (`SwitchGate`,
`SwitchMoE.forward`), the only file of the package's model, with its expert `FeedForward` read from
kyegomez/zeta `zeta/nn/modules/feedforward.py` at fa3a2d6 (the zeta commit current when 36a1ea0 was made;
`from zeta.nn import FeedForward` resolves to it). The layer is constructed as `SwitchTransformerBlock` does,
`SwitchMoE(dim, dim * mult, dim, num_experts)`, with the defaults `capacity_factor=1.0`,
`use_aux_loss=False` and the gate's `epsilon=1e-6`. The gate works on the unflattened [B, S, D] input: a
softmax over the last axis of a biased nn.Linear, `capacity = int(capacity_factor * x.size(0))` (the batch
size, not the token count), the top-1 ids from `topk(1, dim=-1)`, and a mask from
`torch.zeros_like(scores).scatter_(1, ids, 1)`: on the 3-D scores dim 1 is the sequence axis, so the ones
land at mask[b, id, 0] (expert column 0, at the sequence positions named by chosen expert ids), which is
what the code computes and is kept as such (it needs num_experts <= S). The masked scores are divided by
their sum over dim 0 (the batch) + epsilon and multiplied by the capacity; with `use_aux_loss` the gate
would also return the mean squared difference of the dim-0 and dim-1 sums (kept behind the flag, not
taken), else None. The layer runs every expert on the whole of x in a list comprehension, checks
`torch.isnan(gate_scores).any()` and on NaN prints a line and zeroes the NaNs in place through a boolean
index, stacks the expert outputs on a new last axis, zeroes NaNs there the same way, multiplies by
`gate_scores.unsqueeze(-2)`, sums over the expert axis and returns (output, loss). The expert is zeta's
default `FeedForward(dim, dim, mult)`: `Sequential(Sequential(Linear(dim, int(dim * mult)), GELU()),
Dropout(0.0), Linear(int(dim * mult), dim))`, both Linears biased; its relu-squared/swish/GLU/post-LN/
zero-init options are off by default and not mirrored. `mult` is 0.5 here so the expert width is the tiny 8
(the default 4 would give 64); `hidden_dim` and `output_dim` are stored and never read, as in the source.
Experts are 4 (SwitchTransformer's default is 3; 8 would let an expert id pass the 7-token sequence axis).
Left out: the zetascale import (the FeedForward is written out here), the attention block and the model
around the layer; nothing of `SwitchGate` or `SwitchMoE.forward`.
Constructs: a data-dependent `if torch.isnan(...).any():` with a `print` (twice, once per tensor), in-place
boolean-mask index_put `t[torch.isnan(t)] = 0`, `scatter_` on a `zeros_like` mask, a Python int from
`x.size(0)` as a scale, a list comprehension over the expert ModuleList, `torch.stack` on the last axis and
a broadcast multiply-sum over all experts (dense combine), an optional-loss tuple return.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._shell import Source, tiny

SOURCE = Source("kyegomez/SwitchTransformers", "switch_transformers/model.py",
                "36a1ea01448e56242222b68201207a7219d72b4b", "SwitchMoE.forward")
HIDDEN, INTER, EXPERTS = 16, 8, 4
MULT = INTER / HIDDEN  # int(HIDDEN * MULT) == INTER


class FeedForward(nn.Module):
    def __init__(self, dim: int, dim_out: int | None = None, mult=4, dropout: float = 0.0):
        super().__init__()
        inner_dim = int(dim * mult)
        dim_out = dim if dim_out is None else dim_out
        project_in = nn.Sequential(nn.Linear(dim, inner_dim, bias=True), nn.GELU())
        self.ff = nn.Sequential(project_in, nn.Dropout(dropout), nn.Linear(inner_dim, dim_out, bias=True))

    def forward(self, x):
        return self.ff(x)


class SwitchGate(nn.Module):
    def __init__(self, dim, num_experts: int, capacity_factor: float = 1.0, epsilon: float = 1e-6):
        super().__init__()
        self.dim = dim
        self.num_experts = num_experts
        self.capacity_factor = capacity_factor
        self.epsilon = epsilon
        self.w_gate = nn.Linear(dim, num_experts)

    def forward(self, x: Tensor, use_aux_loss=False):
        gate_scores = F.softmax(self.w_gate(x), dim=-1)
        capacity = int(self.capacity_factor * x.size(0))
        top_k_scores, top_k_indices = gate_scores.topk(1, dim=-1)
        mask = torch.zeros_like(gate_scores).scatter_(1, top_k_indices, 1)
        masked_gate_scores = gate_scores * mask
        denominators = masked_gate_scores.sum(0, keepdim=True) + self.epsilon
        gate_scores = (masked_gate_scores / denominators) * capacity

        if use_aux_loss:
            load = gate_scores.sum(0)
            importance = gate_scores.sum(1)
            loss = ((load - importance) ** 2).mean()
            return gate_scores, loss

        return gate_scores, None


class SwitchMoE(nn.Module):
    def __init__(
        self,
        dim: int = HIDDEN,
        hidden_dim: int = INTER,
        output_dim: int = HIDDEN,
        num_experts: int = EXPERTS,
        capacity_factor: float = 1.0,
        mult: float = MULT,
        use_aux_loss: bool = False,
    ):
        super().__init__()
        self.dim = dim
        self.hidden_dim = hidden_dim
        self.output_dim = output_dim
        self.num_experts = num_experts
        self.capacity_factor = capacity_factor
        self.mult = mult
        self.use_aux_loss = use_aux_loss
        self.experts = nn.ModuleList([FeedForward(dim, dim, mult) for _ in range(num_experts)])
        self.gate = SwitchGate(dim, num_experts, capacity_factor)

    def forward(self, x: Tensor):
        gate_scores, loss = self.gate(x, use_aux_loss=self.use_aux_loss)

        expert_outputs = [expert(x) for expert in self.experts]

        if torch.isnan(gate_scores).any():
            print("NaN in gate scores")
            gate_scores[torch.isnan(gate_scores)] = 0

        stacked_expert_outputs = torch.stack(expert_outputs, dim=-1)  # [B, S, D, E]
        if torch.isnan(stacked_expert_outputs).any():
            stacked_expert_outputs[torch.isnan(stacked_expert_outputs)] = 0

        moe_output = torch.sum(gate_scores.unsqueeze(-2) * stacked_expert_outputs, dim=-1)

        return moe_output, loss


def build():
    return tiny(SwitchMoE, HIDDEN)
