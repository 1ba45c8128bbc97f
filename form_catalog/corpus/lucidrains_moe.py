"""lucidrains' mixture-of-experts `MoE`: GShard top-2 gating with capacity, einsum dispatch and combine.

Mirrors lucidrains/mixture-of-experts `mixture_of_experts/mixture_of_experts.py` at commit 04201ee
(`Top2Gating.forward`, `MoE.forward`, `Experts.forward`, `top1`, `cumsum_exclusive`, `safe_one_hot`), itself a
transcription of tensor2tensor's `moe.py`. The gate multiplies x [b, n, d] by a [d, E] parameter, takes the
softmax, picks the best expert per position (`topk(k=1)`), masks it out and picks the second best, and
renormalises the two gates by their sum. A balance loss is computed from the first-choice densities. The
second choice is then kept or dropped by the eval/train policy chain (`all`, `none`, `threshold`,
`random`: random draws `uniform_` numbers and keeps the second expert where they fall below
gate_2 / threshold). The capacity is min(n, int(n * capacity_factor / E)), raised to at least 4. Positions
within each expert come from an exclusive cumsum of the one-hot masks along the sequence; assignments at or
past the capacity are removed, and the second choice's positions are offset by the first choice's counts.
The combine tensor [b, n, E, C] is gate * one_hot(expert) * one_hot(position), summed over the two choices,
where the position one-hot is `safe_one_hot`, which reads `indexes.max() + 1` against the capacity with a
Python `max` (a host read) to size the one-hot before slicing it; the dispatch tensor is its boolean cast.
The layer dispatches with einsum('bnd,bnec->ebcd'), runs the stacked experts (w1 [E, d, h], ReLU,
w2 [E, h, d], both as batched einsums over the expert axis), and combines with einsum('ebcd,bnec->bnd'); it
returns (output, loss * coef). Left out: the hierarchical MoE and the `importance` argument (only used by
it). The model uses the default `random` second-expert policy with a tiny eval threshold (1e-9), so the
random draw is still made but every second choice is kept and the output is deterministic; the defaults
(threshold 0.2) would make eval outputs random.
Constructs: `if self.training` hyper-parameter selection, a policy if/elif chain, an in-graph `uniform_`
draw, Python `min`/`max` capacity arithmetic on shapes, a Python `max(tensor, int)` host read inside
`safe_one_hot`, dense dispatch/combine einsums (no gathers, no per-expert loop).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("lucidrains/mixture-of-experts", "mixture_of_experts/mixture_of_experts.py",
                "04201ee9d1add6913032b3cb75c7b59b289b16de", "MoE.forward")
HIDDEN, INTER, EXPERTS = 16, 8, 4
MIN_EXPERT_CAPACITY = 4


def top1(t):
    values, index = t.topk(k=1, dim=-1)
    return values.squeeze(dim=-1), index.squeeze(dim=-1)


def cumsum_exclusive(t, dim=-1):
    trailing = -dim - 1
    padded = F.pad(t, (*((0, 0) * trailing), 1, 0)).cumsum(dim=dim)
    return padded[(..., slice(None, -1), *((slice(None),) * trailing))]


def safe_one_hot(indexes, max_length):
    top = indexes.max() + 1
    return F.one_hot(indexes, max(top + 1, max_length))[..., :max_length]


class Experts(nn.Module):
    def __init__(self, dim, num_experts, hidden_dim, activation=nn.ReLU):
        super().__init__()
        bound = 1 / math.sqrt(hidden_dim)
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim).uniform_(-bound, bound))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim).uniform_(-bound, bound))
        self.act = activation()

    def forward(self, x):
        h = self.act(torch.einsum("...nd,...dh->...nh", x, self.w1))
        return torch.einsum("...nh,...hd->...nd", h, self.w2)


class Top2Gating(nn.Module):
    def __init__(self, dim, num_gates, eps=1e-9, second_policy_train="random", second_policy_eval="random",
                 second_threshold_train=0.2, second_threshold_eval=0.2, capacity_factor_train=1.25,
                 capacity_factor_eval=2.0):
        super().__init__()
        self.eps = eps
        self.num_gates = num_gates
        self.w_gating = nn.Parameter(torch.randn(dim, num_gates))
        self.second_policy_train, self.second_policy_eval = second_policy_train, second_policy_eval
        self.second_threshold_train, self.second_threshold_eval = second_threshold_train, second_threshold_eval
        self.capacity_factor_train, self.capacity_factor_eval = capacity_factor_train, capacity_factor_eval

    def forward(self, x):
        *_, b, group_size, dim = x.shape
        experts = self.num_gates
        if self.training:
            policy, threshold = self.second_policy_train, self.second_threshold_train
            capacity_factor = self.capacity_factor_train
        else:
            policy, threshold = self.second_policy_eval, self.second_threshold_eval
            capacity_factor = self.capacity_factor_eval

        probs_all = torch.einsum("...bnd,...de->...bne", x, self.w_gating).softmax(dim=-1)

        gate_1, index_1 = top1(probs_all)
        mask_1 = F.one_hot(index_1, experts).float()
        density_proxy = probs_all
        without_first = probs_all * (1.0 - mask_1)
        gate_2, index_2 = top1(without_first)
        mask_2 = F.one_hot(index_2, experts).float()

        denom = gate_1 + gate_2 + self.eps
        gate_1 /= denom
        gate_2 /= denom

        density = mask_1.mean(dim=-2)
        loss = (density_proxy.mean(dim=-2) * density).mean() * float(experts**2)

        if policy == "all":
            pass
        elif policy == "none":
            mask_2 = torch.zeros_like(mask_2)
        elif policy == "threshold":
            mask_2 *= (gate_2 > threshold).float()
        elif policy == "random":
            draws = torch.zeros_like(gate_2).uniform_(0.0, 1.0)
            mask_2 *= (draws < (gate_2 / max(threshold, self.eps))).float().unsqueeze(-1)
        else:
            raise ValueError(f"Unknown policy {policy}")

        capacity = min(group_size, int((group_size * capacity_factor) / experts))
        capacity = max(capacity, MIN_EXPERT_CAPACITY)
        capacity_f = float(capacity)

        slot_1 = cumsum_exclusive(mask_1, dim=-2) * mask_1
        mask_1 *= (slot_1 < capacity_f).float()
        count_1 = mask_1.sum(dim=-2, keepdim=True)
        kept_1 = mask_1.sum(dim=-1)
        slot_1 = slot_1.sum(dim=-1)
        gate_1 *= kept_1

        slot_2 = cumsum_exclusive(mask_2, dim=-2) + count_1
        slot_2 *= mask_2
        mask_2 *= (slot_2 < capacity_f).float()
        kept_2 = mask_2.sum(dim=-1)
        slot_2 = slot_2.sum(dim=-1)
        gate_2 *= kept_2

        combine = (
            gate_1[..., None, None] * kept_1[..., None, None] * F.one_hot(index_1, experts)[..., None]
            * safe_one_hot(slot_1.long(), capacity)[..., None, :]
            + gate_2[..., None, None] * kept_2[..., None, None] * F.one_hot(index_2, experts)[..., None]
            * safe_one_hot(slot_2.long(), capacity)[..., None, :]
        )
        dispatch = combine.bool().to(combine)
        return dispatch, combine, loss


class MoE(nn.Module):
    def __init__(self, dim=HIDDEN, num_experts=EXPERTS, hidden_dim=INTER, second_threshold_eval=1e-9,
                 loss_coef=1e-2):
        super().__init__()
        self.num_experts = num_experts
        self.gate = Top2Gating(dim, num_gates=num_experts, second_threshold_eval=second_threshold_eval)
        self.experts = Experts(dim, num_experts=num_experts, hidden_dim=hidden_dim, activation=nn.ReLU)
        self.loss_coef = loss_coef

    def forward(self, inputs):
        _, _, d, e = *inputs.shape, self.num_experts
        dispatch, combine, loss = self.gate(inputs)
        routed = torch.einsum("bnd,bnec->ebcd", inputs, dispatch)
        shape = routed.shape
        out = self.experts(routed.reshape(e, -1, d)).reshape(*shape)
        return torch.einsum("ebcd,bnec->bnd", out, combine), loss * self.loss_coef


def build():
    return tiny(MoE, HIDDEN)
