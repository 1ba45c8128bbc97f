"""SmallThinker's remote-code `SmallThinkerMoeBlock`: a router fed the layer's un-normalised input, top-k on raw
logits then sigmoid renormalised in place, ReGLU experts visited through a `.tolist()` of the hit experts.

Mirrors the `modeling_smallthinker.py` that PowerInfer shipped with PowerInfer/SmallThinker-4BA0.6B-Instruct for
`trust_remote_code=True` (SJTU-IPADS/PowerInfer on GitHub holds only the llama.cpp-based engine, no PyTorch
modeling file), as stored in the GitHub repository mettamind-ai/CUTE at commit 3b83392 (`smallthinker.py`, which
concatenates the checkpoint's `config.json`, `configuration_smallthinker.py` and `modeling_smallthinker.py`, each
under its hub URL): `SmallThinkerConfig.__init__` (MoE defaults), `SmallThinkerRMSNorm.forward`,
`SmallThinkerExpert.__init__` / `forward`, `SmallThinkerMoeBlock.__init__` / `forward`, and the MLP half of
`SmallThinkerDecoderLayer.forward`. This is not transformers' later `models/smallthinker` port.
The decoder layer keeps `router_input = hidden_states` from BEFORE its `input_layernorm` and attention, and calls
`block_sparse_moe(router_input, hidden_states)` with `hidden_states` after `post_attention_layernorm`: the router
and the experts read different tensors. `SmallThinkerMoeBlock.forward(router_input, hidden_states)` views both
[T, H], scores `router_input` with the bias-free `primary_router` Linear, takes `torch.topk` of the raw logits
(k = `moe_num_active_primary_experts`), then `if self.moe_primary_router_apply_softmax` (False by default) a
float32 softmax over the k logits, else `F.sigmoid` of them divided IN PLACE (`/=`) by their sum; the weights are
cast to the input dtype. It allocates `torch.zeros((T, H))`, one-hot encodes the choices and permutes to
[E, k, T], reads the experts that were hit to a Python list
(`(expert_mask.sum(dim=(-1, -2)) > 0).nonzero(as_tuple=True)[0].tolist()`), and for each: `torch.where` on its
mask, a tensor-index gather `hidden_states[top_x]`, the ReGLU expert (`up(x) * F.relu(gate(x))`, a
`.view(batch_size, -1)` from its own shape, then `down`), times `routing_weights[top_x, idx, None]`, and
`index_add_` into the buffer. It returns `(final_hidden_states reshaped to (B, S, H), router_logits)` where
`router_logits` are the top-k VALUES, not the full logits.
Left out: attention and rotary embedding (`SmallThinkerDecoderLayer` adds the attention output to the residual
before the MoE half; with it left out the post-attention stream is the layer input itself, so
`SmallThinkerDecoderMoE` routes on its input and runs the experts on `post_attention_layernorm` of it), the
`input_layernorm` (it only feeds attention), the residual add (the shell does it; the shell's pre-MoE LayerNorm
output plays the layer's input), the `PretrainedConfig` base (a plain local class with the hub defaults),
weight init (the shell draws weights), caches and sliding-window masks. Nothing of the MoE forward was left out.
Sizes: SmallThinker-4BA0.6B has hidden 1536, expert FFN 768, 32 experts, top-4 (21BA3B: 2560, 768, 64, top-6);
here hidden 16, expert FFN 16, 8 experts, top-4, one layer.
Constructs: a two-input MoE block (router on one tensor, experts on another), an RMSNorm with float32
round-trip between them, `topk` on raw logits before the activation, a config-valued softmax-vs-sigmoid branch,
in-place `/=` renormalisation, dtype cast, one-hot `permute(2, 1, 0)` mask, a `.nonzero(as_tuple=True)[0].tolist()`
host read of the hit experts driving the loop, `torch.where`, tensor-index gather, a ReGLU expert with a
shape-read `view`, in-place `index_add_`, a `(hidden, topk_logits)` tuple return unpacked by the caller.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("mettamind-ai/CUTE", "smallthinker.py", "3b83392a5b8c01dbe1140fc5e533dbdf3ffa0126",
                "SmallThinkerMoeBlock.forward")
HIDDEN, FFN, EXPERTS, TOP_K = 16, 16, 8, 4


class SmallThinkerConfig:
    """The MoE fields of the hub's `configuration_smallthinker.SmallThinkerConfig` (defaults as there, sizes tiny)."""

    def __init__(self, hidden_size=HIDDEN, rms_norm_eps=1e-6, moe_num_primary_experts=EXPERTS,
                 moe_ffn_hidden_size=FFN, moe_primary_router_apply_softmax=False,
                 moe_num_active_primary_experts=TOP_K):
        self.hidden_size = hidden_size
        self.rms_norm_eps = rms_norm_eps
        self.moe_num_primary_experts = moe_num_primary_experts
        self.moe_ffn_hidden_size = moe_ffn_hidden_size
        self.moe_primary_router_apply_softmax = moe_primary_router_apply_softmax
        self.moe_num_active_primary_experts = moe_num_active_primary_experts


