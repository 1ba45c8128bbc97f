"""SkyworkAI's MoE++ layer: Skywork-MoE gating plus zero-computation experts, dispatched from a per-expert dict.

Mirrors SkyworkAI/MoE-plus-plus `MoE++/moe_plus_plus_layer.py` at commit a5425c5 (`gating`, `Router`,
`Experts`, `MOELayer.forward`, `MOE.forward`, `CopyExpert`, `ZeroExpert`, `ConstantExpert`) with the expert
`MLPMoE` of `MoE++/modeling_moe_plus_plus.py` (same commit). It stands in for Skywork-MoE's own remote code
(`modeling_skywork_moe.py`), which is not among the stored copies; MoE++ is SkyworkAI's follow-up and keeps
Skywork-MoE's router and its config flags (`moe_use_mixtral_gating`, `moe_2layer_gate`,
`moe_use_logits_norm`, `moe_gate_norm_std`, `moe_feature_no_mul_topk`). The router runs in float32 (a
forward-time dtype check re-casts it): a two-layer gate, Linear(H, 8E) -> tanh -> Linear(8E, E), plus,
when the previous layer's logits are handed in, `gate_map` of them (the "gating residual"). `gating`,
with the flags set here (non-Mixtral gating, logit normalisation on), divides the logits by their
per-token std over the target std, softmaxes, takes the top-2, zeroes the weight of the last expert (the
zero expert), renormalises, and then builds a dict {expert: [token_ids, weights]} with a Python loop over
all experts, `torch.nonzero(indices == e, as_tuple=True)` each. The experts are E - 4 SwiGLU FFNs
(fused up_proj chunked into gate/up, then down_proj), 2 `ConstantExpert`s (a per-token softmax mix of the
input and a learned vector), one `CopyExpert` (identity) and one `ZeroExpert` (zeros). `MOELayer` flattens
tokens, multiplies the input in place by top_k (unless Mixtral gating or `moe_feature_no_mul_topk`),
and for every dict entry `index_select`s the rows, runs the expert (empty experts included: no skip),
scales in place and `index_add_`s. It returns (output, router logits), the logits being the next
layer's gating residual. Left out: expert parallelism (ep_size 1 here, no collectives in the original's
local path); `copy.deepcopy` of one expert and `collections.defaultdict` become fresh modules and a dict
(module rules: the tiny shell re-draws every weight anyway); the router's `setattr(weight, "router",
True)` tagging after a re-cast (metadata only). With one MoE layer the gating residual is
None, so `gate_map` is built but not used.
Constructs: Python loop over range(E) building a dict of `torch.nonzero(as_tuple=True)` gathers, loop over
`dict.items()` with no empty-expert skip, `index_select`/`index_add_`, in-place `*=` on a view of the
input, `isinstance` and dtype checks on the gate inside the forward, `if gate_residual is not None`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("SkyworkAI/MoE-plus-plus", "MoE++/moe_plus_plus_layer.py",
                "a5425c553365135c255d5b055f9a93717f106df5", "MOELayer.forward")
HIDDEN, INTER, EXPERTS = 16, 8, 8
MOE_TOP_K = 2
Constant = 2  # noqa: N816 - the original's name: how many ConstantExperts
MIXTRAL_GATING, TWO_LAYER_GATE, LOGITS_NORM, GATE_NORM_STD, NO_MUL_TOPK = False, True, True, 1.0, False


class MLPMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden_size = HIDDEN
        self.intermediate_size = INTER
        self.up_proj = nn.Linear(HIDDEN, 2 * INTER, bias=False)
        self.down_proj = nn.Linear(INTER, HIDDEN, bias=False)

    @staticmethod
    def act_fn(x):
        gate, up = torch.chunk(x, 2, dim=-1)
        return F.silu(gate) * up

    def forward(self, x):
        return self.down_proj(self.act_fn(self.up_proj(x)))


class CopyExpert(nn.Module):
    def __init__(self, expert):
        super().__init__()

    def forward(self, inputs):
        return inputs


class ZeroExpert(nn.Module):
    def __init__(self, expert):
        super().__init__()

    def forward(self, inputs):
        return torch.zeros_like(inputs).to(inputs.dtype).to(inputs.device)


class ConstantExpert(nn.Module):
    def __init__(self, expert):
        super().__init__()
        self.constant = nn.Parameter(torch.empty(expert.hidden_size))
        nn.init.normal_(self.constant)
        self.wg = nn.Linear(expert.hidden_size, 2, bias=False)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, inputs):
        mix = self.softmax(self.wg(inputs))
        keep = torch.einsum("b,bd->bd", [mix[:, 0].type_as(inputs), inputs])
        const = torch.einsum("b,d->bd", [mix[:, 1].type_as(inputs), self.constant.type_as(inputs)])
        return keep + const


def gating(logits, moe_use_mixtral_gating=False, moe_use_logits_norm=False, moe_gate_norm_std=1.0):
    num_experts = logits.size(1)
    if moe_use_mixtral_gating:
        if moe_use_logits_norm:
            logits = logits / (logits.std(dim=1, keepdim=True) / moe_gate_norm_std)
        gates, indices = torch.topk(logits, k=MOE_TOP_K, dim=1)
        gates = F.softmax(gates, dim=1)
    else:
        if moe_use_logits_norm:
            std = logits.std(dim=1, keepdim=True)
            gates = F.softmax(logits / (std / moe_gate_norm_std), dim=1)
        else:
            gates = F.softmax(logits, dim=1)
        gates, indices = torch.topk(gates, k=MOE_TOP_K, dim=1)
        gates = torch.where(indices == (num_experts - 1), torch.zeros_like(gates).to(gates.dtype), gates)
        gates /= torch.sum(gates, dim=1, keepdim=True)

    expert_info = {}
    for e in range(num_experts):
        token_ids, slot_ids = torch.nonzero(indices == e, as_tuple=True)
        expert_info[e] = [token_ids, gates[token_ids, slot_ids]]
    return expert_info


class Router(nn.Module):
    def __init__(self, model_dim, num_experts, moe_use_mixtral_gating, moe_2layer_gate, moe_use_logits_norm,
                 moe_gate_norm_std):
        super().__init__()
        if moe_2layer_gate:
            self.wg = nn.Sequential(nn.Linear(model_dim, num_experts * 8, bias=False).float(), nn.Tanh(),
                                    nn.Linear(num_experts * 8, num_experts, bias=False).float()).float()
        else:
            self.wg = nn.Linear(model_dim, num_experts, bias=False).float()
        self.gate_map = nn.Linear(num_experts, num_experts, bias=False)
        self.gate = gating
        self.moe_use_mixtral_gating = moe_use_mixtral_gating
        self.moe_use_logits_norm = moe_use_logits_norm
        self.moe_gate_norm_std = moe_gate_norm_std

    def forward(self, input, gate_residual=None):
        if isinstance(self.wg, nn.Linear):
            if self.wg.weight.dtype != torch.float32:
                self.wg = self.wg.float()
        else:
            if self.wg[0].weight.dtype != torch.float32:
                self.wg = self.wg.float()
        logits = self.wg(input.float())
        if gate_residual is not None:
            gate_residual = self.gate_map(gate_residual.to(self.gate_map.weight.dtype))
            logits += gate_residual
        info = self.gate(logits, self.moe_use_mixtral_gating, self.moe_use_logits_norm, self.moe_gate_norm_std)
        return info, logits


class Experts(nn.Module):
    def __init__(self, expert, num_local_experts=1):
        super().__init__()
        ffns = [expert] + [MLPMoE() for _ in range(num_local_experts - 2 - Constant - 1)]
        self.experts = nn.ModuleList(ffns + [ConstantExpert(expert) for _ in range(Constant)]
                                     + [CopyExpert(expert), ZeroExpert(expert)])

    def forward(self, inputs):
        raise NotImplementedError


class MOELayer(nn.Module):
    def __init__(self, gate, experts, ep_size, num_local_experts, moe_use_mixtral_gating,
                 moe_feature_no_mul_topk):
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_size = ep_size
        self.num_local_experts = num_local_experts
        self.moe_use_mixtral_gating = moe_use_mixtral_gating
        self.moe_feature_no_mul_topk = moe_feature_no_mul_topk

    def forward(self, *input: torch.Tensor, gate_residual=None, **kwargs: Any):
        d_model = input[0].shape[-1]
        flat = input[0].reshape(-1, d_model)
        out = torch.zeros_like(flat)
        expert_info, gate_residual = self.gate(flat, gate_residual)
        if not (self.moe_use_mixtral_gating or self.moe_feature_no_mul_topk):
            flat *= MOE_TOP_K
        for e, rows_and_gates in expert_info.items():
            rows, weight = rows_and_gates
            weight = weight.unsqueeze(-1)
            tokens = flat.index_select(dim=0, index=rows)
            y = self.experts.experts[e](tokens)
            y *= weight
            out.index_add_(dim=0, index=rows, source=y)
        return out.reshape(input[0].shape), gate_residual


class MOE(nn.Module):
    def __init__(self, hidden_size=HIDDEN, expert=None, num_experts=EXPERTS, ep_size=1,
                 moe_use_mixtral_gating=MIXTRAL_GATING, moe_2layer_gate=TWO_LAYER_GATE,
                 moe_use_logits_norm=LOGITS_NORM, moe_gate_norm_std=GATE_NORM_STD,
                 moe_feature_no_mul_topk=NO_MUL_TOPK):
        super().__init__()
        expert = MLPMoE() if expert is None else expert
        self.ep_size = ep_size
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        self.moe = MOELayer(
            Router(hidden_size, num_experts, moe_use_mixtral_gating, moe_2layer_gate, moe_use_logits_norm,
                   moe_gate_norm_std),
            Experts(expert, self.num_local_experts), ep_size, self.num_local_experts,
            moe_use_mixtral_gating, moe_feature_no_mul_topk)

    def forward(self, hidden_states, used_token=None, gate_residual=None):
        return self.moe(hidden_states, used_token, gate_residual=gate_residual)


def build():
    return tiny(MOE, HIDDEN)
