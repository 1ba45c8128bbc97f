"""JetStream-PyTorch's Mixtral MOEFeedForward: stacked-weight experts, dense all-experts or gathered-weights einsums.

Mirrors AI-Hypercomputer/jetstream-pytorch `jetstream_pt/third_party/mixtral/model.py` at commit c8bb611
(`ModelArgs` MoE fields from `config.py`, `ConditionalFeedForward.forward`, `.forward_for_short_seq_len`,
`.forward_for_long_seq_len`, `MOEFeedForward.forward`), the newest snapshot read; the file last changed in
3afdc43. The layer unpacks [B, T, D], flattens to tokens with `view(-1, self.dim)`, scores a bias-free
nn.Linear gate, softmaxes, takes the top-k (sorted) and renormalises the weights in place (`/=` by their
sum), then calls the conditional FFN with the tokens and the expert ids. Its experts are three stacked
parameters w1 [E, I, D], w2 [E, D, I], w3 [E, I, D]. The FFN branches in Python on the token count:
with 4 tokens or more (the corpus input has 7) it runs every expert on every token with einsums
(`silu(ti,eoi->teo) * (ti,eoi->teo)`, then `teo,eio->tei`), builds `torch.arange(seqlen).unsqueeze(1)`
(no device argument) and advanced-indexes the [T, E, D] result with it and the ids to keep the chosen
[T, k, D]; with fewer tokens it gathers the chosen experts' weights `w[expert_indices]` into [T, k, ...]
and runs the same SwiGLU as `ti,taoi->tao` / `tao,taio->tai` einsums. The layer combines the [T, k, D]
outputs with `einsum("tai,ta->ti")` against the weights and reshapes back to [B, T, D].
Left out: `ModuleBase` (a `torch.nn.Module` that also records Hugging Face names and sharding axes:
`hf_name` / `annotate_sharding` are load-time metadata, the forward never reads them; the one-process
form is a plain nn.Module); the `jax.named_scope` profiler scopes around the FFN bodies (JAX trace labels
only, no effect on the math, and JAX is not a torch import); `Int8ConditionalFeedForward` and the
quantised gate from `get_quantized_linear_layer` (chosen only when `env.quant_config` enables weight
quantisation; with it off the gate is `nn.Linear` and the FFN is `ConditionalFeedForward`, kept here);
`get_quantized_version` and the rest of the file (attention, RMSNorm, rope, Transformer). `ModelArgs`
becomes a plain local class with the four MoE fields. No einops in the source: einsums are torch's.
Constructs: a Python `if seq_len >= 4` branch on the token count picking dense all-experts compute or
per-token weight gathers, `torch.arange` on the default device used as an advanced index with the expert
ids, gathers of stacked parameters by a [T, k] id tensor, in-place `/=` on the top-k weights, an unused
local read of `self.w1.shape[0]`, config attributes stored on the module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._shell import Source, tiny

SOURCE = Source(
    "AI-Hypercomputer/jetstream-pytorch",
    "jetstream_pt/third_party/mixtral/model.py",
    "c8bb6119a388d66bc8936d7c03cb49e4be01f407",
    "MOEFeedForward.forward",
)
HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 8, 2


class ModelArgs:
    def __init__(self, dim=HIDDEN, intermediate_size=INTER, num_experts=EXPERTS, num_activated_experts=TOP_K):
        self.dim, self.intermediate_size = dim, intermediate_size
        self.num_experts, self.num_activated_experts = num_experts, num_activated_experts


class ConditionalFeedForward(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(config.num_experts, config.intermediate_size, config.dim))
        self.w2 = nn.Parameter(torch.empty(config.num_experts, config.dim, config.intermediate_size))
        self.w3 = nn.Parameter(torch.empty(config.num_experts, config.intermediate_size, config.dim))
        self.config = config

    def forward(self, x: Tensor, expert_indices: Tensor) -> Tensor:
        seq_len = x.shape[0]
        if seq_len >= 4:
            return self.forward_for_long_seq_len(x, expert_indices)
        else:
            return self.forward_for_short_seq_len(x, expert_indices)

    def forward_for_short_seq_len(self, x: Tensor, expert_indices: Tensor) -> Tensor:
        w1_weights = self.w1[expert_indices]
        w3_weights = self.w3[expert_indices]
        w2_weights = self.w2[expert_indices]

        x1 = F.silu(torch.einsum("ti,taoi -> tao", x, w1_weights))
        x3 = torch.einsum("ti, taoi -> tao", x, w3_weights)
        expert_outs = torch.einsum("tao, taio -> tai", (x1 * x3), w2_weights)
        return expert_outs

    def forward_for_long_seq_len(self, x, expert_indices):
        seqlen = x.shape[0]
        num_experts = self.w1.shape[0]  # noqa: F841 - read and unused, as the original

        x1 = F.silu(torch.einsum("ti,eoi -> teo", x, self.w1))
        x3 = torch.einsum("ti, eoi-> teo", x, self.w3)
        expert_outs = torch.einsum("teo, eio -> tei", (x1 * x3), self.w2)
        seq_indexes = torch.arange(seqlen).unsqueeze(1)
        return expert_outs[seq_indexes, expert_indices]


class MOEFeedForward(nn.Module):
    def __init__(self, config: ModelArgs | None = None) -> None:
        super().__init__()
        config = config or ModelArgs()
        self.gate = nn.Linear(config.dim, config.num_experts, bias=False)
        self.cond_ffn = ConditionalFeedForward(config)
        self.dim = config.dim
        self.num_activated_experts = config.num_activated_experts

    def forward(self, x: Tensor) -> Tensor:
        bsz, seq, hidden = x.shape
        x = x.view(-1, self.dim)
        scores = self.gate(x)
        expert_weights = F.softmax(scores, dim=-1)
        expert_weights, expert_indices = torch.topk(expert_weights, self.num_activated_experts, dim=-1)
        expert_weights /= expert_weights.sum(dim=-1, keepdim=True)
        expert_outs = self.cond_ffn(x, expert_indices)
        expert_outs = torch.einsum("tai,ta -> ti", expert_outs, expert_weights)
        expert_outs = expert_outs.reshape(bsz, seq, hidden)
        return expert_outs


def build():
    return tiny(MOEFeedForward, HIDDEN)
