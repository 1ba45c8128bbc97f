"""transformers 4.x GraniteMoE / GraniteMoE-Shared / JetMoE: sorted rows cut into per-expert segments.

Mirrors transformers 4.55.4 (release wheel) `src/transformers/models/granitemoe/modeling_granitemoe.py`
(the same classes in 4.57.6, JetMoE's and GraniteMoE-Shared's copies): `GraniteMoeTopKGating` (top-k on
the logits, softmax over the k, per-expert counts `zeros.scatter(1, ids, 1).long().sum(0).tolist()`,
slots sorted by expert with `sort`, token of each slot `perm // k`, weights gathered in that order),
`GraniteMoeParallelExperts` (`inputs.split(expert_size)`, one `F.linear` per expert on its segment of a
stacked [E, out, in] weight, `cat`) used twice around `act(gate) * up` on all rows, and the combine
`zeros.index_add(0, batch_index, expert_outputs * batch_gates[:, None])`. Written as plain PyTorch: the
same constructs, in this project's words.

`.tolist()` makes the counts Python ints: dynamo breaks the graph there unless it may keep them
symbolic (`capture_scalar_outputs`). The expert-loop adapter recognises the count read from the
router's source and switches that on for hpu_moe's own trace; each layer must then become ONE
`fused_weights` call (w12 = input_linear[e], w3 = output_linear[e]).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._common import ACTIVATIONS, TinyDecoder, finish, settings
from ._expected import Expected

EXPECTED = Expected(fused=2, overload="fused_weights")
ADAPTER = "hit_expert_loops"


class SegmentGate(nn.Module):
    """The router: top-k, softmax over the k, per-expert counts as ints, slots sorted by expert."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.num_experts, self.top_k = cfg["num_experts"], cfg["top_k"]
        self.layer = nn.Linear(cfg["hidden"], cfg["num_experts"], bias=False)

    def forward(self, hidden_states):
        logits = self.layer(hidden_states).float()
        top_k_logits, top_k_indices = logits.topk(self.top_k, dim=1)
        top_k_gates = torch.softmax(top_k_logits, dim=1).type_as(hidden_states)
        zeros = torch.zeros([top_k_gates.size(0), self.num_experts], dtype=top_k_gates.dtype)
        gates = zeros.scatter(1, top_k_indices, 1)
        expert_size = gates.long().sum(0)
        expert_size = expert_size.tolist()
        _, index_sorted_experts = top_k_indices.flatten().sort(0)
        batch_index = index_sorted_experts.div(self.top_k, rounding_mode="trunc")
        batch_gates = top_k_gates.flatten()[index_sorted_experts]
        return index_sorted_experts, batch_index, batch_gates, expert_size


class SegmentLinear(nn.Module):
    """One linear map per expert, each on its segment of the sorted rows."""

    def __init__(self, num_experts: int, input_size: int, output_size: int):
        super().__init__()
        self.num_experts = num_experts
        self.weight = nn.Parameter(torch.empty(num_experts, output_size, input_size))

    def forward(self, inputs, expert_size):
        input_list = inputs.split(expert_size, dim=0)
        return torch.cat([F.linear(input_list[i], self.weight[i]) for i in range(self.num_experts)], dim=0)


class SegmentMoE(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        hidden, inter, experts = cfg["hidden"], cfg["intermediate"], cfg["num_experts"]
        self.activation = ACTIVATIONS[cfg["activation"]]
        self.input_linear = SegmentLinear(experts, hidden, 2 * inter)
        self.output_linear = SegmentLinear(experts, inter, hidden)
        self.router = SegmentGate(cfg)

    def forward(self, layer_input):
        bsz, length, emb_size = layer_input.size()
        layer_input = layer_input.reshape(-1, emb_size)
        _, batch_index, batch_gates, expert_size = self.router(layer_input)
        hidden_states = self.input_linear(layer_input[batch_index], expert_size)
        chunked = hidden_states.chunk(2, dim=-1)
        hidden_states = self.activation(chunked[0]) * chunked[1]
        expert_outputs = self.output_linear(hidden_states, expert_size) * batch_gates[:, None]
        zeros = torch.zeros((bsz * length, emb_size), dtype=expert_outputs.dtype, device=expert_outputs.device)
        return zeros.index_add(0, batch_index, expert_outputs).view(bsz, length, emb_size)


def build(**overrides):
    """(TinyDecoder of GraniteMoE-style blocks, (x [1, T, H],)); the routing is GraniteMoE's own."""
    cfg = settings(overrides, exclude=("routing", "router_fp32"))
    return finish(TinyDecoder(SegmentMoE, cfg), cfg)
