"""HiDream-I1's `MOEFeedForwardSwiGLU`: softmax top-2 gate over 4 SwiGLU experts, a sort-and-slice `moe_infer` driven
by a numpy cumulative count, `scatter_reduce_` into a zero buffer, and a shared expert.

Stands in for the ERNIE-4.5 entry that was asked for: Baidu's original PyTorch remote code
(`modeling_ernie4_5_moe.py` of baidu/ERNIE-4.5-21B-A3B-PT) is not in the stored GitHub code under any repository
that can be cited (its text survives only as drafts inside huggingface/transformers' history and in copies whose
repository could not be identified; PaddlePaddle/ERNIE is Paddle code). HiDream-I1 is a widely run 17B image
model whose MoE layer (adapted, as its comment says, from DeepSeek-V3's inference code) is original PyTorch in the
model's own repository, not a diffusers or transformers port.

Mirrors HiDream-ai/HiDream-I1 `hi_diffusers/models/moe.py` at commit 9b42dd6 (`MoEGate.__init__` / `forward`,
`MOEFeedForwardSwiGLU.__init__` / `forward` / `moe_infer`) with `FeedForwardSwiGLU` from
`hi_diffusers/models/attention.py` and the construction in `hi_diffusers/models/transformers/
transformer_hidream_image.py` (`MOEFeedForwardSwiGLU(dim, hidden_dim=4 * dim, num_routed_experts=4,
num_activated_experts=2)`). `forward(x)` keeps the input as the shared expert's input, calls the gate on the 3-D
tensor: it unpacks (bsz, seq_len, h), views the tokens [T, H], scores them with `F.linear` against a bare
[E, H] weight, `if self.scoring_func == 'softmax'` takes `logits.softmax(dim=-1)` (else raises), takes
`torch.topk(..., sorted=False)`, and would renormalise only `if self.top_k > 1 and self.norm_topk_prob` (False).
The layer views x [T, H] and flattens the choices; at inference (`self.training` False) it calls the
`@torch.no_grad()` `moe_infer`: a `zeros_like` buffer, `argsort` of the flat expert ids,
`bincount().cpu().numpy().cumsum(0)` (a host read; its length is the largest chosen id + 1, so trailing unused
experts are never visited), token ids `idxs // num_activated_experts`, and a loop
`for i, end_idx in enumerate(tokens_per_expert)` with `start_idx = 0 if i == 0 else tokens_per_expert[i-1]`,
`if start_idx == end_idx: continue` on numpy integers, slices of the sorted ids by those host integers, the
expert's SwiGLU (`w2(silu(w1(x)) * w3(x))`, bias-free) on the gathered tokens, an in-place `mul_` by the gathered
weights, a re-bind `expert_cache = expert_cache.to(expert_out.dtype)` and
`expert_cache.scatter_reduce_(0, idx.view(-1, 1).repeat(1, H), expert_out, reduce='sum')`. The result is viewed
back to the input shape and the shared expert's output on the original input is added.
Left out: the `if self.training` branch of `forward` (repeat_interleave, boolean-mask assignment per expert) and
the gate's auxiliary-loss branch with its module-level loss list and `all_gather` (both training-only; the gate
returns `aux_loss = None` at inference), the adaLN modulation, attention and residual of the transformer block (the
shell supplies a norm and the residual), and weight init (the shell draws weights; `FeedForwardSwiGLU`'s
`_init_weights` is kept as written).
Sizes: HiDream-I1 has dim 2560, 4 routed experts, top-2; `FeedForwardSwiGLU` turns `hidden_dim` into
`int(2 * hidden_dim / 3)` rounded up to a multiple of 256 (`multiple_of` defaults to 256 and is not passed), so the
routed experts are 6912 wide and the shared expert (`hidden_dim // 2`) 3584. Here dim 16, 4 experts, top-2; the
same rounding makes both widths 256.
Constructs: a gate returning a (ids, weights, None) tuple, a string-valued `if` on the scoring function, `topk`
with `sorted=False`, a config `if` that is off, `self.training` dispatch, a `@torch.no_grad()` helper method,
`argsort` + `bincount().cpu().numpy().cumsum(0)` host read, a Python loop over a numpy array with numpy-integer
`if start == end: continue` skips and slicing, a sorted-index gather, in-place `mul_`, a dtype re-bind of the
buffer, in-place `scatter_reduce_(reduce='sum')` with a repeated index, a shared expert added after.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("HiDream-ai/HiDream-I1", "hi_diffusers/models/moe.py",
                "9b42dd606fecf8f78b974adb7e4d10331c91371a", "MOEFeedForwardSwiGLU.forward")
HIDDEN, EXPERTS, TOP_K = 16, 4, 2


class FeedForwardSwiGLU(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, multiple_of: int = 256, ffn_dim_multiplier: float | None = None):
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        # custom dim factor multiplier
        if ffn_dim_multiplier is not None:
            hidden_dim = int(ffn_dim_multiplier * hidden_dim)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)

        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.apply(self._init_weights)

    def _init_weights(self, m):
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.constant_(m.bias, 0)

    def forward(self, x):
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class MoEGate(nn.Module):
    def __init__(self, embed_dim, num_routed_experts=4, num_activated_experts=2, aux_loss_alpha=0.01):
        super().__init__()
        self.top_k = num_activated_experts
        self.n_routed_experts = num_routed_experts

        self.scoring_func = "softmax"
        self.alpha = aux_loss_alpha
        self.seq_aux = False

        # topk selection algorithm
        self.norm_topk_prob = False
        self.gating_dim = embed_dim
        self.weight = nn.Parameter(torch.empty((self.n_routed_experts, self.gating_dim)))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        import torch.nn.init as init
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, hidden_states):
        bsz, seq_len, h = hidden_states.shape
        # compute gating score
        hidden_states = hidden_states.view(-1, h)
        logits = F.linear(hidden_states, self.weight, None)
        if self.scoring_func == "softmax":
            scores = logits.softmax(dim=-1)
        else:
            raise NotImplementedError(f"insupportable scoring function for MoE gating: {self.scoring_func}")

        # select top-k experts
        topk_weight, topk_idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)

        # norm gate to sum 1
        if self.top_k > 1 and self.norm_topk_prob:
            denominator = topk_weight.sum(dim=-1, keepdim=True) + 1e-20
            topk_weight = topk_weight / denominator

        # the expert-level auxiliary loss is computed only in training (left out)
        aux_loss = None
        return topk_idx, topk_weight, aux_loss


class MOEFeedForwardSwiGLU(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, num_routed_experts: int, num_activated_experts: int):
        super().__init__()
        self.shared_experts = FeedForwardSwiGLU(dim, hidden_dim // 2)
        self.experts = nn.ModuleList([FeedForwardSwiGLU(dim, hidden_dim) for i in range(num_routed_experts)])
        self.gate = MoEGate(
            embed_dim=dim,
            num_routed_experts=num_routed_experts,
            num_activated_experts=num_activated_experts,
        )
        self.num_activated_experts = num_activated_experts

    def forward(self, x):
        identity = x
        orig_shape = x.shape
        topk_idx, topk_weight, aux_loss = self.gate(x)
        x = x.view(-1, x.shape[-1])
        flat_topk_idx = topk_idx.view(-1)
        # the `if self.training:` branch (repeat_interleave + per-expert boolean-mask assignment) and the
        # `wtype = x.dtype` it reads are left out
        y = self.moe_infer(x, flat_topk_idx, topk_weight.view(-1, 1)).view(*orig_shape)
        y = y + self.shared_experts(identity)
        return y

    @torch.no_grad()
    def moe_infer(self, x, flat_expert_indices, flat_expert_weights):
        expert_cache = torch.zeros_like(x)
        idxs = flat_expert_indices.argsort()
        tokens_per_expert = flat_expert_indices.bincount().cpu().numpy().cumsum(0)
        token_idxs = idxs // self.num_activated_experts
        for i, end_idx in enumerate(tokens_per_expert):
            start_idx = 0 if i == 0 else tokens_per_expert[i - 1]
            if start_idx == end_idx:
                continue
            expert = self.experts[i]
            exp_token_idx = token_idxs[start_idx:end_idx]
            expert_tokens = x[exp_token_idx]
            expert_out = expert(expert_tokens)
            expert_out.mul_(flat_expert_weights[idxs[start_idx:end_idx]])

            # for fp16 and other dtype
            expert_cache = expert_cache.to(expert_out.dtype)
            expert_cache.scatter_reduce_(0, exp_token_idx.view(-1, 1).repeat(1, x.shape[-1]), expert_out,
                                         reduce="sum")
        return expert_cache


def build():
    return tiny(lambda: MOEFeedForwardSwiGLU(dim=HIDDEN, hidden_dim=4 * HIDDEN, num_routed_experts=EXPERTS,
                                             num_activated_experts=TOP_K), HIDDEN)
