"""Snowflake Arctic's `ArcticMoE`: a bincount-and-split expert loop, with the aux loss computed inline.

Mirrors Snowflake-Labs/transformers `src/transformers/models/arctic/modeling_arctic.py` at commit 03ecf80
(`ArcticMoE.forward`, `ArcticMoE._moe_foreward`, `ArcticMLP`, `load_balancing_loss_func`), the Arctic
modeling code Snowflake published with the model (the hub's `modeling_arctic.py`). A layer is an MoE
layer when (layer_id + 1) % moe_layer_frequency == 0, else a dense `ArcticMLP`; the forward branches on
that flag. The local MoE path flattens tokens, scores them with a bias-free linear gate, softmaxes in
float32, takes the top-k and, when k > 1, renormalises the k weights in place. It then matches experts to
(token, slot) pairs in one go, `expert_idx, token_idx, topk_idx = torch.where(chosen == arange(E)[:, None,
None])` (sorted by expert), reads the per-expert counts to the host with
`torch.bincount(expert_idx, minlength=E).tolist()`, `split`s the token and slot indices by those counts
and loops `for expert, top_x, idx in zip(experts, token_idx, topk_idx)`, skipping empty chunks, reading
both chunks to Python lists with `.tolist()`, gathering rows with them and `index_add_`ing the weighted
SwiGLU output (w1 gate, w3 up, w2 down). It returns (output, load-balancing loss), the loss recomputed
from the router logits on every call (softmax, top-k, one-hot, mean tokens-per-expert times mean
probability, times E). Left out: the DeepSpeed MoE path (`use_deepspeed_moe_implementation`, a capacity
MoE the catalog already mirrors) and DeepSpeed's optimised/quantised/LoRA linears (plain nn.Linear, in
float32 instead of the original's bfloat16), the loss's attention-mask branch (the layer never passes a
mask), and the decoder's parallel residual MLP, which runs beside the MoE outside this module.
Constructs: `torch.where` on a broadcast equality, `bincount(...).tolist()` counts, `split` by those
counts, loop over zip(experts, chunks), `if top_x.shape[0] == 0: continue`, `.tolist()` gathers,
`index_add_`, in-place renormalisation under `if self.top_k > 1`, `isinstance` checks in the loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("Snowflake-Labs/transformers", "src/transformers/models/arctic/modeling_arctic.py",
                "03ecf80f350c37bc11c7b5cf0bd6017dd1509bfd", "ArcticMoE._moe_foreward")
HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 8, 2
MOE_LAYER_FREQUENCY, LAYER_ID = 1, 0


def load_balancing_loss_func(gate_logits, num_experts=None, top_k=4):
    if gate_logits is None or not isinstance(gate_logits, tuple):
        return 0
    if isinstance(gate_logits, tuple):
        device = gate_logits[0].device
        logits = torch.cat([g.to(device) for g in gate_logits], dim=0)
    probs = F.softmax(logits, dim=-1)
    _, chosen = torch.topk(probs, top_k, dim=-1)
    mask = F.one_hot(chosen, num_experts)
    tokens_per_expert = torch.mean(mask.float(), dim=0)
    prob_per_expert = torch.mean(probs, dim=0)
    return torch.sum(tokens_per_expert * prob_per_expert.unsqueeze(0)) * num_experts


class ArcticMLP(nn.Module):
    def __init__(self, is_residual_mlp: bool = False):
        super().__init__()
        self.hidden_dim = HIDDEN
        self.ffn_dim = INTER if not is_residual_mlp else HIDDEN
        self.w1 = nn.Linear(self.hidden_dim, self.ffn_dim, bias=False)
        self.w2 = nn.Linear(self.ffn_dim, self.hidden_dim, bias=False)
        self.w3 = nn.Linear(self.hidden_dim, self.ffn_dim, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.w2(self.act_fn(self.w1(x)) * self.w3(x))


class ArcticMoE(nn.Module):
    def __init__(self, layer_id: int = LAYER_ID):
        super().__init__()
        self.hidden_dim = HIDDEN
        self.num_experts = EXPERTS
        self.layer_id = layer_id
        self.top_k = TOP_K
        self.is_moe_layer = (layer_id + 1) % MOE_LAYER_FREQUENCY == 0
        if not self.is_moe_layer:
            self.mlp = ArcticMLP()
        else:
            self.gate = nn.Linear(self.hidden_dim, self.num_experts, bias=False)
            self.experts = nn.ModuleList(ArcticMLP() for _ in range(self.num_experts))

    def _moe_foreward(self, hidden_states):
        batch, seq, hidden = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden)
        router_logits = self.gate(hidden_states)

        weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        weights, chosen = torch.topk(weights, self.top_k, dim=-1)
        if self.top_k > 1:
            weights /= weights.sum(dim=-1, keepdim=True)

        out = torch.zeros((batch * seq, hidden), dtype=hidden_states.dtype, device=hidden_states.device)

        every_expert = torch.arange(self.num_experts, device=chosen.device).view((self.num_experts, 1, 1))
        expert_idx, token_idx, slot_idx = torch.where(chosen == every_expert)
        counts = torch.bincount(expert_idx, minlength=self.num_experts).tolist()
        token_idx = token_idx.split(counts)
        slot_idx = slot_idx.split(counts)

        for expert, rows, slots in zip(self.experts, token_idx, slot_idx):  # noqa: B905 - as the original
            if rows.shape[0] == 0:
                continue
            rows_list = rows.tolist()
            slots_list = slots.tolist()
            picked = hidden_states[None, rows_list].reshape(-1, hidden)
            y = expert(picked) * weights[rows_list, slots_list, None]
            out.index_add_(0, rows, y.to(hidden_states.dtype))
        out = out.reshape(batch, seq, hidden)
        return out, load_balancing_loss_func((router_logits,), self.num_experts, self.top_k)

    def forward(self, hidden_states):
        if self.is_moe_layer:
            return self._moe_foreward(hidden_states)
        return self.mlp(hidden_states), torch.tensor(0.0, device=hidden_states.device,
                                                     dtype=hidden_states.dtype)


def build():
    return tiny(ArcticMoE, HIDDEN)
