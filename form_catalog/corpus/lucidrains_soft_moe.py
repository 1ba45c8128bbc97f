"""lucidrains' `SoftMoE`: Soft MoE (Puigcerver et al.), every expert slot a softmax-weighted mix of all tokens.

Mirrors lucidrains/soft-moe-pytorch `soft_moe_pytorch/soft_moe.py` at commit f3779d5 (`SoftMoE.forward`,
`Experts.forward` on its one-process path, `Experts.all_experts_to_cpu_besides`, `RMSNorm`, `FeedForward`,
`l2norm`, `log`, `gumbel_noise`, `exists`, `default`). There is no top-k and no routing decision: the layer
RMS-normalises the tokens (l2 normalisation times sqrt(d) times a learned gamma) and, with a second RMSNorm,
a [E, S, d] slot-embedding parameter; the logits are einsum('bnd,esd->bnes'). Gumbel noise is added only
under `if add_noise` (off by default) and a key-padding mask is applied only `if exists(mask)` (None by
default). The dispatch weights are the softmax of the logits over the token axis n; the combine weights are
the logits flattened to [b, n, E*S] and softmaxed over the slot axis. The slots are
einsum('bnd,bnes->besd') of the tokens with the dispatch weights, i.e. each slot is a convex mix of every
token. `Experts` permutes the slots to [E, b, S, d], calls `all_experts_to_cpu_besides(slice(0, E))`, which
builds a set of the selected experts and calls `expert.to(device)` on each (all kept on their device here),
loops `for expert, expert_input in zip(experts, x)` over an nn.ModuleList slice of FeedForward experts
(Linear(d, 4d), GELU, Dropout(0), Linear(4d, d)), stacks the outputs (`if len(outs) > 0`, else an empty
tensor), permutes back and asserts the shape. The layer flattens the expert outputs to [b, E*S, d] and
combines with einsum('bsd,bns->bnd'). Inputs of rank 4 (images, packed to [b, h*w, d]) and rank 2 (single
tokens) are reshaped on the way in and out; the corpus feeds rank 3, so neither branch is taken.
Left out: the distributed all-gather / rank-splitting branches of `Experts` and their helpers
(`chunk_num`, `cumsum_exclusive`, `pack_one`, `unpack_one`; one process, `is_distributed` False), the
LayerNorm and GEGLU expert variants (off by default: `use_layernorm=False`, `geglu=False`) and
soft_moe_with_dynamic_slots.py. einops `rearrange`/`pack`/`unpack` are written out as permute/reshape/
unsqueeze/squeeze; the einsums are already `torch.einsum` in the original (spaces dropped from the
equations). The model uses E=4 experts with 2 slots each.
Constructs: `if add_noise` / `if exists(mask)` / rank-based reshaping branches, dense softmax dispatch and
combine einsums over all tokens and slots (no top-k, no gather), a per-expert `for expert, x in zip(...)`
loop over a ModuleList slice, `set(...)` membership and `expert.to(device)` calls, `if len(outs) > 0` and
an `assert` in forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source(
    "lucidrains/soft-moe-pytorch",
    "soft_moe_pytorch/soft_moe.py",
    "f3779d58860bb302a45459fc7ab5c5e24005d46c",
    "SoftMoE.forward",
)
HIDDEN, EXPERTS, SLOTS, EXPERT_MULT = 16, 4, 2, 4


def exists(val):
    return val is not None


def default(val, d):
    return val if exists(val) else d


def l2norm(t):
    return F.normalize(t, dim=-1)


def log(t, eps=1e-20):
    return torch.log(t.clamp(min=eps))


def gumbel_noise(t):
    uniform = torch.zeros_like(t).uniform_(0, 1)
    return -log(-log(uniform))


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = dim**0.5
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return l2norm(x) * self.scale * self.gamma


def FeedForward(dim, mult=4, dropout=0.0):  # noqa: N802 - the original's name
    inner = int(dim * mult)
    return nn.Sequential(nn.Linear(dim, inner), nn.GELU(), nn.Dropout(dropout), nn.Linear(inner, dim))


class Experts(nn.Module):
    def __init__(self, experts, is_distributed=False, offload_unused_experts_to_cpu=True):
        super().__init__()
        self.num_experts = len(experts)
        self.experts = nn.ModuleList(experts)
        self.is_distributed = is_distributed
        self.offload_unused_experts_to_cpu = offload_unused_experts_to_cpu
        self.register_buffer("dummy", torch.ones(1), persistent=False)

    @property
    def device(self):
        return self.dummy.device

    def all_experts_to_cpu_besides(self, selection):
        if not self.offload_unused_experts_to_cpu:
            return
        if isinstance(selection, int):
            chosen = [self.experts[selection]]
        if isinstance(selection, slice):
            chosen = self.experts[selection]
        else:
            chosen = selection
        chosen_set = set(chosen)
        for expert in self.experts:
            target = self.device if expert in chosen_set else "cpu"
            expert.to(target)

    def forward(self, x):
        shape, num_experts = x.shape, self.num_experts
        expert_slice = slice(0, num_experts)
        x = x.permute(1, 0, 2, 3)
        self.all_experts_to_cpu_besides(expert_slice)
        experts = self.experts[expert_slice]
        outs = []
        for expert, expert_input in zip(experts, x, strict=False):
            outs.append(expert(expert_input))
        if len(outs) > 0:
            outs = torch.stack(outs)
        else:
            outs = torch.empty_like(x).requires_grad_()
        outs = outs.permute(1, 0, 2, 3)
        assert outs.shape == shape
        return outs


class SoftMoE(nn.Module):
    def __init__(
        self,
        dim=HIDDEN,
        *,
        seq_len=None,
        num_experts=EXPERTS,
        num_slots=SLOTS,
        expert_mult=EXPERT_MULT,
        dropout=0.0,
        is_distributed=False,
        offload_unused_experts_to_cpu=True,
    ):
        super().__init__()
        assert exists(seq_len) ^ exists(num_slots)
        if exists(seq_len):
            num_slots = default(num_slots, seq_len // num_experts)
        elif exists(num_slots):
            seq_len = num_slots * num_experts
        self.norm = RMSNorm(dim)
        self.slot_norm = RMSNorm(dim)
        self.slot_embeds = nn.Parameter(torch.randn(num_experts, num_slots, dim))
        self.experts = Experts(
            [FeedForward(dim, mult=expert_mult, dropout=dropout) for _ in range(num_experts)],
            is_distributed=is_distributed,
            offload_unused_experts_to_cpu=offload_unused_experts_to_cpu,
        )

    def forward(self, x, mask=None, add_noise=False, noise_mult=1.0):
        single_token = x.ndim == 2
        image = x.ndim == 4
        if image:
            x = x.permute(0, 2, 3, 1)
            packed_shape = x.shape[1:3]
            x = x.reshape(x.shape[0], -1, x.shape[-1])
        elif single_token:
            x = x.unsqueeze(1)

        x = self.norm(x)
        slot_embeds = self.slot_norm(self.slot_embeds)
        logits = torch.einsum("bnd,esd->bnes", x, slot_embeds)

        if add_noise:
            logits = logits + gumbel_noise(logits) * noise_mult

        if exists(mask):
            mask = mask[:, :, None, None]
            logits = logits.masked_fill(~mask, -torch.finfo(logits.dtype).max)

        dispatch_weights = logits.softmax(dim=1)
        combine_weights = logits.reshape(*logits.shape[:2], -1).softmax(dim=-1)

        slots = torch.einsum("bnd,bnes->besd", x, dispatch_weights)
        out = self.experts(slots)

        out = out.reshape(out.shape[0], -1, out.shape[-1])
        out = torch.einsum("bsd,bns->bnd", out, combine_weights)

        if image:
            out = out.reshape(out.shape[0], *packed_shape, out.shape[-1])
            out = out.permute(0, 3, 1, 2)
        elif single_token:
            out = out.squeeze(1)
        return out


def build():
    return tiny(SoftMoE, HIDDEN)
