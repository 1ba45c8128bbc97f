"""Phi-3.5-MoE's remote-code `PhiMoESparseMoeBlock`: SparseMixer top-2 routing, then a Mixtral-style expert loop.

Mirrors BreadAi-solo/flash-linear-attention `fla/models/rwkv7moe/modeling_rwkv7moe.py` at commit cfb0c66
(`sparsemixer`, `mp`, `PhiMoESparseMoeBlock.forward`, `PhiMoEBlockSparseTop2MLP`), a verbatim copy of the
block from microsoft/Phi-3.5-MoE-instruct's `modeling_phimoe.py` (the hub repository itself is not among
the stored copies; transformers' built-in Phimoe is a later rewrite). The router is one bias-free linear.
SparseMixer picks the two experts one after the other: under `torch.no_grad()` it takes the row maximum of
the scores, masks every score whose relative gap to that maximum, (max - s) / max(|s|, max), exceeds
2 * jitter_eps, softmaxes the masked scores and gathers the winner's probability as its weight; the
winner is then scattered to -inf, and the same mask / softmax / gather picks the second expert (its mask
still measured against the unmasked scores). In training the choice is a Gumbel sample and the weight goes
through a custom autograd function (Heun's third-order midpoint trick); in eval it is the argmax and the
plain gathered probability. The weights are not renormalised. The block flattens tokens, one-hot encodes
the choices to an [E, 2, T] mask and loops over every expert: `idx, top_x = torch.where(mask[e])`, skips
an expert with no tokens, reads both index tensors to Python lists with `.tolist()`, gathers those rows,
runs the SwiGLU expert (w1 gate, w3 up, w2 down) and `index_add_`s the weighted result. It returns
(output, router_logits). Training-only input jitter is kept as the original's `if self.training` branch.
Left out: nothing of the forward (the caller's aux loss lives in the model, not here).
Constructs: `with torch.no_grad()` inside routing, `if training` branches (Gumbel sampling, autograd
Function), loop over range(num_experts), `torch.where(mask)`, `if top_x.shape[0] == 0: continue`,
`.tolist()` gathers with Python lists, `index_add_`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("BreadAi-solo/flash-linear-attention", "fla/models/rwkv7moe/modeling_rwkv7moe.py",
                "cfb0c6625b7fd49540cfc7a8586e6af506ac5e3e", "PhiMoESparseMoeBlock.forward")
HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 8, 2
ROUTER_JITTER, INPUT_JITTER = 0.01, 0.01


class PhiMoEBlockSparseTop2MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(HIDDEN, INTER, bias=False)
        self.w2 = nn.Linear(INTER, HIDDEN, bias=False)
        self.w3 = nn.Linear(HIDDEN, INTER, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.w2(self.act_fn(self.w1(x)) * self.w3(x))


class mp(torch.autograd.Function):  # noqa: N801 - the original's name
    """Training-only: returns multiplier * mask_for_one, with SparseMixer's straight-through gradient."""

    @staticmethod
    def forward(ctx, scores, multiplier, selected, masked_gates, mask_for_one):
        ctx.save_for_backward(multiplier, selected, masked_gates)
        return multiplier * mask_for_one

    @staticmethod
    def backward(ctx, grad_out):
        multiplier, selected, masked_gates = ctx.saved_tensors
        grad_out = grad_out * multiplier
        grad_scores = masked_gates * grad_out.mul(-1)
        grad_scores.scatter_add_(dim=-1, index=selected, src=grad_out)
        return grad_scores, None, None, None, None


def _gumbel_pick(gates):
    noise = torch.empty_like(gates, memory_format=torch.legacy_contiguous_format).exponential_().log()
    return (gates - noise).max(dim=-1)[1].unsqueeze(-1)


def sparsemixer(scores, top_k, jitter_eps, training):
    assert top_k == 2

    # first expert
    with torch.no_grad():
        threshold, best = scores.max(dim=-1, keepdim=True)
        factor = scores.abs().clamp(min=threshold)
        too_far = ((threshold - scores) / factor) > (2 * jitter_eps)
    gates = scores.masked_fill(too_far, float("-inf"))
    if training:
        first = _gumbel_pick(gates)
    else:
        first = best
    gates = torch.softmax(gates, dim=-1)
    weight_first = gates.gather(dim=-1, index=first)
    if training:
        top_prob, top_idx = gates.max(dim=-1, keepdim=True)
        keep_one = torch.logical_or(first == top_idx, torch.rand_like(top_prob) > 0.75)
        keep_one = torch.add(0.3333, keep_one, alpha=0.6667).type_as(gates)
        weight_first = mp.apply(scores, weight_first, first, gates, keep_one)

    # second expert: the first one masked out
    rest = torch.scatter(scores, -1, first, float("-inf"))
    with torch.no_grad():
        threshold, best = rest.max(dim=-1, keepdim=True)
        factor = scores.abs().clamp(min=threshold)
        too_far = ((threshold - scores) / factor) > (2 * jitter_eps)
    gates2 = rest.masked_fill(too_far, float("-inf"))
    if training:
        second = _gumbel_pick(gates2)
    else:
        second = best
    gates2 = torch.softmax(gates2, dim=-1)
    weight_second = gates2.gather(dim=-1, index=second)
    if training:
        top_prob, top_idx = gates2.max(dim=-1, keepdim=True)
        keep_one = torch.logical_or(second == top_idx, torch.rand_like(top_prob).uniform_() > 0.75)
        keep_one = torch.add(0.3333, keep_one, alpha=0.6667).type_as(gates2)
        weight_second = mp.apply(scores, weight_second, second, gates2, keep_one)

    return torch.concat((weight_first, weight_second), dim=-1), torch.concat((first, second), dim=-1)


class PhiMoESparseMoeBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden_dim = HIDDEN
        self.num_experts = EXPERTS
        self.top_k = TOP_K
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = nn.ModuleList(PhiMoEBlockSparseTop2MLP() for _ in range(EXPERTS))
        self.router_jitter_noise = ROUTER_JITTER
        self.input_jitter_noise = INPUT_JITTER

    def forward(self, hidden_states):
        batch, seq, hidden = hidden_states.shape
        if self.training and self.input_jitter_noise > 0:
            hidden_states *= torch.empty_like(hidden_states).uniform_(
                1.0 - self.input_jitter_noise, 1.0 + self.input_jitter_noise)
        hidden_states = hidden_states.view(-1, hidden)
        router_logits = self.gate(hidden_states)
        weights, chosen = sparsemixer(router_logits, top_k=2, jitter_eps=self.router_jitter_noise,
                                      training=self.training)

        out = torch.zeros((batch * seq, hidden), dtype=hidden_states.dtype, device=hidden_states.device)
        mask = F.one_hot(chosen, num_classes=self.num_experts).permute(2, 1, 0)
        for e in range(self.num_experts):
            expert = self.experts[e]
            slot, rows = torch.where(mask[e])
            if rows.shape[0] == 0:
                continue
            rows_list = rows.tolist()
            slot_list = slot.tolist()
            picked = hidden_states[None, rows_list].reshape(-1, hidden)
            y = expert(picked) * weights[rows_list, slot_list, None]
            out.index_add_(0, rows, y.to(hidden_states.dtype))
        return out.reshape(batch, seq, hidden), router_logits


def build():
    return tiny(PhiMoESparseMoeBlock, HIDDEN)
