"""chaofa's "MoE from scratch" `ShareExpertMOE`: a Mixtral-style sparse loop over single-Linear experts (biased
router, softmax-then-top-k, renormalised), plus shared single-Linear experts stacked and summed.

Mirrors the third version of the tutorial notebook in bbruceyuan/LLMs-Zero-to-Hero (the "chaofa" video series
"build a miniMoE-LLM from scratch"), `src/video/build_moe_model.ipynb` at commit ed0e7b5: `BasicExpert`,
`MOERouter.forward`, `MOEConfig`, `SparseMOE.forward` and `ShareExpertMOE.forward`, with the notebook's training
test settings (4 experts, top-2, 2 shared experts). `ShareExpertMOE.forward(x)` calls `SparseMOE`, which views
[B, S, H] to tokens, and whose `MOERouter` scores them with a biased `nn.Linear(H, E)`, takes a float32 softmax,
`torch.topk` of the probabilities, divides the k weights by their sum, casts them to the input dtype, and builds
`one_hot(ids, E).permute(2, 1, 0)` ([E, k, T]); it returns logits, weights, ids and that mask. `SparseMOE` then
fills a zero [T, H] buffer in a loop over `range(self.expert_number)`: `idx, top_x = torch.where(mask[e])` (slot and
token positions), the tokens gathered as `hidden.unsqueeze(0)[:, top_x, :].reshape(-1, H)`, the expert's output
scaled by `weights[top_x, idx].unsqueeze(-1)`, and `index_add_` into the buffer (cast to the input dtype); the buffer
is reshaped back to [B, S, H] and returned with the router logits. `ShareExpertMOE` runs every shared expert on the
unflattened x in a list comprehension, `torch.stack(..., dim=0).sum(dim=0)`, adds that to the sparse output and
returns (output, router_logits). Each expert, routed or shared, is a `BasicExpert`: one biased `nn.Linear(H, H)`
(no activation, no intermediate width: the notebook leaves the SwiGLU expert as homework).
Left out: the notebook's version 1 (`BasicMOE`, a dense gate) and the test/training cells (`switch_load_balancing_loss`
reads the returned logits outside the layer); nothing of the forward.
Sizes: the training cell uses hidden 32; here 16 (an expert has no intermediate width to shrink).
Constructs: softmax-top-k-renormalise routing in a separate router module returning a 4-tuple, a `one_hot`
`permute(2, 1, 0)` mask, `torch.where` on one expert's [k, T] mask, an `unsqueeze(0)[:, idx, :]` gather, single
biased-Linear experts (no MLP), `index_add_` with a dtype cast, shared experts as a list comprehension stacked and
summed, and a tuple return carrying the router logits.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._shell import Source, tiny

SOURCE = Source(
    "bbruceyuan/LLMs-Zero-to-Hero",
    "src/video/build_moe_model.ipynb",
    "ed0e7b50b9a893855cca7589aa8a2ea19621a567",
    "ShareExpertMOE.forward",
)
HIDDEN, EXPERTS, TOP_K, SHARED = 16, 4, 2, 2


class BasicExpert(nn.Module):
    def __init__(self, feature_in, feature_out):
        super().__init__()
        self.linear = nn.Linear(feature_in, feature_out)

    def forward(self, x):
        return self.linear(x)


class MOERouter(nn.Module):
    def __init__(self, hidden_dim, expert_number, top_k):
        super().__init__()
        self.gate = nn.Linear(hidden_dim, expert_number)
        self.expert_number = expert_number
        self.top_k = top_k

    def forward(self, hidden_states):
        router_logits = self.gate(hidden_states)  # [T, E]
        routing_probs = F.softmax(router_logits, dim=-1, dtype=torch.float)
        router_weights, selected_experts = torch.topk(routing_probs, self.top_k, dim=-1)  # [T, k]
        router_weights = router_weights / router_weights.sum(dim=-1, keepdim=True)
        router_weights = router_weights.to(hidden_states.dtype)
        expert_mask = F.one_hot(selected_experts, num_classes=self.expert_number)  # [T, k, E]
        expert_mask = expert_mask.permute(2, 1, 0)  # [E, k, T]
        return router_logits, router_weights, selected_experts, expert_mask


class MOEConfig:
    def __init__(self, hidden_dim, expert_number, top_k, shared_experts_number=2):
        self.hidden_dim = hidden_dim
        self.expert_number = expert_number
        self.top_k = top_k
        self.shared_experts_number = shared_experts_number


class SparseMOE(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_dim = config.hidden_dim
        self.expert_number = config.expert_number
        self.top_k = config.top_k
        self.experts = nn.ModuleList(
            [BasicExpert(self.hidden_dim, self.hidden_dim) for _ in range(self.expert_number)]
        )
        self.router = MOERouter(self.hidden_dim, self.expert_number, self.top_k)

    def forward(self, x):
        batch_size, seq_len, hidden_dim = x.size()
        hidden_states = x.view(-1, hidden_dim)  # tokens, not samples, from here on

        router_logits, router_weights, selected_experts_indices, expert_mask = self.router(hidden_states)

        final_hidden_states = torch.zeros(
            (batch_size * seq_len, hidden_dim), dtype=hidden_states.dtype, device=hidden_states.device
        )

        for expert_idx in range(self.expert_number):
            expert_layer = self.experts[expert_idx]
            # idx: which slot (top-1 / top-2) chose this expert; top_x: which token
            idx, top_x = torch.where(expert_mask[expert_idx])
            current_state = hidden_states.unsqueeze(0)[:, top_x, :].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * router_weights[top_x, idx].unsqueeze(-1)
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))

        final_hidden_states = final_hidden_states.reshape(batch_size, seq_len, hidden_dim)
        return final_hidden_states, router_logits


class ShareExpertMOE(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.moe_model = SparseMOE(config)
        self.shared_experts = nn.ModuleList(
            [BasicExpert(config.hidden_dim, config.hidden_dim) for _ in range(config.shared_experts_number)]
        )

    def forward(self, x):
        sparse_moe_out, router_logits = self.moe_model(x)

        # every token also goes through every shared expert
        shared_experts_out = [expert(x) for expert in self.shared_experts]
        shared_experts_out = torch.stack(shared_experts_out, dim=0).sum(dim=0)

        return sparse_moe_out + shared_experts_out, router_logits


CONFIG = MOEConfig(hidden_dim=HIDDEN, expert_number=EXPERTS, top_k=TOP_K, shared_experts_number=SHARED)


def build():
    return tiny(lambda: ShareExpertMOE(CONFIG), HIDDEN)