class SmallThinkerRMSNorm(nn.Module):
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


class SmallThinkerExpert(nn.Module):
    def __init__(self, config: SmallThinkerConfig):
        super().__init__()
        self.hidden_dim = config.hidden_size
        self.ffn_dim = config.moe_ffn_hidden_size

        self.up = nn.Linear(self.hidden_dim, self.ffn_dim, bias=False)
        self.gate = nn.Linear(self.hidden_dim, self.ffn_dim, bias=False)
        self.down = nn.Linear(self.ffn_dim, self.hidden_dim, bias=False)

    def forward(self, hidden_states: torch.Tensor):
        current_hidden_states = self.up(hidden_states) * F.relu(self.gate(hidden_states))
        batch_size, _ = current_hidden_states.shape
        current_hidden_states = current_hidden_states.view(batch_size, -1)
        current_hidden_states = self.down(current_hidden_states)
        return current_hidden_states


class SmallThinkerMoeBlock(nn.Module):
    def __init__(self, config: SmallThinkerConfig):
        super().__init__()
        self.hidden_dim = config.hidden_size
        self.num_primary_experts = config.moe_num_primary_experts
        self.moe_primary_router_apply_softmax = config.moe_primary_router_apply_softmax
        self.num_active_primary_experts = config.moe_num_active_primary_experts
        self.primary_router = nn.Linear(self.hidden_dim, self.num_primary_experts, bias=False)
        self.experts = nn.ModuleList([SmallThinkerExpert(config) for _ in range(self.num_primary_experts)])

    def forward(self, router_input: torch.Tensor, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        # flatten the tokens: (bs * sl, hidden_dim)
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_input = router_input.view(-1, hidden_dim)
        # primary router logits: (bs * sl, n_experts)
        router_logits = self.primary_router(router_input)

        router_logits, selected_experts = torch.topk(router_logits, self.num_active_primary_experts, dim=-1)

        if self.moe_primary_router_apply_softmax:
            routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        else:
            routing_weights = F.sigmoid(router_logits)
            routing_weights /= routing_weights.sum(dim=-1, keepdim=True)

        routing_weights = routing_weights.to(hidden_states.dtype)

        final_hidden_states = torch.zeros(
            (batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype, device=hidden_states.device
        )

        # [E, k, T] mask of which token picked which expert in which slot
        expert_mask = torch.nn.functional.one_hot(selected_experts, num_classes=self.num_primary_experts).permute(2, 1, 0)
        expert_hitted = (expert_mask.sum(dim=(-1, -2)) > 0).nonzero(as_tuple=True)[0].tolist()

        for expert_idx in expert_hitted:
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx])
            # gather this expert's tokens and weight its output by their routing weights
            current_state = hidden_states[top_x].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx, None]

            # index_add_ needs a tensor index
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        final_hidden_states = final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)
        return final_hidden_states, router_logits


class SmallThinkerDecoderMoE(nn.Module):
    """The MLP half of `SmallThinkerDecoderLayer.forward`, attention left out: the router reads the layer's input
    (`router_input`), the experts read `post_attention_layernorm` of it; the shell adds the residual."""

    def __init__(self, config: SmallThinkerConfig):
        super().__init__()
        self.block_sparse_moe = SmallThinkerMoeBlock(config)
        self.post_attention_layernorm = SmallThinkerRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states):
        router_input = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states, router_logits = self.block_sparse_moe(router_input, hidden_states)
        return hidden_states


def build():
    return tiny(lambda: SmallThinkerDecoderMoE(SmallThinkerConfig()), HIDDEN)
