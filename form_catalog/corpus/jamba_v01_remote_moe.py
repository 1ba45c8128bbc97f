"""Jamba-v0.1's original remote-code `JambaSparseMoeBlock`: softmax top-2 without renormalisation, a loop over
experts with `torch.where`, `.tolist()` list indexing and `index_add_`, and a dense one-expert branch.

Mirrors the `modeling_jamba.py` that AI21 Labs shipped with the ai21labs/Jamba-v0.1 checkpoint for
`trust_remote_code=True` (before the model was taken into transformers), as stored verbatim in the GitHub
repository Mocuto/mamba-chat at commit 99a9717 (`modeling_jamba.py`: `JambaMLP.__init__` / `forward`,
`JambaSparseMoeBlock.__init__` / `forward`, the per-layer expert schedule of `JambaModel.__init__` and the MoE
half of `JambaMambaDecoderLayer.forward` / `JambaAttentionDecoderLayer.forward`), with `configuration_jamba.py`
at the same commit for the defaults (16 experts, `num_experts_per_tok` 2, `expert_layer_period` 2,
`expert_layer_offset` 1, `hidden_act` "silu"). The remote code differs from transformers' later `models/jamba`
port: the block takes `num_experts` / `num_experts_per_tok` as constructor arguments decided per layer, builds
no router when `num_experts == 1`, and routes that case through a dense branch.
`JambaModel.__init__` decides for each layer `i` whether it has experts
(`(i - expert_layer_offset) % expert_layer_period == 0`); a layer without gets `num_experts = 1`, and the decoder
layer then passes `num_experts_per_tok = config.num_experts_per_tok if num_experts > 1 else 1`. `JambaLayerSchedule`
reproduces that schedule for the shell, which calls its factory once per layer in order: `build` uses two
layers, so layer 0 is the dense one-expert block and layer 1 the 8-expert MoE, as in Jamba's alternation.
`forward(hidden_states)` reads (batch, seq, hidden); `if self.num_experts == 1` it runs `experts[0]` on the
3-D input and returns it with `router_logits = torch.ones((B * S, 1), ..., requires_grad=hidden_states.requires_grad)`.
Otherwise it views the tokens [T, H], scores them with the bias-free `router` Linear, takes a float32 softmax
and `torch.topk(..., top_k)` (the k weights are NOT renormalised, unlike Mixtral), casts the weights back to the
input dtype, allocates `torch.zeros((T, H))`, one-hot encodes the choices and permutes to [E, k, T], and loops
`for expert_idx in range(self.num_experts)`: `idx, top_x = torch.where(expert_mask[expert_idx])`,
`if top_x.shape[0] == 0: continue`, both index tensors read to Python lists with `.tolist()` ("faster to index
using lists"), `hidden_states[None, top_x_list].reshape(-1, H)`, the expert's SwiGLU
(`down(act(gate(x)) * up(x))`, bias-free, `ACT2FN["silu"]`) times `routing_weights[top_x_list, idx_list, None]`,
and `final_hidden_states.index_add_(0, top_x, out.to(dtype))`. It reshapes to (B, S, H) and returns
`(final_hidden_states, router_logits)`; the decoder layer unpacks the tuple and adds the residual (the shell
does: it takes element 0 of the tuple).
Left out: the Mamba mixer and attention halves of the decoder layers, `JambaRMSNorm` (the shell supplies the
pre-MoE norm and the residual), `load_balancing_loss_func` (applied by `JambaForCausalLM` to collected router
logits, only with `output_router_logits`), the `PretrainedConfig` base (a plain local class), `ACT2FN` (its
"silu" entry is `nn.SiLU`), weight init (the shell draws weights), caches.
Sizes: Jamba-v0.1 has hidden 4096, intermediate 14336, 16 experts, top-2, MoE every other layer; here hidden 16,
intermediate 32, 8 experts, top-2, two layers (dense, then MoE).
Constructs: a constructor-time `if num_experts > 1` choosing whether a router exists, a config-valued
`if self.num_experts == 1` branch in forward returning a `torch.ones(..., requires_grad=...)` tensor, a
stateful per-layer factory (the layer schedule), float32 softmax + `topk` with no renormalisation, dtype
round-trips, one-hot `permute(2, 1, 0)` mask, a `range(E)` loop with `torch.where`, `if n == 0: continue`,
`.tolist()` host reads used as list indices for a `[None, list]` gather and a two-list advanced index, in-place
`index_add_` with the tensor index, a `(hidden, router_logits)` tuple return.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("Mocuto/mamba-chat", "modeling_jamba.py",
                "99a9717b6d5cbdf27b9a28c5177384ac88af3718", "JambaSparseMoeBlock.forward")
HIDDEN, INTER, EXPERTS, TOP_K, LAYERS = 16, 32, 8, 2, 2


class JambaConfig:
    """The MoE fields of `configuration_jamba.JambaConfig` (defaults as there, sizes tiny)."""

    def __init__(self, hidden_size=HIDDEN, intermediate_size=INTER, hidden_act="silu", num_experts_per_tok=TOP_K,
                 num_experts=EXPERTS, expert_layer_period=2, expert_layer_offset=1):
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.num_experts_per_tok = num_experts_per_tok
        self.num_experts = num_experts
        self.expert_layer_period = expert_layer_period
        self.expert_layer_offset = expert_layer_offset


ACT2FN = {"silu": nn.SiLU}


class JambaMLP(nn.Module):
    def __init__(self, config: JambaConfig):
        super().__init__()
        self.ffn_dim = config.intermediate_size
        self.hidden_dim = config.hidden_size

        self.gate_proj = nn.Linear(self.hidden_dim, self.ffn_dim, bias=False)
        self.down_proj = nn.Linear(self.ffn_dim, self.hidden_dim, bias=False)
        self.up_proj = nn.Linear(self.hidden_dim, self.ffn_dim, bias=False)

        self.act_fn = ACT2FN[config.hidden_act]()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class JambaSparseMoeBlock(nn.Module):
    def __init__(self, config: JambaConfig, num_experts: int, num_experts_per_tok: int):
        super().__init__()
        self.hidden_dim = config.hidden_size
        self.ffn_dim = config.intermediate_size

        # decided per layer by the model
        self.num_experts = num_experts
        self.top_k = num_experts_per_tok

        if num_experts > 1:
            self.router = nn.Linear(self.hidden_dim, self.num_experts, bias=False)
        else:
            self.router = None

        self.experts = nn.ModuleList([JambaMLP(config) for _ in range(self.num_experts)])

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch_size, sequence_length, hidden_dim = hidden_states.shape

        if self.num_experts == 1:
            # a plain MLP layer: no routing
            final_hidden_states = self.experts[0](hidden_states)
            router_logits = torch.ones(
                (batch_size * sequence_length, 1),
                device=hidden_states.device,
                dtype=hidden_states.dtype,
                requires_grad=hidden_states.requires_grad,
            )
            return final_hidden_states, router_logits

        # several experts: route each token
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.router(hidden_states)  # [T, E]
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights = routing_weights.to(hidden_states.dtype)

        final_hidden_states = torch.zeros(
            (batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype, device=hidden_states.device
        )

        # [E, k, T] mask of which token picked which expert in which slot
        expert_mask = torch.nn.functional.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)

        for expert_idx in range(self.num_experts):
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx])

            if top_x.shape[0] == 0:
                continue

            # Python lists index faster than tensors
            top_x_list = top_x.tolist()
            idx_list = idx.tolist()

            current_state = hidden_states[None, top_x_list].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x_list, idx_list, None]

            # index_add_ needs a tensor index, so the tensor form is used here
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        final_hidden_states = final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)
        return final_hidden_states, router_logits


class JambaLayerSchedule:
    """`JambaModel.__init__`'s per-layer choice, one call per layer in order: experts on every
    `expert_layer_period`-th layer from `expert_layer_offset`, one dense expert elsewhere."""

    def __init__(self, config: JambaConfig):
        self.config = config
        self.i = 0

    def __call__(self) -> JambaSparseMoeBlock:
        i, config = self.i, self.config
        self.i += 1
        is_expert = True if (i - config.expert_layer_offset) % config.expert_layer_period == 0 else False
        num_experts = config.num_experts if is_expert else 1
        num_experts_per_tok = config.num_experts_per_tok if num_experts > 1 else 1
        return JambaSparseMoeBlock(config, num_experts=num_experts, num_experts_per_tok=num_experts_per_tok)


def build():
    return tiny(JambaLayerSchedule(JambaConfig()), HIDDEN, layers=LAYERS)
