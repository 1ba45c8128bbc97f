"""nanoMoE's `MOELayer`: a capacity router building one-hot dispatch/combine tensors, bmm experts.

Mirrors wolfecameron/nanoMoE `model.py` at commit 661fbcf (`Router.forward`, `Router.get_capacity`,
`Router.compute_aux_loss`, `Router.compute_router_z_loss`, `MLPExperts.forward`, `MOELayer.forward`, and the
`MANAGER` loss collector of `manager.py`), with the settings of `config/train_nano_moe.py` (8 experts, top-2,
aux and z losses on, no router noise, eval capacity factor 2.0, full-precision router). The router runs
under `torch.amp.autocast(device_type, enabled=False)` (the device type chosen by
`torch.cuda.is_available()`), projects the tokens to logits, appends the z-loss (logsumexp squared, mean)
to a global collector, takes the top-k logits, scatters them into -inf and softmaxes (weights over the k
chosen experts only), appends the Switch aux loss (under `torch.no_grad` for the token fractions), and
computes the capacity on the host: floor(k * factor * tokens / E), rounded up to even, at least
`min_capacity`, with `self.training` choosing the factor. It one-hot encodes the choices as [k, T, E] (top-1
choices first), ranks each token within its expert by a cumsum over k*T, zeroes choices whose rank reaches
the capacity, and builds the combine tensor [T, E, capacity] from the masked probabilities times a one-hot
of the rank; the dispatch mask is its `.bool()`. The layer gathers expert batches with one matmul
(mask^T @ x -> [E, capacity, H]), runs all experts with `torch.bmm` (stacked c_fc [E, H, 4H] and c_proj
[E, 4H, H] weights with biases, GELU), and combines with one matmul of the flattened combine weights.
Left out: nothing of the forward (dropout is zero; losses are collected as in the original).
Constructs: a host-side capacity from Python `math.floor` / `max` with an `if self.training` choice,
`torch.cuda.is_available()` and an autocast context, side effects appending tensors to a global list,
`F.one_hot` with a Python `num_classes`, cumsum capacity ranks, token dropping by mask.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("wolfecameron/nanoMoE", "model.py", "661fbcfade3e3081b3ed1150bc07e49082f46b48",
                "MOELayer.forward")
HIDDEN, EXPERTS, TOP_K = 16, 8, 2
TRAIN_CAPACITY, EVAL_CAPACITY, MIN_CAPACITY = 1.25, 2.0, 4


class LossCollector:
    """The module-level store the routers append their losses to (the original's `MOEManager`)."""

    def __init__(self):
        self.aux_loss = []
        self.router_z_loss = []

    def add_aux_loss(self, loss):
        self.aux_loss.append(loss)

    def add_router_z_loss(self, loss):
        self.router_z_loss.append(loss)


MANAGER = LossCollector()


class nullcontext:  # noqa: N801 - stands in for contextlib.nullcontext, which the corpus may not import
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


class Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.top_k, self.n_exp = TOP_K, EXPERTS
        self.use_noisy_top_k = False
        self.train_capacity, self.eval_capacity, self.min_capacity = TRAIN_CAPACITY, EVAL_CAPACITY, MIN_CAPACITY
        self.router_use_full_prec = True
        self.use_aux_loss = True
        self.use_router_z_loss = True
        self.w_g = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.w_noise = nn.Linear(HIDDEN, EXPERTS, bias=False) if self.use_noisy_top_k else None

    def forward(self, x):
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        ctx = (torch.amp.autocast(device_type=device_type, enabled=False) if self.router_use_full_prec
               else nullcontext())
        with ctx:
            b, t, _ = x.size()
            n = b * t
            logits = self.w_g(x)
            if self.use_noisy_top_k:
                scale = F.softplus(self.w_noise(x))
                scale *= torch.randn_like(scale)
                logits += scale
            if self.use_router_z_loss:
                MANAGER.add_router_z_loss(self.compute_router_z_loss(logits))
            best, chosen = logits.topk(self.top_k, dim=-1)
            probs = torch.full_like(logits, float("-inf"))
            probs.scatter_(-1, chosen, best)
            probs = F.softmax(probs, dim=-1)
            if self.use_aux_loss:
                MANAGER.add_aux_loss(self.compute_aux_loss(probs, chosen))
            capacity = self.get_capacity(n)

            onehot = F.one_hot(chosen, num_classes=self.n_exp).view(n, self.top_k, self.n_exp).permute(1, 0, 2)
            rank = torch.cumsum(onehot.reshape(self.top_k * n, self.n_exp), dim=0) - 1
            rank = rank.reshape(self.top_k, n, self.n_exp)
            onehot *= torch.lt(rank, capacity)
            used = torch.sum(onehot, dim=(0, 1))
            rank = torch.sum(onehot * rank, dim=-1)
            weights = onehot * probs.view(n, self.n_exp)[None, :]
            slot = F.one_hot(rank, num_classes=capacity)
            combine = torch.sum(weights.unsqueeze(3) * slot.unsqueeze(2), dim=0)
            return used, combine, combine.bool()

    def compute_aux_loss(self, probs, chosen):
        with torch.no_grad():
            picked = torch.sum(F.one_hot(chosen, num_classes=self.n_exp).float(), dim=2)
            token_share = torch.mean(picked.float(), dim=(0, 1))
        prob_share = torch.mean(probs.float(), dim=(0, 1))
        return self.n_exp * torch.sum(prob_share * token_share)

    def compute_router_z_loss(self, logits):
        return torch.mean(torch.logsumexp(logits, dim=-1) ** 2.0)

    def get_capacity(self, tokens):
        factor = self.train_capacity if self.training else self.eval_capacity
        capacity = math.floor(self.top_k * factor * tokens / self.n_exp)
        capacity += capacity % 2
        capacity = max(capacity, self.min_capacity)
        assert capacity > 0
        return int(capacity)


class MLPExperts(nn.Module):
    """All experts at once: bmm with c_fc [E, H, 4H] (+ fc_bias), GELU, bmm with c_proj [E, 4H, H] (+ proj_bias)."""

    def __init__(self):
        super().__init__()
        self.bias = True
        self.c_fc = nn.Parameter(torch.empty(EXPERTS, HIDDEN, 4 * HIDDEN))
        self.c_proj = nn.Parameter(torch.empty(EXPERTS, 4 * HIDDEN, HIDDEN))
        self.fc_bias = nn.Parameter(torch.empty(EXPERTS, 1, 4 * HIDDEN)) if self.bias else None
        self.proj_bias = nn.Parameter(torch.empty(EXPERTS, 1, HIDDEN)) if self.bias else None
        self.gelu = nn.GELU()
        self.dropout = nn.Dropout(0.0)

    def forward(self, x):
        x = torch.bmm(x, self.c_fc)
        if self.bias:
            x += self.fc_bias
        x = torch.bmm(self.gelu(x), self.c_proj)
        if self.bias:
            x += self.proj_bias
        return self.dropout(x)


class MOELayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = Router()
        self.experts = MLPExperts()

    def forward(self, x):
        b, t, h = x.size()
        n = b * t
        _, combine, dispatch = self.router(x)
        x = x.view(n, h)
        batches = dispatch.permute(1, 2, 0).type_as(x) @ x
        expert_out = self.experts(batches)
        out = combine.view(n, -1) @ expert_out.view(-1, h)
        return out.view(b, t, h)


def build():
    return tiny(MOELayer, HIDDEN)
