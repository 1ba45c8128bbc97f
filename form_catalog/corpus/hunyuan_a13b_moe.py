"""Hunyuan-A13B's `HunYuanMoE`: shared MLP plus capacity-limited top-k routing with einsum dispatch.

Mirrors Tencent-Hunyuan/Hunyuan-A13B `models/modeling_hunyuan.py` at commit 2798f3c (`HunYuanMoE.forward`,
`HunYuanTopKGate.forward`, `topkgating`, `top1gating`, `HunYuanMLP`; the remote-code entry point
`models/hunyuan.py` imports its decoder layer from this file). The code descends from Hunyuan-Large's
(corpus entry hunyuan_large_moe) but the released config runs a different path through it: `moe_topk` and
`num_shared_expert` are per-layer lists ([8] * 32 and [1] * 32), so the gate's `self.moe_topk == 1` test
compares a list with an int and is always false, and `topkgating(logits, self.moe_topk[0])` runs; the
shared MLP's width is `intermediate_size * num_shared_expert[0]`. The layer runs the shared SwiGLU MLP on
the input, then the gate: a float32 bias-free linear router on the flattened, upcast tokens, a softmax, an
expert capacity of `max(topk, topk * S // E)` (Hunyuan-Large used topk * S, so nothing was dropped; here
the capacity equals the mean load and overflowing tokens are dropped), `topk`, an auxiliary loss from the
one-hot mask, the full softmax divided by the sum of the chosen probabilities (clamped at float32 eps), the
rank-major one-hot of the expert ids as int32, per-expert counts, priorities from `cumsum(mask) * mask - 1`
reshaped to [k, S, E], transposed and maxed over ranks, a validity mask `0 <= priority < capacity` used
to zero invalid priorities and to blank their one-hot slots, combine weights einsum('...te,...tec->...tec')
of the probabilities with the boolean [S, E, C] dispatch mask, and a capacity-rate statistic. The layer
dispatches with einsum('sec,sm->ecm'), `chunk`s it into one [1, C, M] slice per expert, loops
`for chunk, expert in zip(chunks, self.experts)` over SwiGLU MLPs, concatenates, combines with
einsum('sec,ecm->sm'), reshapes to [B, S, M] and adds the shared output. `top1gating` (argmax, capacity S,
an integer `topk` over the one-hot mask, optional random re-routing of dropped tokens) is kept but not
taken. Experts are SwiGLU MLPs (`ACT2FN["silu"]`, here `F.silu`) of `intermediate_size` width.
Left out: the `transformers` `PretrainedConfig` base (a local class holds the MoE fields, lists included),
the per-layer `moe_intermediate_size` list (unread by this code), the aux-loss and capacity-rate values,
which the layer computes and discards, and the rest of the model. The real model has 64 experts, top-8,
one shared expert; here 8 experts, top-2 (capacity max(2, 2 * 7 // 8) = 2 for the 7 corpus tokens).
Constructs: a list-versus-int `moe_topk == 1` branch selecting the gating function and `moe_topk[0]`
indexing, a `pretraining_tp > 1` branch in the MLP, a capacity computed from shapes with Python `max` and
`//`, rank-priority `cumsum` token dropping with `masked_fill` and `logical_and`, an unused
`random_routing_dropped_token` branch (`sort`, `repeat_interleave`, `randperm`, `nonzero`, `scatter_`),
dense dispatch/combine einsums, a `chunk` + `for chunk, expert in zip(...)` expert loop and `torch.cat`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("Tencent-Hunyuan/Hunyuan-A13B", "models/modeling_hunyuan.py",
                "2798f3c8b6a69e0ce93950b0d2417203cf950fa0", "HunYuanMoE.forward")
HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 8, 2


class HunYuanConfig:
    hidden_size = HIDDEN
    intermediate_size = INTER
    num_experts = EXPERTS
    moe_topk = [TOP_K]
    num_shared_expert = [1]
    use_mixed_mlp_moe = True
    moe_drop_tokens = False
    moe_random_routing_dropped_token = False
    hidden_act = "silu"
    pretraining_tp = 1


def topkgating(logits, topk):
    logits = logits.float()
    gates = F.softmax(logits, dim=1)
    capacity = max(topk, topk * gates.shape[0] // gates.shape[1])
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

    expert_index = torch.transpose(expert_index, 0, 1)
    expert_index = expert_index.reshape(-1)
    expert_mask = F.one_hot(expert_index, num_experts).to(torch.int32)
    exp_counts = torch.sum(expert_mask, dim=0).detach()

    priority = torch.cumsum(expert_mask, dim=0) * expert_mask - 1
    priority = priority.reshape((topk, -1, num_experts))
    priority = torch.transpose(priority, 0, 1)
    priority = torch.max(priority, dim=1)[0]

    valid = torch.logical_and(priority >= 0, priority < capacity)
    priority = torch.masked_fill(priority, ~valid, 0)
    dispatch_mask = F.one_hot(priority, capacity).to(torch.bool)
    valid = valid.unsqueeze(-1).expand(-1, -1, capacity)
    dispatch_mask = torch.masked_fill(dispatch_mask, ~valid, 0)

    combine_weights = torch.einsum("...te,...tec->...tec", router_probs, dispatch_mask)
    kept = torch.sum(dispatch_mask)
    capacity_rate = kept / (logits.shape[0] * topk)
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
    mask1_in = mask1

    kept_idx = torch.topk(mask1_in, k=capacity, dim=0)[1]
    kept_mask = mask1 * torch.zeros_like(mask1).scatter_(0, kept_idx, 1)
    mask1 = kept_mask
    mask1_kept = mask1
    if random_routing_dropped_token:
        room = capacity - kept_mask.sum(dim=0)
        room_sorted, room_order = torch.sort(room, descending=True)
        room_sorted = room_sorted.to(torch.int64)
        open_ids = torch.repeat_interleave(room_order, room_sorted)
        shuffle = torch.randperm(open_ids.shape[0])
        open_ids = open_ids[shuffle]
        rerouted = torch.argmax(kept_mask, dim=1)
        dropped = 1 - kept_mask.sum(dim=1)
        dropped = dropped.bool()
        drop_idx = dropped.nonzero().view(-1)
        drop_num = dropped.sum().to(torch.int64)
        rerouted.scatter_(0, drop_idx, open_ids[:drop_num])
        mask1 = F.one_hot(rerouted, num_classes=num_experts)

    locations1 = torch.cumsum(mask1, dim=0) - 1
    slot1 = torch.sum(locations1 * mask1, dim=1)
    mask1_float = mask1.float()
    gates = gates * mask1_float

    slot1_sc = F.one_hot(slot1, num_classes=capacity).float()
    combine_weights = torch.einsum("se,sc->sec", gates, slot1_sc)
    dispatch_mask = combine_weights.bool()

    kept = torch.sum(mask1_kept)
    capacity_rate = kept / (logits.shape[0])
    return [l_aux, capacity_rate], combine_weights, dispatch_mask, exp_counts


class HunYuanMLP(nn.Module):
    def __init__(self, config, layer_idx=None, is_shared_mlp=False):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        if is_shared_mlp:
            self.intermediate_size = config.intermediate_size * config.num_shared_expert[0]
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
            down = [F.linear(inner[i], down_w[i]) for i in range(tp)]
            down = sum(down)
        else:
            down = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down


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
            out = top1gating(logits, random_routing_dropped_token=self.random_routing_dropped_token)
        else:
            out = topkgating(logits, self.moe_topk[0])
        return out


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
        self.experts = nn.ModuleList(
            [HunYuanMLP(config, layer_idx=layer_idx, is_shared_mlp=False) for _ in range(config.num_experts)]
        )

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
            output = shared_out + combined
        else:
            output = combined
        return output


def build():
    return tiny(HunYuanMoE, HIDDEN)
