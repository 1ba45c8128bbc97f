"""Hunyuan-Large's remote-code `HunYuanMoE`: shared MLP plus capacity-buffer top-1 routing with einsum dispatch.

Mirrors Tencent/Tencent-Hunyuan-Large `models/modeling_hunyuan.py`, read from the fork
sunyanguomt/Tencent-Hunyuan-Large at commit 1b47308 (`HunYuanMoE.forward`, `HunYuanTopKGate.forward`,
`top1gating`, `topkgating`, `HunYuanMLP`). The layer runs the shared SwiGLU MLP (gate_proj/up_proj/down_proj,
`use_mixed_mlp_moe`) on the input, then the gate: a float32 bias-free linear router on the flattened tokens,
and, for `moe_topk == 1` (Hunyuan-Large's setting), `top1gating`: softmax, argmax expert, a capacity equal to
the number of tokens, a `topk` over the float one-hot mask along the tokens (k = capacity) whose indices are
scattered into a keep-mask, an optional random re-routing of dropped tokens (off in the released config), slots
from cumsum(mask) - 1, the gates masked to the chosen expert (no renormalisation), and combine weights
einsum('se,sc->sec') of the gates with one-hot slots [S, E, C]; the dispatch mask is their boolean cast. For
`moe_topk > 1` the gate uses `topkgating` instead (Switch-style priorities: top-k, gates divided by the sum of
the chosen ones, cumsum of the rank-major one-hot mask, a max over ranks, a validity mask against
capacity = k * S, one-hot slots and einsum('...te,...tec->...tec')); both are kept here, the model runs the
top-1 path. The layer dispatches with einsum('sec,sm->ecm'), `chunk`s into one [1, C, M] slice per expert
and loops `for chunk, expert in zip(chunks, self.experts)` over an nn.ModuleList of SwiGLU MLPs,
concatenates, combines with einsum('sec,ecm->sm') and adds the shared MLP's output. Left out: the aux-loss
logging outside the layer and the rest of the model; 16 experts become 8.
Constructs: a `moe_topk == 1` branch choosing between two gating functions, a `pretraining_tp > 1` branch
in the MLP, capacity from shapes, an in-graph `topk` with k = token count and `scatter_`, a
`random_routing_dropped_token` branch (not taken) with `nonzero`, `repeat_interleave` by tensor counts and
`randperm`, dense dispatch/combine einsums, and a `chunk` + `for chunk, expert in zip(...)` expert loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("sunyanguomt/Tencent-Hunyuan-Large", "models/modeling_hunyuan.py",
                "1b47308f22f7064d1d329058d06269bc0ca3c8d4", "HunYuanMoE.forward")
HIDDEN, INTER, EXPERTS, MOE_TOPK = 16, 8, 8, 1


class HunYuanConfig:
    hidden_size = HIDDEN
    intermediate_size = INTER
    num_experts = EXPERTS
    moe_topk = MOE_TOPK
    num_shared_expert = 1
    use_mixed_mlp_moe = True
    moe_drop_tokens = False
    moe_random_routing_dropped_token = False
    hidden_act = "silu"
    pretraining_tp = 1


def topkgating(logits, topk):
    logits = logits.float()
    gates = F.softmax(logits, dim=1)
    capacity = topk * gates.shape[0]
    num_experts = int(gates.shape[1])
    expert_gate, expert_index = torch.topk(gates, topk)
    expert_mask = F.one_hot(expert_index, num_experts)
    routed_any = expert_mask.max(dim=-2)[0]
    tokens_per_expert = torch.mean(routed_any.float(), dim=-2)
    prob_per_expert = torch.mean(gates.float(), dim=-2)
    l_aux = num_experts**2 * torch.mean(tokens_per_expert * prob_per_expert)

    chosen_sum = torch.clamp(torch.matmul(expert_mask.float(), gates.unsqueeze(-1)).sum(dim=1),
                             min=torch.finfo(gates.dtype).eps)
    router_probs = gates / chosen_sum

    expert_index = torch.transpose(expert_index, 0, 1).reshape(-1)
    expert_mask = F.one_hot(expert_index, num_experts).to(torch.int32)
    exp_counts = torch.sum(expert_mask, dim=0).detach()
    priority = torch.cumsum(expert_mask, dim=0) * expert_mask - 1
    priority = torch.transpose(priority.reshape((topk, -1, num_experts)), 0, 1)
    priority = torch.max(priority, dim=1)[0]

    valid = torch.logical_and(priority >= 0, priority < capacity)
    priority = torch.masked_fill(priority, ~valid, 0)
    dispatch_mask = F.one_hot(priority, capacity).to(torch.bool)
    valid = valid.unsqueeze(-1).expand(-1, -1, capacity)
    dispatch_mask = torch.masked_fill(dispatch_mask, ~valid, 0)

    combine_weights = torch.einsum("...te,...tec->...tec", router_probs, dispatch_mask)
    capacity_rate = torch.sum(dispatch_mask) / (logits.shape[0] * topk)
    return [l_aux, capacity_rate], combine_weights, dispatch_mask, exp_counts


def top1gating(logits, random_routing_dropped_token=False):
    logits = logits.float()
    gates = F.softmax(logits, dim=1)
    capacity = gates.shape[0]

    first = torch.argmax(gates, dim=1)
    num_experts = int(gates.shape[1])
    mask1 = F.one_hot(first, num_classes=num_experts)
    exp_counts = torch.sum(mask1, dim=0).detach()

    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask1.float(), dim=0)
    l_aux = torch.sum(me * ce) * num_experts

    kept_idx = torch.topk(mask1.float(), k=capacity, dim=0)[1]
    kept_mask = mask1 * torch.zeros_like(mask1).scatter_(0, kept_idx, 1)
    mask1 = kept_mask
    mask1_kept = mask1
    if random_routing_dropped_token:
        room = capacity - kept_mask.sum(dim=0)
        room_sorted, room_order = torch.sort(room, descending=True)
        room_sorted = room_sorted.to(torch.int64)
        open_ids = torch.repeat_interleave(room_order, room_sorted)
        open_ids = open_ids[torch.randperm(open_ids.shape[0])]
        rerouted = torch.argmax(kept_mask, dim=1)
        dropped = (1 - kept_mask.sum(dim=1)).bool()
        drop_idx = dropped.nonzero().view(-1)
        drop_num = dropped.sum().to(torch.int64)
        rerouted.scatter_(0, drop_idx, open_ids[:drop_num])
        mask1 = F.one_hot(rerouted, num_classes=num_experts)

    locations1 = torch.cumsum(mask1, dim=0) - 1
    slot1 = torch.sum(locations1 * mask1, dim=1)
    gates = gates * mask1.float()
    slot1_sc = F.one_hot(slot1, num_classes=capacity).float()
    combine_weights = torch.einsum("se,sc->sec", gates, slot1_sc)
    dispatch_mask = combine_weights.bool()

    capacity_rate = torch.sum(mask1_kept) / (logits.shape[0])
    return [l_aux, capacity_rate], combine_weights, dispatch_mask, exp_counts


class HunYuanMLP(nn.Module):
    def __init__(self, config, layer_idx=None, is_shared_mlp=False):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        if is_shared_mlp:
            self.intermediate_size = config.intermediate_size * config.num_shared_expert
        else:
            self.intermediate_size = config.intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn = F.silu

    def forward(self, x):
        tp = self.config.pretraining_tp
        if tp > 1:
            width = self.intermediate_size // tp
            gate_w = self.gate_proj.weight.split(width, dim=0)
            up_w = self.up_proj.weight.split(width, dim=0)
            down_w = self.down_proj.weight.split(width, dim=1)
            gate = torch.cat([F.linear(x, gate_w[i]) for i in range(tp)], dim=-1)
            up = torch.cat([F.linear(x, up_w[i]) for i in range(tp)], dim=-1)
            inner = (self.act_fn(gate) * up).split(width, dim=2)
            return sum(F.linear(inner[i], down_w[i]) for i in range(tp))
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class HunYuanTopKGate(nn.Module):
    def __init__(self, config, layer_idx=None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.moe_topk = config.moe_topk
        self.drop_tokens = config.moe_drop_tokens
        self.min_capacity = 8
        self.random_routing_dropped_token = config.moe_random_routing_dropped_token
        self.wg = nn.Linear(config.hidden_size, config.num_experts, bias=False, dtype=torch.float32)

    def forward(self, hidden_states):
        bsz, seq_len, hidden_size = hidden_states.shape
        hidden_states = hidden_states.reshape(-1, hidden_size)
        if self.wg.weight.dtype == torch.float32:
            hidden_states = hidden_states.float()
        logits = self.wg(hidden_states)
        if self.moe_topk == 1:
            return top1gating(logits, random_routing_dropped_token=self.random_routing_dropped_token)
        return topkgating(logits, self.moe_topk)


class HunYuanMoE(nn.Module):
    def __init__(self, config=None, layer_idx=None):
        super().__init__()
        config = config or HunYuanConfig()
        self.config = config
        self.layer_idx = layer_idx
        self.moe_topk = config.moe_topk
        self.num_experts = config.num_experts
        if config.use_mixed_mlp_moe:
            self.shared_mlp = HunYuanMLP(config, layer_idx=layer_idx, is_shared_mlp=True)
        self.gate = HunYuanTopKGate(config, layer_idx=layer_idx)
        self.experts = nn.ModuleList(HunYuanMLP(config, layer_idx=layer_idx) for _ in range(config.num_experts))

    def forward(self, hidden_states):
        bsz, seq_len, hidden_size = hidden_states.shape
        if self.config.use_mixed_mlp_moe:
            shared_out = self.shared_mlp(hidden_states)

        l_moe, combine_weights, dispatch_mask, exp_counts = self.gate(hidden_states)
        flat = hidden_states.reshape(-1, hidden_size)
        dispatched = torch.einsum("sec,sm->ecm", dispatch_mask.type_as(hidden_states), flat)

        chunks = dispatched.chunk(self.num_experts, dim=0)
        outputs = []
        for chunk, expert in zip(chunks, self.experts, strict=False):
            outputs.append(expert(chunk))
        expert_output = torch.cat(outputs, dim=0)
        combined = torch.einsum("sec,ecm->sm", combine_weights.type_as(hidden_states), expert_output)
        combined = combined.reshape(bsz, seq_len, hidden_size)

        if self.config.use_mixed_mlp_moe:
            return shared_out + combined
        return combined


def build():
    return tiny(HunYuanMoE, HIDDEN)
