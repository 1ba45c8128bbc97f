"""torchtune's Qwen3-MoE `MoE`: softmax token-choice router, sorted dispatch, split-by-counts expert loop.

Mirrors pytorch/torchtune `torchtune/modules/moe/moe.py` and `torchtune/modules/moe/experts.py` at commit
ef97730 (the head of the Qwen3-MoE pull request #2820: `TokenChoiceTopKRouter.forward` with its
`softmax` / `norm_topk_prob` options, `MoE.forward` with `scale_after_fwd`, `GroupedExperts.forward` and
`_forward_no_grouped_mm`), configured the way that branch's `qwen3_moe_mlp` builder configures them
(softmax=True, norm_topk_prob=True, scale_after_fwd=True, no shared expert).

The router scores the flattened tokens with a bias-free linear gate, takes a float32 softmax, picks the
top-k, stores the chosen ids on the module (`self.selected_experts_indices`), divides the top-k scores in
place by their sum, histograms the chosen ids into per-expert counts, stable-argsorts the flat ids to
group the (token, slot) pairs by expert, reorders the scores the same way and turns the sorted positions
into token ids with `// top_k`. The layer gathers the tokens in that order with `torch.gather`, runs the
grouped experts, scales their outputs by the scores afterwards, and `scatter_add`s them into a zero
output. The experts (stacked `gate_proj`/`up_proj` [E, dim, hidden] and `down_proj` [E, hidden, dim],
used as `x @ w`) read the counts on the host with `.tolist()`, `torch.split` the sorted tokens by them,
and loop `for expert_idx, x_expert in enumerate(...)` computing silu(x w1) * (x w3) @ w2 even for empty
splits, then `torch.cat` the pieces; the forward is decorated `@torch.inference_mode(mode=False)`.
Left out: the `torch._grouped_mm` path and its Triton permute-index padding (only taken on SM90+ GPUs;
on CPU `should_use_grouped_mm()` is False), and tensor parallelism. On CUDA `torch.histc` accepts the
int64 ids directly; the CPU kernel does not, so the ids are cast to float for it and the counts back to
int64 (the equivalent plain-PyTorch call).
Constructs: a module attribute written in forward, in-place `/=` renormalisation, `torch.histc` counts,
stable `argsort` dispatch, `.tolist()` counts fed to `torch.split`, a loop over `enumerate(splits)` with
no empty skip, `@torch.inference_mode(mode=False)` on the experts' forward, `scatter_add` combine.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("pytorch/torchtune", "torchtune/modules/moe/moe.py", "ef97730eeb778ef746efc99ed4b021cab5f9982a",
                "MoE.forward")
HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 8, 2


class TokenChoiceTopKRouter(nn.Module):
    def __init__(self, *, gate, dim, num_experts, experts_per_token, norm_topk_prob=False, softmax=False):
        super().__init__()
        self.gate = gate
        self.dim = dim
        self.num_experts = num_experts
        self.experts_per_token = experts_per_token
        self.norm_topk_prob = norm_topk_prob
        self.softmax = softmax

    def forward(self, x):
        logits = self.gate(x)
        if self.softmax:
            probs = F.softmax(logits, dim=1, dtype=torch.float32).to(x.dtype)
        else:
            probs = torch.sigmoid(logits.to(torch.float32)).to(x.dtype)
        chosen_scores, chosen = torch.topk(probs, k=self.experts_per_token, dim=1)
        self.selected_experts_indices = chosen
        if self.norm_topk_prob:
            chosen_scores /= chosen_scores.sum(dim=-1, keepdim=True).to(x.dtype)
        flat = chosen.view(-1)
        counts = torch.histc(flat.float(), bins=self.num_experts, min=0, max=self.num_experts).to(flat.dtype)
        order = torch.argsort(flat, stable=True)
        chosen_scores = chosen_scores.view(-1)[order]
        token_ids = order // self.experts_per_token
        return chosen_scores, token_ids, counts


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
        pieces = torch.split(x, split_size_or_sections=num_tokens_per_expert.tolist(), dim=0)
        outs = []
        for e, piece in enumerate(pieces):
            gate_w, down_w, up_w = self.gate_proj[e], self.down_proj[e], self.up_proj[e]
            h = self.act_fn(torch.matmul(piece, gate_w)) * torch.matmul(piece, up_w)
            outs.append(torch.matmul(h, down_w))
        return torch.cat(outs, dim=0)

    @torch.inference_mode(mode=False)
    def forward(self, x, num_tokens_per_expert):
        return self._forward_no_grouped_mm(x, num_tokens_per_expert)


class MoE(nn.Module):
    def __init__(self, *, experts, router, shared_expert=None, scale_after_fwd=False):
        super().__init__()
        self.experts = experts
        self.router = router
        self.shared_expert = shared_expert
        self.scale_after_fwd = scale_after_fwd

    def forward(self, x):
        bs, slen, dim = x.shape
        scores, token_ids, counts = self.router(x.reshape(bs * slen, dim))
        token_ids = token_ids.reshape(-1, 1).expand(-1, dim)
        routed = torch.gather(x.view(-1, dim), dim=0, index=token_ids)
        if not self.scale_after_fwd:
            routed = routed * scores.reshape(-1, 1)
        routed_out = self.experts(routed, counts)
        if self.scale_after_fwd:
            routed_out = routed_out * scores.reshape(-1, 1)
        if self.shared_expert is not None:
            out = self.shared_expert(x).reshape(bs * slen, dim)
        else:
            out = torch.zeros_like(x.reshape(bs * slen, dim))
        out = out.scatter_add(dim=0, index=token_ids, src=routed_out)
        return out.reshape(bs, slen, dim)


def qwen3_moe_mlp():
    router = TokenChoiceTopKRouter(gate=nn.Linear(HIDDEN, EXPERTS, bias=False), dim=HIDDEN, num_experts=EXPERTS,
                                   experts_per_token=TOP_K, norm_topk_prob=True, softmax=True)
    experts = GroupedExperts(dim=HIDDEN, hidden_dim=INTER, num_experts=EXPERTS)
    return MoE(experts=experts, router=router, scale_after_fwd=True)


def build():
    return tiny(qwen3_moe_mlp, HIDDEN)
