"""Hugging Face transformers' `SwitchTransformersSparseMLP` (google/switch-base-8 and kin): a top-1 router with a
cumsum capacity mask, a `nonzero(...).tolist()` loop over the hit experts of a ModuleDict looked up by
formatted name, and boolean-mask gather / scatter into a clone of the input.

Mirrors GitHub huggingface/transformers at commit 2b24433
(`src/transformers/models/switch_transformers/modeling_switch_transformers.py`: `SwitchTransformersTop1Router`
`__init__` / `_compute_router_probabilities` / `_cast_classifier` / `forward`, `SwitchTransformersDenseActDense`,
`SwitchTransformersSparseMLP.__init__` / `forward`, and the MLP half of `SwitchTransformersLayerFF.forward`), with
`configuration_switch_transformers.py` (commit 18dcde0) for the defaults (`num_experts` 8, `expert_capacity` 64,
`router_bias` False, `router_jitter_noise` 0.01, `router_dtype` "float32", `router_ignore_padding_tokens` False,
`dropout_rate` 0.1, `dense_act_fn` "relu"). This is the code `SwitchTransformersForConditionalGeneration` runs for
the google/switch-* checkpoints.
`SwitchTransformersSparseMLP.forward(hidden_states)` takes (batch, seq, d_model) and calls the router:
`_compute_router_probabilities` stores `self.input_dtype` on the module (an attribute written in forward), casts the
tokens to the router dtype, multiplies them in place by uniform noise `if self.training and self.jitter_noise > 0`
(off in eval), calls `_cast_classifier()` (which, unless the Linear carries bitsandbytes `SCB` / `CB` attributes,
re-assigns `self.classifier = self.classifier.to(self.dtype)` on every call), runs the `classifier` Linear and a
softmax in the router dtype cast back to the input dtype. The router then takes `argmax` of the probabilities,
`one_hot`s it, computes each token's priority as `cumsum` over the sequence axis (per batch row), masks the one-hot
with `token_priority <= expert_capacity` (tokens past capacity get an all-zero row) and reduces the probabilities
to the top-1 value with `torch.max(...).values.unsqueeze(-1)`. Back in the MLP: `expert_index = argmax(router_mask)`
(kept for the returned tuple), `next_states = hidden_states.clone()` (so dropped tokens pass through unchanged),
`router_mask.bool()`, a per-expert token count `reshape(B*S, E).sum(dim=0)`, and
`torch.nonzero(count, as_tuple=True)[0].tolist()`, a host list of the hit experts. For each hit `idx`, the expert
is fetched by `getattr(self.experts, "expert_{}".format(idx))` from an `nn.ModuleDict`, applied to the tokens
picked by the boolean mask `hidden_states[router_mask[:, :, idx]]`, and written back with boolean-mask assignment
`next_states[router_mask[:, :, idx]] = ...`. Finally `hidden_states = router_probs * next_states` (every token,
routed or dropped, is scaled by its top-1 probability) and it returns `(hidden_states, (router_logits,
expert_index))`. The expert (`SwitchTransformersDenseActDense`) is `wi` Linear, ReLU, Dropout, a guarded cast to
`wo`'s dtype (`isinstance(self.wo.weight, torch.Tensor) and dtype differs and not int8`), `wo` Linear.
`SwitchTransformersLayerFF.forward` unpacks the tuple (`isinstance(forwarded_states, tuple)`), applies `dropout`
(identity in eval) and adds the residual (the shell supplies the T5 layer norm and the residual add).
Left out: attention, `SwitchTransformersLayerNorm` (the shell's LayerNorm stands in), the z-loss and
load-balancing loss functions (training only, on the returned router tuple), `PretrainedConfig` (a plain local
class with the defaults), `ACT2FN` (a stand-in that builds `nn.ReLU()` per lookup, as transformers' class
instantiator does), weight init (the shell draws weights). The layer's `output_router_logits` packing
(`(output, router_tuple)`) is kept as a forward flag, False as the model passes it at inference.
Nothing of the MoE forward was left out.
Sizes: switch-base-8 has d_model 768, d_ff 2048, 8 experts, capacity 64 (a capacity factor of 1 at 512 tokens);
here d_model 16, d_ff 8, 4 experts, capacity 2 (about the same factor at 7 tokens), top-1. The capacity mask is
computed either way; with the shell's seed-0 weights the experts draw 2, 1, 2, 2 tokens, so none is dropped.
Constructs: a module attribute written in forward (`self.input_dtype`), a submodule re-assigned in forward
(`self.classifier = self.classifier.to(dtype)`) behind a `hasattr` check, a `self.training and noise > 0` in-place
branch, `argmax` + `one_hot` top-1, a `cumsum` capacity mask multiplied into the one-hot, `torch.max(...).values`,
`clone()` of the input as the output buffer, `nonzero(as_tuple=True)[0].tolist()` host read, a loop over that list
with `getattr(ModuleDict, "expert_{}".format(idx))`, boolean-mask gather and boolean-mask index assignment, a
dtype-guarded cast inside the expert, a post-hoc scale of all tokens by the top-1 probability, a nested tuple
return unpacked by `isinstance`, and Dropout on the output in the layer half.
"""

