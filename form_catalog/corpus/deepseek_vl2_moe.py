"""DeepSeek-VL2's DeepseekV2MoE: argsort-sorted tokens sliced per expert from host-side numpy counts.

Mirrors deepseek-ai/DeepSeek-VL2 `deepseek_vl2/models/modeling_deepseek.py` at commit 8ed2d7f (`MoEGate.forward`,
`AddAuxiliaryLoss`, `DeepseekV2MoE.forward`, `DeepseekV2MoE.moe_infer`, `DeepseekV2MLP`). The gate computes
logits in float32 and scores them with a softmax (or a sigmoid), then picks the top-k by one of three methods:
`greedy` (plain top-k, the one this tiny model uses), `group_limited_greedy` (keep the best `topk_group` groups
by each group's max score, zero the rest, top-k) or `noaux_tc` (sigmoid scores plus a correction bias for the
choice, groups ranked by the sum of their two best, top-k, weights gathered from the unbiased scores). With
top_k > 1 and `norm_topk_prob` the weights are renormalised (+1e-20) and scaled by `routed_scaling_factor`,
else only scaled. In training it adds a sequence-level or token-level auxiliary loss. The layer has a
training branch (repeat each token top_k times, `y[flat_idx == i] = expert(x[flat_idx == i])` for every
expert, weighted sum, `AddAuxiliaryLoss`) and an inference branch, `moe_infer` under `@torch.no_grad()`:
scatter ones into a [T, E] count table, sum it into per-expert counts, argsort the flat expert ids, gather
the tokens in that order (`x[idxs // top_k]`), read the counts to the host with `.cpu().numpy()`, walk them
with `for i, num_tokens in enumerate(counts)`, skip `if num_tokens == 0: continue`, run each expert on its
contiguous slice, `torch.cat` the outputs, un-permute with `new_x[idxs] = outs`, and combine with the
top-k weights; the shared experts (one MLP of `n_shared_experts` times the width) are added. Left out: the
expert-parallel path (`ep_size > 1`: `dist.all_to_all`, numpy re-sorting of gathered tokens) since it needs
several processes; with ep_size 1 those branches are dead, so they are dropped (the ep_rank offset in the
expert index stays). Which gate
branch the real VL2 configs select was not checked; the tiny model uses greedy softmax without renormalising.
Constructs: `@torch.no_grad()` on `moe_infer`, `if self.training` branch, `.cpu().numpy()` counts, a loop
`for i, n in enumerate(counts)` with `if n == 0: continue`, Python-int slicing by running offsets,
`torch.cat` of a Python list, index-put un-permutation, boolean-mask gathers/index-puts in the training branch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("deepseek-ai/DeepSeek-VL2", "deepseek_vl2/models/modeling_deepseek.py",
                "8ed2d7ff8d6bffc25342f578604c1ae358b90e23", "DeepseekV2MoE.moe_infer")
HIDDEN, INTER, EXPERTS, TOP_K, SHARED = 16, 8, 8, 2, 2


class DeepseekV2MLP(nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEGate(nn.Module):
    def __init__(self, topk_method="greedy", scoring_func="softmax", n_group=1, topk_group=1,
                 norm_topk_prob=False, routed_scaling_factor=1.0, alpha=0.001, seq_aux=True):
        super().__init__()
        self.top_k, self.n_routed_experts = TOP_K, EXPERTS
        self.topk_method, self.scoring_func = topk_method, scoring_func
        self.n_group, self.topk_group = n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor
        self.alpha, self.seq_aux = alpha, seq_aux
        self.weight = nn.Parameter(torch.empty(EXPERTS, HIDDEN))
        if topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.empty(EXPERTS))

    def _group_mask(self, group_scores, n):
        chosen = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores).scatter_(1, chosen, 1)
        per_group = self.n_routed_experts // self.n_group
        return mask.unsqueeze(-1).expand(n, self.n_group, per_group).reshape(n, -1)

    def forward(self, hidden_states):
        bsz, seq_len, h = hidden_states.shape
        flat = hidden_states.view(-1, h)
        n = bsz * seq_len
        logits = F.linear(flat.type(torch.float32), self.weight.type(torch.float32), None)
        if self.scoring_func == "softmax":
            scores = logits.softmax(dim=-1, dtype=torch.float32)
        elif self.scoring_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            raise NotImplementedError(self.scoring_func)

        if self.topk_method == "greedy":
            weight, idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        elif self.topk_method == "group_limited_greedy":
            group_scores = scores.view(n, self.n_group, -1).max(dim=-1).values
            keep = self._group_mask(group_scores, n)
            weight, idx = torch.topk(scores.masked_fill(~keep.bool(), 0.0), k=self.top_k, dim=-1, sorted=False)
        elif self.topk_method == "noaux_tc":
            assert not self.training
            biased = scores.view(n, -1) + self.e_score_correction_bias.unsqueeze(0)
            group_scores = biased.view(n, self.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
            keep = self._group_mask(group_scores, n)
            _, idx = torch.topk(biased.masked_fill(~keep.bool(), 0.0), k=self.top_k, dim=-1, sorted=False)
            weight = scores.gather(1, idx)

        if self.top_k > 1 and self.norm_topk_prob:
            weight = weight / (weight.sum(dim=-1, keepdim=True) + 1e-20) * self.routed_scaling_factor
        else:
            weight = weight * self.routed_scaling_factor

        if self.training and self.alpha > 0.0:
            idx_aux = idx.view(bsz, -1)
            if self.seq_aux:
                ce = torch.zeros(bsz, self.n_routed_experts, device=flat.device)
                ones = torch.ones(bsz, seq_len * self.top_k, device=flat.device)
                ce.scatter_add_(1, idx_aux, ones).div_(seq_len * self.top_k / self.n_routed_experts)
                aux = (ce * scores.view(bsz, seq_len, -1).mean(dim=1)).sum(dim=1).mean() * self.alpha
            else:
                ce = F.one_hot(idx_aux.view(-1), num_classes=self.n_routed_experts).float().mean(0)
                aux = (scores.mean(0) * ce * self.n_routed_experts).sum() * self.alpha
        else:
            aux = None
        return idx, weight, aux


class AddAuxiliaryLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, loss):
        assert loss.numel() == 1
        ctx.dtype, ctx.required_aux_loss = loss.dtype, loss.requires_grad
        return x

    @staticmethod
    def backward(ctx, grad_output):
        grad_loss = torch.ones(1, dtype=ctx.dtype, device=grad_output.device) if ctx.required_aux_loss else None
        return grad_output, grad_loss


class DeepseekV2MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts_per_tok = TOP_K
        self.ep_size, self.experts_per_rank, self.ep_rank = 1, EXPERTS, 0
        self.experts = nn.ModuleList(DeepseekV2MLP(HIDDEN, INTER) for _ in range(EXPERTS))
        self.gate = MoEGate()
        self.n_shared_experts = SHARED
        self.shared_experts = DeepseekV2MLP(HIDDEN, INTER * SHARED)

    def forward(self, hidden_states):
        residual, shape = hidden_states, hidden_states.shape
        idx, weight, aux = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        flat_idx = idx.view(-1)
        if self.training:
            hidden_states = hidden_states.repeat_interleave(self.num_experts_per_tok, dim=0)
            y = torch.empty_like(hidden_states)
            for i, expert in enumerate(self.experts):
                y[flat_idx == i] = expert(hidden_states[flat_idx == i])
            y = (y.view(*weight.shape, -1) * weight.unsqueeze(-1)).sum(dim=1)
            y = AddAuxiliaryLoss.apply(y.to(hidden_states.dtype).view(*shape), aux)
        else:
            y = self.moe_infer(hidden_states, idx, weight).view(*shape)
        if self.n_shared_experts is not None:
            y = y + self.shared_experts(residual)
        return y

    @torch.no_grad()
    def moe_infer(self, x, topk_ids, topk_weight):
        table = topk_ids.new_zeros((topk_ids.shape[0], len(self.experts)))
        table.scatter_(1, topk_ids, 1)
        counts = table.sum(dim=0)
        order = topk_ids.view(-1).argsort()
        sorted_tokens = x[order // topk_ids.shape[1]]
        # ep_size > 1 (all-to-all exchange of tokens and counts) left out: one process.
        counts = counts.cpu().numpy()

        outputs = []
        start = 0
        for i, num_tokens in enumerate(counts):
            end = start + num_tokens
            if num_tokens == 0:
                continue
            expert = self.experts[i + self.ep_rank * self.experts_per_rank]
            outputs.append(expert(sorted_tokens[start:end]))
            start = end

        outs = torch.cat(outputs, dim=0) if len(outputs) else sorted_tokens.new_empty(0)
        unsorted = torch.empty_like(outs)
        unsorted[order] = outs
        return (
            unsorted.view(*topk_ids.shape, -1)
            .type(topk_weight.dtype)
            .mul_(topk_weight.unsqueeze(dim=-1))
            .sum(dim=1)
            .type(unsorted.dtype)
        )


def build():
    return tiny(DeepseekV2MoE, HIDDEN)
