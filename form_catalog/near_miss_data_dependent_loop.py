"""Near miss: the transformers 5.x `eager` experts loop over the experts that were hit.

Mirrors transformers 5.23.0 (release wheel) `src/transformers/models/mixtral/modeling_mixtral.py`,
`MixtralExperts.forward` (the body 54 expert classes share; `experts_implementation="eager"`):
`expert_hit = greater(one_hot(ids, E + 1).permute(2, 1, 0).sum((-1, -2)), 0).nonzero()`, then
`for expert_idx in expert_hit:` with `torch.where`, `F.linear` on the stacked weights and `index_add_`.
Iterating a tensor of data-dependent length cannot be traced, so dynamo breaks the graph (even with
`capture_dynamic_output_shape_ops`) and no MoE layer reaches the passes whole.

The near miss is the catalog's dispatch: its blocks hand the experts function to the module at
construction (`self._experts_forward`), a value the expert-loop adapter does not follow (it reads the
class's methods and the module functions `__init__` names). transformers' own classes hold the function
in a method under `@use_experts_implementation`, which the adapter reads through (fused:
tests/test_transformers_models.py). Here nothing is fused; the report must name the graph breaks and
give the setting that removes them (`experts_implementation="grouped_mm"`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._common import TinyDecoder, finish, settings
from ._expected import Expected
from ._stacked_experts import SparseMoeBlock

EXPECTED = Expected(fused=0, graph_breaks=True, advice="experts_implementation='grouped_mm'")


def eager_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The `eager` experts body: loop over hit experts, gather their tokens, index_add_ the outputs."""
    final_hidden_states = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1)
        expert_mask = expert_mask.permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        if expert_idx == self.num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        current_state = hidden_states[token_idx]
        gate, up = F.linear(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
        current_hidden_states = self.act_fn(gate) * up
        current_hidden_states = F.linear(current_hidden_states, self.down_proj[expert_idx])
        current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
    return final_hidden_states


def build(**overrides):
    """(TinyDecoder of SparseMoeBlocks with the eager experts loop, (x [1, T, H],)); every DEFAULTS key applies."""
    cfg = settings(overrides)
    return finish(TinyDecoder(lambda c: SparseMoeBlock(c, eager_experts_forward), cfg), cfg)
