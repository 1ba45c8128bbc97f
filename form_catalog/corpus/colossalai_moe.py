"""Colossal-AI's `SparseMLP`: capacity-limited top-2 router with dense one-hot dispatch/combine matmuls.

Mirrors hpcaitech/ColossalAI `colossalai/moe/layers.py` at commit 7d8e033 (`SparseMLP.forward`,
`_local_process`), with `colossalai/moe/routers.py` (`MoeRouter.get_capacity`, `Top2Router.forward`),
`colossalai/moe/_operation.py` (`moe_cumsum`) and `colossalai/moe/experts.py` (`MLPExperts.forward`), set up
the way `applications/ColossalMoE/colossal_moe/models/mixtral_layer.py` replaces a Mixtral block (8 experts,
top-2, `router_norm=True`, `router_loss=False`, gated SiLU experts, `return_gate_logits=True`, no kernels,
default capacity factors 1.25 train / 2.0 eval, `min_capacity=4`, `drop_tks=True`). This stands in for the
assigned Megablocks entry: databricks/megablocks has no plain-PyTorch reference MoE (its dMoE/MoE always
call its CUDA/Triton kernels; its tests only hold dense FFN/GLU references).

The layer flattens tokens, computes gate logits with a bias-free [E, D] weight and casts them to float32.
The router softmaxes them, divides ALL probabilities by the sum of the two largest (`use_norm`), picks the
first expert with `argmax`, masks it with -inf and `argmax`es again for the second, one-hot encodes both,
and sets the capacity on the host: floor(k * factor * T / E) rounded up to even and at least
`min_capacity`, with the factor chosen by `self.training`. Positions in each expert's queue come from a
cumulative sum of the one-hot masks minus one (second choices queue after all first choices); choices past
the capacity are dropped. It then fills a [T, E, C] combine-weight tensor and a boolean dispatch mask by
advanced-index `+=` / `|=` at (token, expert, position). The layer dispatches with
`matmul(mask.permute(1, 2, 0), tokens)` into [E, C, D], runs the experts on [1, E, C, D] (per-expert
`torch.mm` list comprehensions over range(E): silu(x Wg) * (x Wu), dropout p=0, then Wo, with weights
stacked as `wi_gate`/`wi_up` [E, D, I] and `wo` [E, I, D]) and combines with
`matmul(combine.view(T, E*C), out.view(E*C, D))`. It returns (output, gate_logits).
Left out: the CUDA dispatch/combine/cumsum kernels (`enable_kernel`; the plain path is kept), expert and
tensor parallel all-to-all/all-gather paths, the no-drop eval branch that all-reduces the max load and
reads it with `.item()` (only taken with an expert-parallel group), the router aux/z losses (off in this
configuration), the load balancer (off), the noise policy (None), and the identity-forward gradient
scalers around the experts.
Constructs: a host-side Python capacity from `math.floor` of shapes chosen by `self.training`,
`argmax` + `masked_fill(-inf)` top-2, cumsum queue positions with a capacity drop (`torch.lt`),
advanced-index `+=`/`|=` writes, starred unpacking of the router result, one-hot matmul dispatch and
combine, list comprehensions over `range(E)` in the experts, a tuple return.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("hpcaitech/ColossalAI", "colossalai/moe/layers.py", "7d8e0338a40da196436bef866ebdc43d5ed1c677",
                "SparseMLP.forward")
HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 8, 2


def moe_cumsum(inputs, use_kernel=False):
    return torch.cumsum(inputs, dim=0) - 1


class Top2Router(nn.Module):
    def __init__(self, capacity_factor_train=1.25, capacity_factor_eval=2.0, min_capacity=4, noisy_func=None,
                 drop_tks=True):
        super().__init__()
        self.k_value = 2
        self.capacity_factor_train = capacity_factor_train
        self.capacity_factor_eval = capacity_factor_eval
        self.min_capacity = min_capacity
        self.noisy_func = noisy_func
        self.drop_tks = drop_tks
        self.use_kernel = False

    def get_capacity(self, logits_shape):
        factor = self.capacity_factor_train if self.training else self.capacity_factor_eval
        cap = math.floor(self.k_value * factor * logits_shape[-2] / logits_shape[-1])
        cap += cap % 2
        cap = max(cap, self.min_capacity)
        assert cap > 0
        return int(cap)

    def forward(self, inputs, use_kernel=False, ep_group=None, use_norm=False, use_loss=True):
        if self.noisy_func is not None and self.training:
            inputs = self.noisy_func(inputs)
        assert inputs.dtype == torch.float
        probs = F.softmax(inputs, dim=-1)
        if use_norm:
            best_two, _ = torch.topk(probs, 2, dim=-1)
            probs = probs / best_two.sum(dim=-1, keepdim=True)

        num_experts = probs.size(-1)
        capacity = self.get_capacity(inputs.shape)

        first = torch.argmax(probs, dim=-1)
        mask1 = F.one_hot(first, num_classes=num_experts).to(torch.int32)
        rest = probs.masked_fill(mask1.bool(), float("-inf"))
        second = torch.argmax(rest, dim=-1)
        mask2 = F.one_hot(second, num_classes=num_experts).to(torch.int32)

        pos1 = moe_cumsum(mask1, use_kernel=self.use_kernel)
        pos2 = moe_cumsum(mask2, use_kernel=self.use_kernel)
        pos2 += torch.sum(mask1, dim=-2, keepdim=True)

        mask1 *= torch.lt(pos1, capacity)
        mask2 *= torch.lt(pos2, capacity)
        used_capacity = mask1.sum(dim=0) + mask2.sum(dim=0)

        pos1 = torch.sum(mask1 * pos1, dim=-1)
        pos2 = torch.sum(mask2 * pos2, dim=-1)

        w1 = mask1 * probs.type_as(inputs)
        w2 = mask2 * probs.type_as(inputs)
        combine = torch.zeros(inputs.shape + (capacity,), device=inputs.device)
        dispatch = torch.zeros_like(combine, dtype=torch.bool)
        rows = torch.arange(0, inputs.shape[0], device=inputs.device)
        combine[rows, first[rows], pos1[rows]] += w1[rows, first[rows]]
        combine[rows, second[rows], pos2[rows]] += w2[rows, second[rows]]
        dispatch[rows, first[rows], pos1[rows]] |= mask1.bool()[rows, first[rows]]
        dispatch[rows, second[rows], pos2[rows]] |= mask2.bool()[rows, second[rows]]
        return used_capacity, combine, dispatch


class MLPExperts(nn.Module):
    def __init__(self, num_experts, hidden_size, intermediate_size, activation="silu", gated=True, drop_rate=0.0):
        super().__init__()
        self.num_local_experts = num_experts
        self.gated = gated
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        if gated:
            self.wi_gate = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
            self.wi_up = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        else:
            self.wi = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.wo = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.act = nn.SiLU()
        self.drop = nn.Dropout(p=drop_rate)

    def forward(self, x, param_slice=(slice(None),), use_sparse=True):
        e = x.size(1)
        h = x.size(-1)
        x = x.transpose(0, 1)
        shape_in = x.shape
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
        x = x.reshape(shape_in)
        return x.transpose(0, 1).contiguous()


class SparseMLP(nn.Module):
    def __init__(self, num_experts, hidden_size, intermediate_size, router_top_k=2, router_loss=False,
                 router_norm=True, mlp_activation="silu", mlp_gated=True, return_gate_logits=True):
        super().__init__()
        assert router_top_k == 2
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_experts = num_experts
        self.return_gate_logits = return_gate_logits
        self.expert_parallel = None
        self.router_loss = router_loss
        self.router_norm = router_norm
        self.topk = router_top_k
        self.router = Top2Router()
        self.gate_weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.experts = MLPExperts(num_experts, hidden_size, intermediate_size, activation=mlp_activation,
                                  gated=mlp_gated)
        self.ep_group = None

    def forward(self, inputs):
        tokens = inputs.reshape(-1, self.hidden_size)
        gate_logits = F.linear(tokens, self.gate_weight)
        gate_output = gate_logits.to(torch.float)

        used_capacity, *route = self.router(inputs=gate_output, use_kernel=False, ep_group=self.ep_group,
                                            use_loss=self.router_loss, use_norm=self.router_norm)

        mask_f = route[1].type_as(inputs)
        dispatched = torch.matmul(mask_f.permute(1, 2, 0), tokens)

        if self.expert_parallel is None:
            expert_output = self._local_process(dispatched)
        else:
            raise NotImplementedError("expert / tensor parallel paths are not mirrored")

        weights = route[0].type_as(inputs)
        weights = weights.view(weights.shape[0], -1)
        expert_output = expert_output.view(-1, expert_output.shape[-1])
        ans = torch.matmul(weights, expert_output).reshape(inputs.shape)
        if self.return_gate_logits:
            return ans, gate_logits
        return ans

    def _local_process(self, expert_in):
        return self.experts(expert_in.unsqueeze(0))


def build():
    return tiny(lambda: SparseMLP(num_experts=EXPERTS, hidden_size=HIDDEN, intermediate_size=INTER), HIDDEN)
