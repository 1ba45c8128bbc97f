"""transformers 4.55 GPT-OSS (and 4.57 off CPU): every token through every expert, weighted after.

The block is `form_catalog/_gpt_oss4.py` (which cites the source); this form runs the inference path of
4.55.4's `GptOssExperts.forward`: `hidden_states.repeat(E, 1).view(E, -1, H)`, `bmm` with the stacked
gate/up weights plus `gate_up_proj_bias[..., None, :]`, the clamped swiglu on interleaved columns, `bmm`
with the down weights plus their bias, each expert's output times its column of the [T, E] score table
(`routing_weights.transpose(0, 1).view(E, B, -1)[..., None]`), summed over the experts. The table is zero
outside each token's top-k, so this is the kernel's weighted sum: each layer must become ONE
`bias_fused_weights` call (and the E-fold work of the dense form is gone).
"""

from __future__ import annotations

import torch

from ._common import TinyDecoder, finish, settings
from ._expected import Expected
from ._gpt_oss4 import GptOss4Block, GptOss4Experts

EXPECTED = Expected(fused=2, overload="bias_fused_weights")


class GptOss4DenseExperts(GptOss4Experts):
    def forward(self, hidden_states, router_indices=None, routing_weights=None):
        batch_size = hidden_states.shape[0]
        hidden_states = hidden_states.reshape(-1, self.hidden_size)
        num_experts = routing_weights.shape[1]
        hidden_states = hidden_states.repeat(num_experts, 1)
        hidden_states = hidden_states.view(num_experts, -1, self.hidden_size)
        gate_up = torch.bmm(hidden_states, self.gate_up_proj) + self.gate_up_proj_bias[..., None, :]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        next_states = torch.bmm(((up + 1) * glu), self.down_proj)
        next_states = next_states + self.down_proj_bias[..., None, :]
        next_states = next_states.view(num_experts, batch_size, -1, self.hidden_size)
        next_states = next_states * routing_weights.transpose(0, 1).view(num_experts, batch_size, -1)[..., None]
        return next_states.sum(dim=0)


def build(**overrides):
    """(TinyDecoder of 4.55 GPT-OSS blocks, (x [1, T, H],)); GPT-OSS fixes routing and activation."""
    cfg = settings(overrides, exclude=("routing", "router_fp32", "activation"))
    return finish(TinyDecoder(lambda c: GptOss4Block(c, GptOss4DenseExperts), cfg), cfg)
