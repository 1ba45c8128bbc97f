"""Yuan2.0-M32's YuanMoeLayer: an attention router (q/k/v over the experts) feeding a Mixtral-style mask loop.

Mirrors IEIT-Yuan/Yuan2.0-M32 `3rd_party/AutoGPTQ/auto_gptq/modeling/yuan_moe_hf_model.py` at commit b403a2b
(`ParallelAttention_router`, `YuanMoeLayer`, `YuanExpertMLP`), the Hugging Face-style modeling file of the
MoE model in that repository (`megatron/model/yuan_hf_model.py` there is the dense Yuan2 and has no MoE).
The router projects the [B, S, H] input with three bias-free Linears to E values each (query, key, value),
upcasts them to float32 and views each as [B, S, E, 1]; `q @ k^T` gives an [B, S, E, E] score matrix per
token, softmaxed over the last dim and multiplied with v, and the [B, S, E, 1] result is viewed as the
[B*S, E] router logits. The layer flattens the tokens, takes a float32 softmax of the logits and its top-k,
renormalises the top-k weights only `if self.norm_topk_prob` (False in the shipped config, as vLLM's port
passes `renormalize=False`), casts them to the input dtype, builds an [E, k, T] one-hot mask and loops over
all experts: `torch.where(mask[e])` gives (slot, token) ids, an expert with no tokens is skipped, the ids are
turned into Python lists with `.tolist()` to gather the tokens (`x[None, tokens]`) and their weights
(`w[tokens, slots, None]`), and the weighted expert output, cast to the input dtype, is `index_add_`-ed into a
zero buffer. Each expert is a gated-linear-unit MLP: one Linear to 2*F, `torch.chunk` into two halves,
silu(first) * second, then the down Linear. The layer returns (output, router_logits).
Left out: the router's unused keyword arguments (attention mask, position ids, inference params, ...) and its
dead locals and attributes (`is_first_step`, `layer_number`, `flash_attn_drop`); the `ACT2FN[hidden_act]`
lookup is the config's "silu"; the non-gated expert branch is kept behind the `gated_linear_unit` flag (True,
the model is trained with --swiglu). The Megatron training path (tensor/expert parallel router and grouped
GEMM) is not this file; the HF file is already the one-process form. The real model has hidden 2048, 32
experts, top-2, F = 8192.
Constructs: the attention router (three projections, float32 upcast, per-token [E, E] softmax attention),
config `if` branches (norm_topk_prob, gated_linear_unit), loop `for expert_idx in range(E)` with an
empty-expert `continue`, `torch.where(mask)` ids, `.tolist()` list indices, `torch.chunk`, `index_add_`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source(
    "IEIT-Yuan/Yuan2.0-M32",
    "3rd_party/AutoGPTQ/auto_gptq/modeling/yuan_moe_hf_model.py",
    "b403a2beb2746c0c923b4eb936fe1e2560c83b19",
    "YuanMoeLayer.forward",
)
HIDDEN, FFN, EXPERTS, TOP_K = 16, 8, 8, 2


class ParallelAttentionRouter(nn.Module):
    def __init__(self, hidden_size=HIDDEN, num_experts=EXPERTS):
        super().__init__()
        self.hidden_size, self.projection_size = hidden_size, num_experts
        self.query = nn.Linear(hidden_size, num_experts, bias=False)
        self.key = nn.Linear(hidden_size, num_experts, bias=False)
        self.value = nn.Linear(hidden_size, num_experts, bias=False)

    def forward(self, hidden_states):
        q = self.query(hidden_states)
        k = self.key(hidden_states)
        v = self.value(hidden_states)
        b, s, z = q.size(0), q.size(1), q.size(2)

        q = q.float().view(b, s, z, 1)
        k = k.float().view(b, s, z, 1)
        v = v.float().view(b, s, z, 1)

        scores = torch.matmul(q, k.transpose(2, 3))
        scores = nn.functional.softmax(scores, dim=-1)
        mixed = torch.matmul(scores, v)
        return mixed.view(b * s, z)


class YuanExpertMLP(nn.Module):
    def __init__(self, hidden_size=HIDDEN, ffn_hidden_size=FFN, gated_linear_unit=True):
        super().__init__()
        self.gated_linear_unit, self.ffn_hidden_size = gated_linear_unit, ffn_hidden_size
        width = ffn_hidden_size * 2 if gated_linear_unit else ffn_hidden_size
        self.w1 = nn.Linear(hidden_size, width, bias=False)
        self.act_fn = F.silu
        self.w2 = nn.Linear(ffn_hidden_size, hidden_size, bias=False)

    def forward(self, x):
        x = self.w1(x)
        if self.gated_linear_unit:
            halves = torch.chunk(x, 2, dim=-1)
            x = self.act_fn(halves[0]) * halves[1]
        else:
            x = self.act_fn(x)
        return self.w2(x)


class YuanMoeLayer(nn.Module):
    def __init__(self, hidden_size=HIDDEN, num_experts=EXPERTS, top_k=TOP_K, norm_topk_prob=False):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.hidden_size = hidden_size
        self.gate = ParallelAttentionRouter(hidden_size, num_experts)
        self.experts = nn.ModuleList(YuanExpertMLP(hidden_size) for _ in range(num_experts))

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        router_logits = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, h)

        weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        weights, chosen = torch.topk(weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        weights = weights.to(hidden_states.dtype)

        out = torch.zeros((b * s, h), dtype=hidden_states.dtype, device=hidden_states.device)
        mask = torch.nn.functional.one_hot(chosen, num_classes=self.num_experts).permute(2, 1, 0)

        for expert_idx in range(self.num_experts):
            expert = self.experts[expert_idx]
            slot, top_x = torch.where(mask[expert_idx])
            if top_x.shape[0] == 0:
                continue
            tokens, slots = top_x.tolist(), slot.tolist()
            picked = hidden_states[None, tokens].reshape(-1, h)
            y = expert(picked) * weights[tokens, slots, None]
            out.index_add_(0, top_x, y.to(hidden_states.dtype))

        out = out.reshape(b, s, h)
        return out, router_logits


def build():
    return tiny(YuanMoeLayer, HIDDEN)
