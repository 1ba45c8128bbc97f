"""OpenMoE's `SparseMLP` (Colossal-AI): a Top-2 capacity router with indexed slot writes and per-expert mm lists.

Mirrors hpcaitech/ColossalAI `colossalai/moe/layers.py` at commit 773d9f9 (`SparseMLP.forward`,
`SparseMLP._local_process`), with `colossalai/moe/routers.py` (`MoeRouter.get_capacity`, `set_aux_loss`,
`set_z_loss`, `pop_router_loss`, `Top2Router.forward`), `colossalai/moe/experts.py` (`MLPExperts.forward`),
`colossalai/moe/_operation.py` (`moe_cumsum`, `MoeInGradScaler`, `MoeOutGradScaler`) and
`colossalai/moe/utils.py` (`SwiGLU`), configured as the OpenMoE example
`examples/language/openmoe/model/modeling_openmoe.py` builds it (top-2, gated experts, "swiglu", capacity
factors 1.25 / 2.0, minimum capacity 4, router losses on). This is the last commit that still holds these
files outside `colossalai/legacy`. The layer flattens the tokens and computes the gate logits with a
bias-free weight [E, H], cast to float32. The router softmaxes all logits (no renormalisation over the
two chosen), computes the capacity on the host (floor(2 * factor * T / E), rounded up to even, at least 4,
`self.training` choosing the factor), picks the best expert with `argmax`, masks it with -inf and picks the
second with another `argmax`, records the Switch aux loss and the z-loss on the router (with `assert`s on
its state) and hands them to a global manager's lists, ranks tokens by `cumsum - 1` per expert (second
choices after all first choices), zeroes choices past the capacity, and writes each token's probability
into a zero [T, E, capacity] combine tensor through advanced indexing (`cb[arange, top1, rank1] += ...`,
same for the second choice), with a matching boolean dispatch tensor (`|=`). Dispatch is one matmul
(mask^T @ tokens -> [E, capacity, H]); the experts (stacked wi_gate [E, H, 2I], wi_up [E, H, I], wo [E, I, H])
run as Python list comprehensions over `range(E)` of `torch.mm`, with SwiGLU(x @ wi_gate) * (x @ wi_up),
stacked back with `torch.cat`; identity-forward autograd Functions wrap them; the combine is one matmul.
Left out: the fused CUDA dispatch/combine and cumsum kernels and the Triton activation (the plain-PyTorch
paths the original falls back to are kept), expert/tensor parallel all-to-all paths and the host all-reduce
of the capacity (one process), load balancing (off by default), and the decoder's separate dense
`extra_mlp` residual that OpenMoE adds after this layer.
Constructs: a host-side capacity with an `if self.training` choice, `F.one_hot` with Python
`num_classes`, advanced-index `+=` / `|=` scatter into slot tensors, list comprehensions over experts,
custom `torch.autograd.Function`s, side effects (module attributes, a global loss list), `assert`s.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("hpcaitech/ColossalAI", "colossalai/moe/layers.py", "773d9f964a34a4aa905286a4a0a0a6ddb9de281d",
                "SparseMLP.forward")
HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 8, 2


class LossManager:
    """The global store routers hand their losses to (the original's `MOE_MANAGER.add_loss`)."""

    def __init__(self):
        self.router_aux_loss = []
        self.router_z_loss = []

    def add_loss(self, aux_loss=0.0, z_loss=0.0):
        self.router_aux_loss.append(aux_loss)
        self.router_z_loss.append(z_loss)


MOE_MANAGER = LossManager()


def moe_cumsum(inputs, use_kernel=False):
    return torch.cumsum(inputs, dim=0) - 1


class MoeInGradScaler(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, inputs, ep_size: int):
        if ctx is not None:
            ctx.ep_size = ep_size
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads):
        grad = grads[0]
        if ctx.ep_size != 1:
            grad = grad * ctx.ep_size
        return grad, None


class MoeOutGradScaler(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, inputs, ep_size: int):
        ctx.ep_size = ep_size
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads):
        grad = grads[0]
        if ctx.ep_size != 1:
            grad = grad / ctx.ep_size
        return grad, None


