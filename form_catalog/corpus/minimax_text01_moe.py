"""MiniMax-Text-01 / M1 remote code: a Mixtral-style expert loop inside a post-norm, alpha-scaled residual.

Mirrors zzp1012/nanoGPT `modeling_minimax_text_01.py` at commit 07c618b (the first version in that repository
of MiniMax-Text-01's Hugging Face remote code: `MiniMaxText01SparseMoeBlock.forward`,
`MiniMaxText01BlockSparseTop2MLP`, `MiniMaxText01MLP`, `MiniMaxText01RMSNorm` and the feed-forward half of
`MiniMaxText01DecoderLayer.forward`). Cross-checked against Mind-Vault-AI/MiniMax-M1 `modeling_minimax_m1.py`
at commit 4917af1 (a fork of MiniMax-AI/MiniMax-M1, whose upstream commit added the model files): the two
files are identical once `MiniMaxM1` is renamed `MiniMaxText01`. The M1 `config.json` there gives the
settings used below.
The block: `if self.training and self.jitter_noise > 0` multiplies the input in place by uniform noise;
tokens are viewed [T, H]; a bias-free gate gives `router_logits`; softmax over experts in float32, top-k,
the k weights renormalised in place (`/=` their sum) and cast back to the input dtype; a zero [T, H]
buffer; `one_hot(selected, E).permute(2, 1, 0)` gives an [E, k, T] mask; then for EVERY expert
`idx, top_x = torch.where(mask[e])` (no skip of empty experts), `hidden_states[None, top_x].reshape(-1, H)`,
`expert(rows) * routing_weights[top_x, idx, None]` and `index_add_` into the buffer; it returns
(output viewed [B, S, H], router_logits). Experts are `w2(act(w1(x)) * w3(x))` (w1 gate, w3 up, w2 DOWN;
act = silu from ACT2FN). The decoder layer's feed-forward half, mirrored as `MiniMaxText01FFNHalf` because
that is how the block is called: `residual = x`, `x = post_attention_layernorm(x)` (an RMSNorm computed in
float32), `if self.postnorm: residual = x` (so the residual is the NORMED input), unpack
`moe_out, router_logits = block(x)`; `if self.shared_moe` a dense `MiniMaxText01MLP` (gate/up/down, width
`intermediate_size`) is blended in with a sigmoid coefficient from a bias-free Linear(H, 1) computed in
float32, `moe_out * (1 - coef) + shared * coef`, else the MoE output is used as is; the result is
`residual * layernorm_mlp_alpha + out * layernorm_mlp_beta`. Settings are the released config's:
postnorm true, alpha 3.5565588200778455, beta 1.0, shared_intermediate_size 0 (so `shared_moe` is False
and the blend branch is built but not taken), router_jitter_noise 0.0; real sizes 32 experts, top-2,
hidden 6144, intermediate 9216. Tiny: 8 experts, top-2, hidden 16, intermediate 8. The corpus shell's
own LayerNorm and residual sit around this half (as the attention half would in the real layer).
Left out: the attention half of the decoder layer (lightning / softmax attention), the caller's
`output_router_logits` collection and aux loss (the router logits are returned and dropped, as in eval).
Constructs: `if self.training and jitter > 0` with an in-place `*=`, float32 softmax + top-k + in-place
`/=` renormalisation, `one_hot(...).permute(2, 1, 0)` mask, a loop over `range(num_experts)` with
`torch.where(mask[e])` and no empty-expert skip, `x[None, top_x]` gather, `index_add_`, a tuple return
unpacked by the caller, a config-flag postnorm residual taken from the normed input, alpha/beta-scaled
residual sum, an untaken sigmoid-coefficient shared-MLP blend branch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("zzp1012/nanoGPT", "modeling_minimax_text_01.py", "07c618bc46a8cb07934ee3b1559b34e6bd050fd7",
                "MiniMaxText01SparseMoeBlock.forward")
HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 8, 2
RMS_EPS, JITTER = 1e-5, 0.0
POSTNORM, MLP_ALPHA, MLP_BETA, SHARED_INTERMEDIATE = True, 3.5565588200778455, 1.0, 0


class MiniMaxText01RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class MiniMaxText01MLP(nn.Module):
    """The dense shared MLP (only built when shared_intermediate_size > 0); width is `intermediate_size`."""

    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.up_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.down_proj = nn.Linear(INTER, HIDDEN, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class MiniMaxText01BlockSparseTop2MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.ffn_dim, self.hidden_dim = INTER, HIDDEN
        self.w1 = nn.Linear(HIDDEN, INTER, bias=False)
        self.w2 = nn.Linear(INTER, HIDDEN, bias=False)
        self.w3 = nn.Linear(HIDDEN, INTER, bias=False)
        self.act_fn = nn.SiLU()  # ACT2FN["silu"]

    def forward(self, hidden_states):
        h = self.act_fn(self.w1(hidden_states)) * self.w3(hidden_states)
        return self.w2(h)


class MiniMaxText01SparseMoeBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden_dim, self.ffn_dim = HIDDEN, INTER
        self.num_experts, self.top_k = EXPERTS, TOP_K
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = nn.ModuleList(MiniMaxText01BlockSparseTop2MLP() for _ in range(EXPERTS))
        self.jitter_noise = JITTER

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        if self.training and self.jitter_noise > 0:
            hidden_states *= torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise,
                                                                      1.0 + self.jitter_noise)
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)  # [T, E]

        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)

        final_hidden_states = torch.zeros((batch_size * sequence_length, hidden_dim),
                                          dtype=hidden_states.dtype, device=hidden_states.device)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)  # [E, k, T]

        for expert_idx in range(self.num_experts):
            expert_layer = self.experts[expert_idx]
            slot, token = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[None, token].reshape(-1, hidden_dim)
            current_out = expert_layer(current_state) * routing_weights[token, slot, None]
            final_hidden_states.index_add_(0, token, current_out.to(hidden_states.dtype))
        final_hidden_states = final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)
        return final_hidden_states, router_logits


class MiniMaxText01FFNHalf(nn.Module):
    """The feed-forward half of `MiniMaxText01DecoderLayer.forward`, which is what calls the block."""

    def __init__(self):
        super().__init__()
        self.hidden_size = HIDDEN
        self.block_sparse_moe = MiniMaxText01SparseMoeBlock()
        self.post_attention_layernorm = MiniMaxText01RMSNorm(HIDDEN, eps=RMS_EPS)
        self.postnorm = POSTNORM
        self.layernorm_mlp_alpha = MLP_ALPHA
        self.layernorm_mlp_beta = MLP_BETA
        self.shared_moe = False
        if SHARED_INTERMEDIATE > 0:
            self.shared_moe = True
            self.shared_mlp = MiniMaxText01MLP()
            self.coefficient = nn.Linear(self.hidden_size, 1, bias=False)

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        if self.postnorm:
            residual = hidden_states

        moe_hidden_states, router_logits = self.block_sparse_moe(hidden_states)
        if self.shared_moe:
            output_mlp = self.shared_mlp(hidden_states)
            coef = hidden_states.to(torch.float32) @ self.coefficient.weight.float().T
            coef = torch.sigmoid(coef).to(hidden_states.dtype)
            hidden_states = moe_hidden_states * (1 - coef) + output_mlp * coef
        else:
            hidden_states = moe_hidden_states

        return residual * self.layernorm_mlp_alpha + hidden_states * self.layernorm_mlp_beta


def build():
    return tiny(MiniMaxText01FFNHalf, HIDDEN)