from __future__ import annotations

import torch
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("huggingface/transformers",
                "src/transformers/models/switch_transformers/modeling_switch_transformers.py",
                "2b24433ab77dc90a72d41a2a58ecaaa35c021037", "SwitchTransformersSparseMLP.forward")
HIDDEN, D_FF, EXPERTS, CAPACITY = 16, 8, 4, 2


class SwitchTransformersConfig:
    """The MoE fields of `SwitchTransformersConfig` (defaults as there, sizes tiny); `hidden_size` is its
    `attribute_map` alias of `d_model`."""

    def __init__(self, d_model=HIDDEN, d_ff=D_FF, expert_capacity=CAPACITY, num_experts=EXPERTS, router_bias=False,
                 router_jitter_noise=0.01, router_dtype="float32", router_ignore_padding_tokens=False,
                 dropout_rate=0.1, dense_act_fn="relu"):
        self.d_model = d_model
        self.hidden_size = d_model
        self.d_ff = d_ff
        self.expert_capacity = expert_capacity
        self.num_experts = num_experts
        self.router_bias = router_bias
        self.router_jitter_noise = router_jitter_noise
        if router_dtype not in ["float32", "float16", "bfloat16"]:
            raise ValueError(f"`router_dtype` must be one of 'float32', 'float16' or 'bfloat16', got {router_dtype}")
        self.router_dtype = router_dtype
        self.router_ignore_padding_tokens = router_ignore_padding_tokens
        self.dropout_rate = dropout_rate
        self.dense_act_fn = dense_act_fn


class _FreshInstance(dict):
    """transformers' `ACT2FN`: looking a name up builds a new activation module."""

    def __getitem__(self, key):
        return super().__getitem__(key)()


ACT2FN = _FreshInstance(relu=nn.ReLU)


class SwitchTransformersTop1Router(nn.Module):
    """Each token picks its single most probable expert; an expert takes tokens in sequence order until full."""

    def __init__(self, config: SwitchTransformersConfig):
        super().__init__()
        self.num_experts = config.num_experts
        self.expert_capacity = config.expert_capacity
        self.classifier = nn.Linear(config.hidden_size, self.num_experts, bias=config.router_bias)
        self.jitter_noise = config.router_jitter_noise
        self.ignore_padding_tokens = config.router_ignore_padding_tokens
        self.dtype = getattr(torch, config.router_dtype)

    def _compute_router_probabilities(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # routing runs in the router dtype ("selective precision"); remember the caller's dtype to cast back
        self.input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(self.dtype)

        if self.training and self.jitter_noise > 0:
            # multiplicative uniform jitter on the router input, training only
            hidden_states *= torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)

        self._cast_classifier()
        router_logits = self.classifier(hidden_states)  # [groups, tokens per group, experts]

        router_probabilities = nn.functional.softmax(router_logits, dim=-1, dtype=self.dtype).to(self.input_dtype)
        return router_probabilities, router_logits

    def _cast_classifier(self):
        # 8-bit bitsandbytes Linears (which carry SCB / CB) cannot be cast, every other classifier is
        if not (hasattr(self.classifier, "SCB") or hasattr(self.classifier, "CB")):
            self.classifier = self.classifier.to(self.dtype)

    def forward(self, hidden_states: torch.Tensor) -> tuple:
        router_probs, router_logits = self._compute_router_probabilities(hidden_states)

        expert_index = torch.argmax(router_probs, dim=-1)
        expert_index = torch.nn.functional.one_hot(expert_index, num_classes=self.num_experts)

        # a token's rank among the tokens of its sequence that chose the same expert
        token_priority = torch.cumsum(expert_index, dim=-2)
        # zero the one-hot row of every token that would overflow its expert
        expert_capacity_mask = token_priority <= self.expert_capacity
        expert_index = expert_index * expert_capacity_mask

        router_probs = torch.max(router_probs, dim=-1).values.unsqueeze(-1)
        return expert_index, router_probs, router_logits