def SwiGLU(x):  # noqa: N802 - the original's name
    half = x.shape[-1] // 2
    a, b = torch.split(x, half, -1)
    return a * (b * torch.sigmoid(b))


class Top2Router(nn.Module):
    def __init__(self, capacity_factor_train=1.25, capacity_factor_eval=2.0, min_capacity=4, noisy_func=None,
                 drop_tks=True):
        super().__init__()
        self.k_value = 2
        self.capacity_factor_train, self.capacity_factor_eval = capacity_factor_train, capacity_factor_eval
        self.min_capacity, self.noisy_func, self.drop_tks = min_capacity, noisy_func, drop_tks
        self._aux_loss = None
        self._z_loss = None
        self.use_kernel = False

    def get_capacity(self, num_tokens, num_experts, ep_group=None):
        factor = self.capacity_factor_train if self.training else self.capacity_factor_eval
        capacity = math.floor(self.k_value * factor * num_tokens / num_experts)
        capacity += capacity % 2
        capacity = max(capacity, self.min_capacity)
        assert capacity > 0
        return int(capacity)

    def set_aux_loss(self, probs, chosen, num_experts):
        assert self._aux_loss is None
        if probs.dim() == chosen.dim() == 2:
            probs, chosen = probs.unsqueeze(0), chosen.unsqueeze(0)
        assert probs.dim() == chosen.dim() == 3
        hit = F.one_hot(chosen, num_experts).max(dim=-2)[0]
        token_share = torch.mean(hit.float(), dim=-2)
        prob_share = torch.mean(probs.float(), dim=-2)
        self._aux_loss = num_experts**2 * torch.mean(token_share * prob_share)

    def set_z_loss(self, logits):
        assert self._z_loss is None
        if logits.dim() == 2:
            logits = logits.unsqueeze(0)
        assert logits.dim() == 3
        groups, per_group, _ = logits.shape
        log_z = torch.logsumexp(logits, dim=-1)
        self._z_loss = torch.sum(log_z**2, dtype=torch.float32) / (groups * per_group)

    def pop_router_loss(self):
        assert self._aux_loss is not None
        MOE_MANAGER.add_loss(self._aux_loss, self._z_loss)
        self._aux_loss = None
        self._z_loss = None

    def forward(self, inputs, use_kernel=False, ep_group=None, use_norm=False, use_loss=True):
        if self.noisy_func is not None and self.training:
            inputs = self.noisy_func(inputs)
        assert inputs.dtype == torch.float
        probs = F.softmax(inputs, dim=-1)
        if use_norm:
            top_two, _ = torch.topk(probs, 2, dim=-1)
            probs = probs / top_two.sum(dim=-1, keepdim=True)
        num_experts = probs.size(-1)
        num_tokens = inputs.size(0)
        capacity = self.get_capacity(num_tokens, num_experts, ep_group)

        first = torch.argmax(probs, dim=-1)
        mask1 = F.one_hot(first, num_classes=num_experts).to(torch.int32)
        second = torch.argmax(probs.masked_fill(mask1.bool(), float("-inf")), dim=-1)
        mask2 = F.one_hot(second, num_classes=num_experts).to(torch.int32)
        if use_loss:
            self.set_aux_loss(probs, torch.stack([first, second], dim=-1), num_experts)
            self.set_z_loss(inputs)
            self.pop_router_loss()

        rank1 = moe_cumsum(mask1, use_kernel=self.use_kernel)
        rank2 = moe_cumsum(mask2, use_kernel=self.use_kernel)
        rank2 += torch.sum(mask1, dim=-2, keepdim=True)
        mask1 *= torch.lt(rank1, capacity)
        mask2 *= torch.lt(rank2, capacity)
        used_capacity = mask1.sum(dim=0) + mask2.sum(dim=0)
        rank1 = torch.sum(mask1 * rank1, dim=-1)
        rank2 = torch.sum(mask2 * rank2, dim=-1)

        weight1 = mask1 * probs.type_as(inputs)
        weight2 = mask2 * probs.type_as(inputs)
        combine = torch.zeros(inputs.shape + (capacity,), device=inputs.device)
        dispatch = torch.zeros_like(combine, dtype=torch.bool)
        rows = torch.arange(0, inputs.shape[0], device=inputs.device)
        combine[rows, first[rows], rank1[rows]] += weight1[rows, first[rows]]
        combine[rows, second[rows], rank2[rows]] += weight2[rows, second[rows]]
        dispatch[rows, first[rows], rank1[rows]] |= mask1.bool()[rows, first[rows]]
        dispatch[rows, second[rows], rank2[rows]] |= mask2.bool()[rows, second[rows]]
        return used_capacity, combine, dispatch


