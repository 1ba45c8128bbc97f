"""MoE-Mamba's `SwitchMixtureOfExperts`: top-k logits then softmax, and a per-token Python loop that indexes the
expert ModuleList with each routed id tensor, once per top-k slot.

Mirrors kyegomez/MoE-Mamba `moe_mamba/block.py` at commit bba93e4 (`FeedForward`, `SwitchMixtureOfExperts.__init__`
/ `forward`), added to the repository as "[FEAT][SwitchMixtureOfExperts]" beside the package's `SwitchMoE` (the
dense-combine layer of `moe_mamba/model.py`, which is kyegomez's SwitchTransformers layer and is mirrored by
kyegomez_switch.py). The forward takes [B, S, D] and views it to tokens [B*S, D]; the router is a biased
`nn.Linear(D, E)`, its logits go through `topk(top_k, dim=1)` and a softmax over the k kept logits only. The output
buffer is `torch.zeros(B*S, out)` on the input's device, with `out` read from the first expert's last Linear
(`self.experts[0].network[-1].out_features`) and the default dtype. Then, for each slot `i in range(self.top_k)`, it
takes the slot's ids `topk_indices[:, i]` and gate column `topk_gates[:, i].unsqueeze(1)`, and builds the expert
outputs token by token: a list comprehension over `enumerate(expert_index)` (iterating a 1-D id tensor, so each
`idx` is a 0-d int64 tensor) calls `self.experts[idx]` (ModuleList indexing through the tensor's `__index__`) on
the single token row `x_flat[n]` (a 1-D [D] vector), and `torch.stack`s the rows; the gated rows are added in place
to the buffer (`output_flat += gate * out`). The buffer is viewed back to [B, S, out]. An expert is
`FeedForward(D, hidden, out)`: `nn.Sequential(Linear, ReLU, Linear)`, both Linears biased. No shared experts, no
normalisation beyond the top-k softmax, no aux loss, no capacity.
Sizes: the file's example usage runs D 512, hidden 2048, out 1024, 4 experts, top-1; here D 16, hidden 8, out 16
(the residual shell needs out == D), 4 experts and top-2 (a constructor argument, so the slot loop runs twice).
Left out: the module-level example usage (it builds a 512-wide layer and prints its output on import); nothing of
the forward.
Constructs: a `for i in range(self.top_k)` slot loop around a list comprehension over `enumerate(tensor)` (one
iteration per token, the count taken from the data's shape), ModuleList indexing by a 0-d tensor, per-token 1-D
expert calls stacked with `torch.stack`, a constructor-time read of a nested Sequential's `out_features`, a
`torch.zeros` buffer without dtype and an in-place `+=` accumulation.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._shell import Source, tiny

SOURCE = Source(
    "kyegomez/MoE-Mamba",
    "moe_mamba/block.py",
    "bba93e4b0b797c0bd2d509f8b844e7845b6127d4",
    "SwitchMixtureOfExperts.forward",
)
HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 4, 2


class FeedForward(nn.Module):
    def __init__(self, input_dim, hidden_dim, output_dim):
        super().__init__()
        self.network = nn.Sequential(
            nn.Linear(input_dim, hidden_dim),
            nn.ReLU(),
            nn.Linear(hidden_dim, output_dim),
        )

    def forward(self, x):
        return self.network(x)


class SwitchMixtureOfExperts(nn.Module):
    def __init__(self, input_dim, hidden_dim, expert_output_dim, num_experts, top_k=1):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.router = nn.Linear(input_dim, num_experts)
        self.experts = nn.ModuleList(
            [FeedForward(input_dim, hidden_dim, expert_output_dim) for _ in range(num_experts)]
        )

    def forward(self, x):
        batch_size, seq_len, input_dim = x.shape
        x_flat = x.view(-1, input_dim)

        # route: the k largest logits, softmaxed among themselves
        router_logits = self.router(x_flat)
        topk_logits, topk_indices = router_logits.topk(self.top_k, dim=1)
        topk_gates = F.softmax(topk_logits, dim=1)

        output_flat = torch.zeros(
            batch_size * seq_len,
            self.experts[0].network[-1].out_features,
            device=x.device,
        )

        # one pass per slot; inside it, one expert call per token
        for i in range(self.top_k):
            expert_index = topk_indices[:, i]
            gate_value = topk_gates[:, i].unsqueeze(1)
            expert_output = torch.stack([self.experts[idx](x_flat[n]) for n, idx in enumerate(expert_index)])
            output_flat += gate_value * expert_output

        return output_flat.view(batch_size, seq_len, -1)


def build():
    return tiny(lambda: SwitchMixtureOfExperts(HIDDEN, INTER, HIDDEN, EXPERTS, top_k=TOP_K), HIDDEN)