class SwitchTransformersDenseActDense(nn.Module):
    """The T5 feed-forward used as each expert: wi, activation, dropout, wo."""

    def __init__(self, config: SwitchTransformersConfig):
        super().__init__()
        self.wi = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wo = nn.Linear(config.d_ff, config.d_model, bias=False)
        self.dropout = nn.Dropout(config.dropout_rate)
        self.act = ACT2FN[config.dense_act_fn]

    def forward(self, hidden_states):
        hidden_states = self.wi(hidden_states)
        hidden_states = self.act(hidden_states)
        hidden_states = self.dropout(hidden_states)
        if (
            isinstance(self.wo.weight, torch.Tensor)
            and hidden_states.dtype != self.wo.weight.dtype
            and self.wo.weight.dtype != torch.int8
        ):
            hidden_states = hidden_states.to(self.wo.weight.dtype)
        hidden_states = self.wo(hidden_states)
        return hidden_states


class SwitchTransformersSparseMLP(nn.Module):
    """Top-1 router, experts in a ModuleDict named `expert_{i}`."""

    def __init__(self, config: SwitchTransformersConfig, expert_class: type[nn.Module] = SwitchTransformersDenseActDense):
        super().__init__()
        self.router = SwitchTransformersTop1Router(config)

        self.experts = nn.ModuleDict()
        for idx in range(config.num_experts):
            self.experts[f"expert_{idx}"] = expert_class(config)

    def forward(self, hidden_states):
        # the mask is the capacity-trimmed one-hot of each token's argmax expert; the probs scale the outputs
        router_mask, router_probs, router_logits = self.router(hidden_states)
        expert_index = torch.argmax(router_mask, dim=-1)

        # tokens no expert takes keep their input, so the output starts as a copy of it
        next_states = hidden_states.clone()

        router_mask = router_mask.bool()
        batch_size, seq_len, num_experts = router_mask.shape
        idx_mask = router_mask.reshape(batch_size * seq_len, num_experts).sum(dim=0)
        # the experts that received at least one token, as a Python list
        idx_mask = torch.nonzero(idx_mask, as_tuple=True)[0].tolist()
        for idx in idx_mask:
            next_states[router_mask[:, :, idx]] = getattr(self.experts, "expert_{}".format(idx))(  # noqa: UP032
                hidden_states[router_mask[:, :, idx]]
            )

        hidden_states = router_probs * next_states
        return hidden_states, (router_logits, expert_index)


class SwitchTransformersLayerFFHalf(nn.Module):
    """`SwitchTransformersLayerFF.forward` after its layer norm and before its residual add: the sparse MLP, the
    tuple unpacking, and the dropout (the shell supplies the norm and the residual)."""

    def __init__(self, config: SwitchTransformersConfig, is_sparse=True):
        super().__init__()
        self.is_sparse = is_sparse
        if not self.is_sparse:
            self.mlp = SwitchTransformersDenseActDense(config)
        else:
            self.mlp = SwitchTransformersSparseMLP(config)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, forwarded_states, output_router_logits=False):
        forwarded_states = self.mlp(forwarded_states)

        if isinstance(forwarded_states, tuple):
            forwarded_states, router_tuple = forwarded_states
        else:
            router_tuple = None

        output = self.dropout(forwarded_states)

        if output_router_logits and router_tuple is not None:
            output = (output, router_tuple)

        return output


def build():
    return tiny(lambda: SwitchTransformersLayerFFHalf(SwitchTransformersConfig()), HIDDEN)
