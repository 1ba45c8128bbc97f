"""torchtune's Llama4 `MoE`: sigmoid top-1 router, inputs scaled before the experts, and a shared expert.

Mirrors pytorch/torchtune `torchtune/modules/moe/moe.py` and `torchtune/modules/moe/experts.py` at commit
bd2a0fc (`TokenChoiceTopKRouter.forward`, `MoE.forward`, `GroupedExperts.forward` and
`_forward_no_grouped_mm`; `FeedForward` from `torchtune/modules/feed_forward.py` as the shared expert),
wired the way `torchtune/models/llama4/_component_builders.py` `llama4_moe` wires them (one expert per
token, `use_shared_expert=True`).

The router scores the flattened tokens with a bias-free linear gate, applies a float32 sigmoid (no
softmax, no renormalisation), takes the top-k (k=1), stores the chosen ids on the module
(`self.selected_experts_indices`), histograms them into per-expert counts, stable-argsorts the flat ids
to group tokens by expert, reorders the scores the same way and maps sorted positions back to token ids
with `// top_k`. The layer `torch.gather`s the tokens in that order and multiplies them by their scores
BEFORE the experts (Llama4 scales the expert input, not its output). The grouped experts (stacked
`gate_proj`/`up_proj` [E, dim, hidden] and `down_proj` [E, hidden, dim], used as `x @ w`) read the counts
with `.tolist()`, `torch.split` the tokens, loop `for expert_idx, x_expert in enumerate(...)` computing
silu(x w1) * (x w3) @ w2 (empty splits included) and `torch.cat` the results; their forward carries
`@torch.inference_mode(mode=False)`. The shared SwiGLU expert (nn.Linear w1/w2/w3) runs on all tokens
and its output is the base that the routed outputs are `scatter_add`ed into.
Left out: the `torch._grouped_mm` path with its Triton padding kernel (SM90+ only; off on CPU), tensor
parallelism, LoRA/NF4 variants. `torch.histc` on int64 ids is CUDA-only, so the ids are cast to float for
it and the counts back to int64 (the equivalent plain-PyTorch call).
Constructs: a module attribute written in forward, `torch.histc` counts, stable `argsort` dispatch,
`.tolist()` counts fed to `torch.split`, a loop over `enumerate(splits)` with no empty skip,
`@torch.inference_mode(mode=False)` on the experts' forward, `scatter_add` onto the shared expert output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("pytorch/torchtune", "torchtune/modules/moe/moe.py", "bd2a0fc7c31430972728494fa01aaeeb0ebf1ba1",
                "MoE.forward")
HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 8, 1


class TokenChoiceTopKRouter(nn.Module):
    def __init__(self, *, gate, dim, num_experts, experts_per_token):
        super().__init__()
        self.gate = gate
        self.dim = dim
        self.num_experts = num_experts
        self.experts_per_token = experts_per_token

    def forward(self, x):
        probs = torch.sigmoid(self.gate(x).to(torch.float32)).to(x.dtype)
        best, best_ids = torch.topk(probs, k=self.experts_per_token, dim=1)
        self.selected_experts_indices = best_ids
        ids = best_ids.view(-1)
        per_expert = torch.histc(ids.float(), bins=self.num_experts, min=0, max=self.num_experts).to(ids.dtype)
        perm = torch.argsort(ids, stable=True)
        best = best.view(-1)[perm]
        rows = perm // self.experts_per_token
        return best, rows, per_expert


class GroupedExperts(nn.Module):
    def __init__(self, *, dim, hidden_dim, num_experts=1, activation=F.silu):
        super().__init__()
        self.dim = dim
        self.num_experts = num_experts
        self.gate_proj = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.up_proj = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.act_fn = activation

    def _forward_no_grouped_mm(self, x, num_tokens_per_expert):
        chunks = torch.split(x, split_size_or_sections=num_tokens_per_expert.tolist(), dim=0)
        results = []
        for idx, chunk in enumerate(chunks):
            w_gate, w_down, w_up = self.gate_proj[idx], self.down_proj[idx], self.up_proj[idx]
            act = self.act_fn(torch.matmul(chunk, w_gate))
            act = act * torch.matmul(chunk, w_up)
            results.append(torch.matmul(act, w_down))
        return torch.cat(results, dim=0)

    @torch.inference_mode(mode=False)
    def forward(self, x, num_tokens_per_expert):
        return self._forward_no_grouped_mm(x, num_tokens_per_expert)


class FeedForward(nn.Module):
    """w2(silu(w1(x)) * w3(x)), built from gate_proj / down_proj / up_proj."""

    def __init__(self, *, gate_proj, down_proj, up_proj=None, activation=None):
        super().__init__()
        self.w1 = gate_proj
        self.w2 = down_proj
        self.w3 = up_proj
        self.activation = activation if activation is not None else nn.SiLU()

    def forward(self, x):
        h = self.activation(self.w1(x))
        if self.w3 is not None:
            h = h * self.w3(x)
        return self.w2(h)


class MoE(nn.Module):
    def __init__(self, *, experts, router, shared_expert=None):
        super().__init__()
        self.experts = experts
        self.router = router
        self.shared_expert = shared_expert

    def forward(self, x):
        bs, slen, dim = x.shape
        weights, rows, per_expert = self.router(x.reshape(bs * slen, dim))
        rows = rows.reshape(-1, 1).expand(-1, dim)
        picked = torch.gather(x.view(-1, dim), dim=0, index=rows)
        picked = picked * weights.reshape(-1, 1)
        expert_out = self.experts(picked, per_expert)
        if self.shared_expert is not None:
            out = self.shared_expert(x).reshape(bs * slen, dim)
        else:
            out = torch.zeros_like(x.reshape(bs * slen, dim))
        out = out.scatter_add(dim=0, index=rows, src=expert_out)
        return out.reshape(bs, slen, dim)


def llama4_moe():
    router = TokenChoiceTopKRouter(gate=nn.Linear(HIDDEN, EXPERTS, bias=False), dim=HIDDEN, num_experts=EXPERTS,
                                   experts_per_token=TOP_K)
    experts = GroupedExperts(dim=HIDDEN, hidden_dim=INTER, num_experts=EXPERTS)
    shared = FeedForward(gate_proj=nn.Linear(HIDDEN, INTER, bias=False), down_proj=nn.Linear(INTER, HIDDEN, bias=False),
                         up_proj=nn.Linear(HIDDEN, INTER, bias=False))
    return MoE(experts=experts, router=router, shared_expert=shared)


def build():
    return tiny(llama4_moe, HIDDEN)
