"""transformers 4.57 GPT-OSS on CPU: a loop over the experts that were hit, with a sentinel class.

The block is `form_catalog/_gpt_oss4.py` (which cites the source); this form runs the CPU path of
4.57.6's `GptOssExperts.forward`: the hit test over `one_hot(ids, E + 1)`, `expert_idx = expert_idx[0]`,
`if expert_idx == num_experts: continue` (the extra class is never hit by a top-k router), per-expert
biased projections with the clamped swiglu, the weight read from the [T, E] score table, `index_add_`.
Dynamo cannot iterate the hit experts, so as written the block is never captured.

The expert-loop adapter traces the loop over every class (the sentinel test evaluated on the Python
index, so it is no data-dependent branch), and each layer must become ONE `bias_fused_weights` call.
"""

from __future__ import annotations

import torch

from ._common import TinyDecoder, finish, settings
from ._expected import Expected
from ._gpt_oss4 import GptOss4Block, GptOss4Experts

EXPECTED = Expected(fused=2, overload="bias_fused_weights")
ADAPTER = "hit_expert_loops"


class GptOss4HitLoopExperts(GptOss4Experts):
    def forward(self, hidden_states, router_indices=None, routing_weights=None):
        batch_size = hidden_states.shape[0]
        hidden_states = hidden_states.reshape(-1, self.hidden_size)
        num_experts = routing_weights.shape[1]
        next_states = torch.zeros_like(hidden_states)
        with torch.no_grad():
            expert_mask = torch.nn.functional.one_hot(router_indices, num_classes=num_experts + 1)
            expert_mask = expert_mask.permute(2, 1, 0)
            expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit[:]:
            expert_idx = expert_idx[0]
            if expert_idx == num_experts:
                continue
            with torch.no_grad():
                _, token_idx = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[token_idx]
            gate_up = current_state @ self.gate_up_proj[expert_idx] + self.gate_up_proj_bias[expert_idx]
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
            gate = gate.clamp(min=None, max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
            glu = gate * torch.sigmoid(gate * self.alpha)
            out = ((up + 1) * glu) @ self.down_proj[expert_idx] + self.down_proj_bias[expert_idx]
            weighted_output = out * routing_weights[token_idx, expert_idx, None]
            next_states.index_add_(0, token_idx, weighted_output.to(hidden_states.dtype))
        return next_states.view(batch_size, -1, self.hidden_size)


def build(**overrides):
    """(TinyDecoder of 4.57 GPT-OSS blocks, (x [1, T, H],)); GPT-OSS fixes routing and activation."""
    cfg = settings(overrides, exclude=("routing", "router_fp32", "activation"))
    return finish(TinyDecoder(lambda c: GptOss4Block(c, GptOss4HitLoopExperts), cfg), cfg)