class MLPExperts(nn.Module):
    def __init__(self, num_experts, hidden_size, intermediate_size, activation="swiglu", gated=True):
        super().__init__()
        self.num_total_experts = self.num_local_experts = num_experts
        self.ep_size = 1
        self.gated, self.use_kernel = gated, False
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        if gated:
            gate_width = intermediate_size * 2 if activation == "swiglu" else intermediate_size
            self.wi_gate = nn.Parameter(torch.empty(num_experts, hidden_size, gate_width))
            self.wi_up = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        else:
            self.wi = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.wo = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.act_name = activation
        self.act = SwiGLU if activation == "swiglu" else nn.SiLU()
        self.drop = nn.Dropout(p=0)

    def forward(self, x, param_slice=(slice(None),), use_sparse=True):
        x = MoeInGradScaler.apply(x, self.ep_size)
        e, h = x.size(1), x.size(-1)
        x = x.transpose(0, 1)
        inshape = x.shape
        x = x.reshape(e, -1, h)
        if self.gated:
            gate = [torch.mm(x[i], self.wi_gate[param_slice][i]) for i in range(e)]
            up = [torch.mm(x[i], self.wi_up[param_slice][i]) for i in range(e)]
            x = [self.act(gate[i]) * up[i] for i in range(e)]
        else:
            x = [torch.mm(x[i], self.wi[param_slice][i]) for i in range(e)]
            x = [self.act(x[i]) for i in range(e)]
        x = [self.drop(x[i]) for i in range(e)]
        x = [torch.mm(x[i], self.wo[param_slice][i]) for i in range(e)]
        x = torch.cat([x[i].unsqueeze(0) for i in range(e)], dim=0)
        x = x.reshape(inshape).transpose(0, 1).contiguous()
        return MoeOutGradScaler.apply(x, self.ep_size)


class SparseMLP(nn.Module):
    def __init__(self, num_experts=EXPERTS, hidden_size=HIDDEN, intermediate_size=INTER, router_top_k=TOP_K,
                 router_loss=True, router_norm=False, mlp_activation="swiglu", mlp_gated=True):
        super().__init__()
        self.hidden_size, self.intermediate_size, self.num_experts = hidden_size, intermediate_size, num_experts
        self.gated = mlp_gated
        self.return_gate_logits = False
        self.enable_kernel = False
        self.expert_parallel = None
        self.router_loss, self.router_norm = router_loss, router_norm
        self.topk = router_top_k
        self.router = Top2Router()
        self.gate_weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.experts = MLPExperts(num_experts, hidden_size, intermediate_size, mlp_activation, mlp_gated)
        self.ep_group = None
        self.num_local_experts = self.experts.num_local_experts

    def forward(self, inputs):
        tokens = inputs.reshape(-1, self.hidden_size)
        gate_logits = F.linear(tokens, self.gate_weight)
        gate_output = gate_logits.to(torch.float)
        used_capacity, *routed = self.router(inputs=gate_output, use_kernel=self.enable_kernel,
                                             ep_group=self.ep_group, use_loss=self.router_loss,
                                             use_norm=self.router_norm)
        dispatch = torch.matmul(routed[1].type_as(inputs).permute(1, 2, 0), tokens)
        expert_output = self._local_process(dispatch)
        weights = routed[0].type_as(inputs)
        weights = weights.view(weights.shape[0], -1)
        ans = torch.matmul(weights, expert_output.view(-1, expert_output.shape[-1]))
        ans = ans.reshape(inputs.shape)
        if self.return_gate_logits:
            return ans, gate_logits
        return ans

    def _local_process(self, expert_in):
        return self.experts(expert_in.unsqueeze(0))


def build():
    return tiny(SparseMLP, HIDDEN)
