"""lucidrains' ST-MoE `MoE`: top-n gating with capacity and a straight-through dispatch tensor, experts looped.

Mirrors lucidrains/st-moe-pytorch `st_moe_pytorch/st_moe_pytorch.py` at commit 51727d0 (`TopNGating.forward`,
`MoE.forward`, `Experts.forward` on its non-distributed path, `Expert`, `GEGLU`, `cumsum_exclusive`,
`safe_one_hot`). The gate computes the capacity from the group size first (min(n, int(n * capacity_factor /
E)), at least 4), applies a bias-free linear router, a softmax and a top-n (`colt5_attention.topk` with
`non_differentiable=True`, which is `torch.topk`), moves the top-n axis first, one-hot encodes the choices and
renormalises the n gates by their sum. Each choice past the first is kept with probability
min(1, gate / threshold) using an in-graph `uniform_` draw (the first is forced with `should_route[0] =
True`). An exclusive cumsum along the sequence gives each choice's slot in its expert; a Python loop over
the top-n ranks offsets the slots by the counts of earlier ranks and drops those at or past the capacity.
The combine tensor [b, n, E, C] sums gate * kept * one_hot(expert) * safe_one_hot(slot) over the ranks
(`safe_one_hot` reads `indexes.max() + 1` against the capacity with a Python `max`, a host read); the
dispatch tensor is its boolean cast plus the straight-through term combine - combine.detach(). The balance
and router z-losses are computed only under `if self.training`, else a zero buffer. The layer dispatches
with einsum('bnd,bnec->becd'); `Experts` moves every expert it does not use to CPU
(`all_experts_to_cpu_besides`, a no-op here), permutes to [E, b, C, d], loops `for expert, x in
zip(experts, x)` over an nn.ModuleList of GEGLU experts (Linear(d, 2h), gelu(gate) * x * mult_bias,
Linear(h, d)), stacks the outputs (`if len(outs) > 0`), permutes back and asserts the shape; the layer
combines with einsum('becd,bnec->bnd') and returns a namedtuple (output, total aux loss, balance loss,
z-loss). Left out: the distributed all-gather / rank-splitting branches of `Experts` (one process), the
differentiable coordinate-descent top-k (off by default) and the `SparseMoEBlock` wrapper. einops
`rearrange`/`reduce` are written as permute/sum. The model uses an eval threshold of 1e-9 so the random
draw keeps every second choice and the output is deterministic (the default 0.2 makes it random).
Constructs: `if self.training` loss branches and `getattr(self, f"threshold_{suffix}")` selection, an
in-graph `uniform_` draw, an in-place `should_route[0, ...] = True`, a Python loop over the top-n ranks with
in-place `mask[n] *=`, a Python `max(tensor, int)` host read in `safe_one_hot`, a per-expert
`for expert, x in zip(...)` loop over ModuleList slices, `expert.to(device)` calls and an `assert` in forward.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("lucidrains/st-moe-pytorch", "st_moe_pytorch/st_moe_pytorch.py",
                "51727d007b09c01936d4a365ad0aa6569c530cf0", "MoE.forward")
HIDDEN, EXPERTS, TOP_N = 16, 4, 2
HIDDEN_MULT = 0.75  # int(16 * 0.75 * 2 / 3) = 8 GEGLU units per expert
MIN_EXPERT_CAPACITY = 4


class MixtureOfExpertsReturn(NamedTuple):
    outputs: torch.Tensor
    total_aux_loss: torch.Tensor
    balance_loss: torch.Tensor
    router_z_loss: torch.Tensor


def cumsum_exclusive(t, dim=-3):
    assert dim < 0
    return F.pad(t, (*((0, 0) * (-dim - 1)), 1, -1)).cumsum(dim=dim)


def safe_one_hot(indexes, max_length):
    top = indexes.max() + 1
    classes = max(top + 1, max_length)
    return F.one_hot(indexes, classes)[..., :max_length]


class GEGLU(nn.Module):
    def __init__(self, dim, mult_bias=True):
        super().__init__()
        self.mult_bias = nn.Parameter(torch.ones(dim)) if mult_bias else 1.0

    def forward(self, x):
        x, gate = x.chunk(2, dim=-1)
        return F.gelu(gate) * x * self.mult_bias


class Expert(nn.Module):
    def __init__(self, dim, hidden_mult=4, mult_bias=True):
        super().__init__()
        inner = int(dim * hidden_mult * 2 / 3)
        self.net = nn.Sequential(nn.Linear(dim, inner * 2), GEGLU(inner, mult_bias=mult_bias), nn.Linear(inner, dim))

    def forward(self, x):
        return self.net(x)


class Experts(nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.num_experts = len(experts)
        self.experts = nn.ModuleList(experts)
        self.is_distributed = False
        self.register_buffer("dummy", torch.ones(1), persistent=False)

    @property
    def device(self):
        return self.dummy.device

    def all_experts_to_cpu_besides(self, selection):
        if isinstance(selection, int):
            chosen = [self.experts[selection]]
        if isinstance(selection, slice):
            chosen = self.experts[selection]
        else:
            chosen = selection
        keep = set(chosen)
        for expert in self.experts:
            expert.to(self.device if expert in keep else "cpu")

    def forward(self, x):
        shape, num_experts = x.shape, self.num_experts
        selected = slice(0, num_experts)
        x = x.permute(1, 0, 2, 3)
        self.all_experts_to_cpu_besides(selected)
        experts = self.experts[selected]
        outs = []
        for expert, expert_input in zip(experts, x, strict=False):
            outs.append(expert(expert_input))
        if len(outs) > 0:
            outs = torch.stack(outs)
        else:
            outs = torch.empty_like(x, requires_grad=self.training)
        outs = outs.permute(1, 0, 2, 3)
        assert outs.shape == shape
        return outs


class TopNGating(nn.Module):
    def __init__(self, dim, num_gates, eps=1e-9, top_n=2, threshold_train=0.2, threshold_eval=0.2,
                 capacity_factor_train=1.25, capacity_factor_eval=2.0, straight_through_dispatch_tensor=True):
        super().__init__()
        self.eps = eps
        self.num_gates = num_gates
        self.to_gates = nn.Linear(dim, num_gates, bias=False)
        self.top_n = top_n
        self.register_buffer("threshold_train", torch.tensor([eps, *((threshold_train,) * (top_n - 1))]))
        self.register_buffer("threshold_eval", torch.tensor([eps, *((threshold_eval,) * (top_n - 1))]))
        self.capacity_factor_train = capacity_factor_train
        self.capacity_factor_eval = capacity_factor_eval
        self.straight_through_dispatch_tensor = straight_through_dispatch_tensor
        self.register_buffer("zero", torch.zeros((1,)), persistent=False)

    def forward(self, x, noise_gates=False, noise_mult=1.0):
        *_, b, group_size, dim = x.shape
        dtype, top_n, num_gates, eps = x.dtype, self.top_n, self.num_gates, self.eps
        suffix = "train" if self.training else "eval"
        threshold = getattr(self, f"threshold_{suffix}")
        capacity_factor = getattr(self, f"capacity_factor_{suffix}")

        capacity = min(group_size, int((group_size * capacity_factor) / num_gates))
        capacity = max(capacity, MIN_EXPERT_CAPACITY)
        capacity_f = float(capacity)

        gate_logits = self.to_gates(x)
        noised = gate_logits
        if noise_gates:
            uniform = torch.zeros_like(noised).uniform_(0, 1)
            inner = -torch.log(uniform.clamp(min=1e-20))
            noise = -torch.log(inner.clamp(min=1e-20))
            noised = noised + noise * noise_mult
        raw_gates = noised.softmax(dim=-1)

        picked = torch.topk(raw_gates, k=top_n, dim=-1)
        gates = picked.values.permute(2, 0, 1)
        gate_indices = picked.indices.permute(2, 0, 1)

        one_hot_indices = F.one_hot(gate_indices, num_gates)
        mask = one_hot_indices.float()
        mask_1 = mask[0]

        gates = gates / gates.sum(dim=0, keepdim=True).clamp(min=eps)

        draws = torch.zeros_like(gates).uniform_(0.0, 1.0)
        should_route = draws < (gates / threshold.view(-1, 1, 1).clamp(min=eps))
        should_route[0, ...] = True
        mask *= should_route.float().unsqueeze(-1)

        mask_cumsum = cumsum_exclusive(mask, dim=-2)
        positions = []
        earlier = 0.0
        for n in range(self.top_n):
            slot = (mask_cumsum[n] + earlier) * mask[n]
            mask[n] *= (slot < capacity_f).float()
            earlier = mask[n].sum(dim=-2, keepdim=True)
            positions.append(slot.sum(dim=-1))
        positions = torch.stack(positions)

        mask_flat = mask.sum(dim=-1)
        gates = gates * mask_flat

        combine = (
            gates[..., None, None] * mask_flat[..., None, None] * one_hot_indices[..., None]
            * safe_one_hot(positions.long(), capacity)[..., None, :]
        ).sum(dim=0)

        dispatch = combine.bool().type(dtype)
        if self.straight_through_dispatch_tensor:
            dispatch = dispatch + combine - combine.detach()

        if self.training:
            density_1 = mask_1.mean(dim=-2)
            density_1_proxy = raw_gates.mean(dim=-2)
            balance_loss = (density_1_proxy * density_1).mean() * float(num_gates**2)
        else:
            balance_loss = self.zero

        if self.training:
            router_z_loss = torch.square(torch.logsumexp(gate_logits, dim=-1)).mean()
        else:
            router_z_loss = self.zero

        return dispatch, combine, balance_loss, router_z_loss


class MoE(nn.Module):
    def __init__(self, dim=HIDDEN, num_experts=EXPERTS, expert_hidden_mult=HIDDEN_MULT, threshold_eval=1e-9,
                 gating_top_n=TOP_N, balance_loss_coef=1e-2, router_z_loss_coef=1e-3):
        super().__init__()
        self.dim = dim
        self.num_experts = num_experts
        self.gate = TopNGating(dim, top_n=gating_top_n, num_gates=num_experts, threshold_eval=threshold_eval)
        self.experts = Experts([Expert(dim=dim, hidden_mult=expert_hidden_mult) for _ in range(num_experts)])
        self.balance_loss_coef = balance_loss_coef
        self.router_z_loss_coef = router_z_loss_coef

    def forward(self, x, noise_gates=False, noise_mult=1.0):
        dispatch, combine, balance_loss, router_z_loss = self.gate(x, noise_gates=noise_gates,
                                                                   noise_mult=noise_mult)
        expert_inputs = torch.einsum("bnd,bnec->becd", x, dispatch)
        expert_outputs = self.experts(expert_inputs)
        output = torch.einsum("becd,bnec->bnd", expert_outputs, combine)
        total_aux_loss = balance_loss * self.balance_loss_coef + router_z_loss * self.router_z_loss_coef
        return MixtureOfExpertsReturn(output, total_aux_loss, balance_loss, router_z_loss)


def build():
    return tiny(MoE, HIDDEN)
