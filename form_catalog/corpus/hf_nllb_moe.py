"""Hugging Face transformers' `NllbMoeSparseMLP` (facebook/nllb-moe-54b): a fairseq-style top-2 router built from
two argmaxes and cumsum locations, a capacity re-set on the module every call, an `einsum` with a boolean mask that
copies the tokens once per expert, and a loop over every expert with boolean-mask gathers and writes.

Mirrors GitHub huggingface/transformers at commit e6a2074
(`src/transformers/models/nllb_moe/modeling_nllb_moe.py`: `NllbMoeTop2Router` `__init__` / `_cast_classifier` /
`normalize_router_probabilities` / `route_tokens` / `forward`, `NllbMoeDenseActDense`, `NllbMoeSparseMLP.__init__` /
`forward`, and the feed-forward half of `NllbMoeEncoderLayer.forward`), with `configuration_nllb_moe.py` (commit
7d303f3) for the defaults (128 experts, `expert_capacity` 64, `router_dtype` "float32", `router_bias` False,
`router_ignore_padding_tokens` False, `second_expert_policy` "all", `normalize_router_prob_before_dropping` False,
`batch_prioritized_routing` False, `moe_eval_capacity_token_fraction` 1.0, `moe_token_dropout` 0.2,
`activation_function` "relu", `activation_dropout` 0.0). This is the code `NllbMoeForConditionalGeneration` runs
for the NLLB-200 MoE checkpoint.
`NllbMoeSparseMLP.forward(hidden_states, padding_mask)` reads (batch, seq, d_model) and calls the router, which
stores `self.input_dtype` on the module, flattens to [T, d], casts to the router dtype, calls `_cast_classifier()`
(re-assigning `self.classifier = self.classifier.to(self.dtype)` unless it is a bitsandbytes Linear) and the bias-free
`classifier`, then `route_tokens`: softmax in the router dtype cast back, top-1 by `argmax` + `one_hot`, a
`"sampling"` policy branch adding Gumbel noise to the logits in place (off), top-2 by `masked_fill(top1.bool(), -inf)`
and a second `argmax` + `one_hot`, `if normalize_router_prob_before_dropping` (off), a `"random"` policy branch that
samples against `rand_like` (off), the padding branch `if padding_mask is not None and not
router_ignore_padding_tokens` (skipped: the encoder passes `attention_mask`, None without padding), the
`batch_prioritized_routing` branch with `argsort(...).argsort()` re-ordering (off), else `locations1 =
cumsum(top_1_mask) - 1`, `locations2 = cumsum(top_2_mask) - 1` plus the per-expert top-1 count (in place). In eval
with `moe_eval_capacity_token_fraction > 0` it writes `self.expert_capacity = math.ceil(fraction * T)` onto the
module (else `2 * ceil(T / E)` when unset); both masks are multiplied by `torch.lt(locations, capacity)`; the
top-1 / top-2 probabilities are renormalised by their sum clamped at `finfo.eps` (`normalize_router_probabilities`,
here after dropping), and `router_probs = top1_prob[:, None] * top_1_mask + top2_prob[:, None] * top_2_mask` is the
dense [T, E] combine matrix. The MLP takes `router_mask = router_probs.bool()`, builds
`masked_hidden_states = einsum("bm,be->ebm", tokens, router_mask)` (an [E, T, d] copy, zero where not routed),
and loops `for idx, expert in enumerate(self.experts.values())` over every expert of an `nn.ModuleDict` (no skip
of empty experts): `token_indices = router_mask[:, idx]`, `combining_weights = router_probs[token_indices, idx]`,
the expert on `masked_hidden_states[idx, token_indices]`, `if self.moe_token_dropout > 0` then in eval an in-place
`expert_output *= 1 - moe_token_dropout` (Dropout in training), and a boolean-mask write back
`masked_hidden_states[idx, token_indices] = einsum("b,be->be", weights, expert_output)`. It sums over the expert
axis, reshapes to (batch, seq, d), takes `argmax(top_1_mask)` for the returned `(router_probs, top_1_expert_index)`
and returns `(hidden_states, router_states)`. The expert (`NllbMoeDenseActDense`) is `fc1` Linear (biased), ReLU,
Dropout, a guarded cast to `fc2`'s dtype, `fc2` Linear (biased). `NllbMoeEncoderLayer.forward` calls
`self.ffn(hidden_states, attention_mask)` on a sparse layer, unpacks the tuple, applies `ff_dropout`, adds the
residual and returns a tuple (the shell supplies `ff_layer_norm` and the residual add).
Left out: attention, the encoder layer's float16-only inf/nan clamp after the residual add (its dtype test is False
in float32, and it sits after the residual the shell adds), the load-balancing / z-loss functions (training only),
`PretrainedConfig` (a plain local class with the defaults), `ACT2FN` (a stand-in that builds `nn.ReLU()` per
lookup, as transformers' class instantiator does), weight init (the shell draws weights). The layer's
`outputs = (hidden_states,)` tuple and its `if output_router_logits` append are kept (False at inference).
Nothing of the MoE forward was left out.
Sizes: nllb-moe-54b has d_model 2048, ffn 8192, 128 experts, top-2; here d_model 16, ffn 8, 4 experts, top-2 (the
eval capacity is then ceil(1.0 * 7) = 7, so no token is dropped).
Constructs: module attributes written in forward (`self.input_dtype`, `self.expert_capacity` from `math.ceil` of a
shape), a submodule re-assigned in forward behind a `hasattr` check, string-valued policy branches (Gumbel
`rsample`, `rand_like` sampling), top-2 by `argmax` / `masked_fill(-inf)` / `argmax` with `one_hot` masks, cumsum
location arithmetic with an in-place `+=`, `torch.lt` capacity masks, an optional `argsort().argsort()` reordering,
an `eps`-clamped renormalisation, a dense [T, E] combine matrix, `einsum` with a bool operand that replicates the
tokens per expert, a loop over all `ModuleDict.values()` with boolean-mask gathers (data-dependent sizes, empty
experts included), a config-valued branch with an in-place `*=` in eval, boolean-mask index assignment with an
`einsum` scale, a sum over the expert axis, and a nested tuple return.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("huggingface/transformers", "src/transformers/models/nllb_moe/modeling_nllb_moe.py",
                "e6a20749cb0a882861b2828befc11f7498b9b51c", "NllbMoeSparseMLP.forward")
HIDDEN, FFN, EXPERTS = 16, 8, 4


class NllbMoeConfig:
    """The MoE fields of `NllbMoeConfig` (defaults as there, sizes tiny); `hidden_size` is its `attribute_map`
    alias of `d_model`."""

    def __init__(self, d_model=HIDDEN, encoder_ffn_dim=FFN, activation_function="relu", activation_dropout=0.0,
                 router_bias=False, router_dtype="float32", router_ignore_padding_tokens=False, num_experts=EXPERTS,
                 expert_capacity=64, second_expert_policy="all", normalize_router_prob_before_dropping=False,
                 batch_prioritized_routing=False, moe_eval_capacity_token_fraction=1.0, moe_token_dropout=0.2):
        self.d_model = d_model
        self.hidden_size = d_model
        self.encoder_ffn_dim = encoder_ffn_dim
        self.activation_function = activation_function
        self.activation_dropout = activation_dropout
        self.router_bias = router_bias
        if router_dtype not in ["float32", "float16", "bfloat16"]:
            raise ValueError(f"`router_dtype` must be one of 'float32', 'float16' or 'bfloat16', got {router_dtype}")
        self.router_dtype = router_dtype
        self.router_ignore_padding_tokens = router_ignore_padding_tokens
        self.num_experts = num_experts
        self.expert_capacity = expert_capacity
        self.second_expert_policy = second_expert_policy
        self.normalize_router_prob_before_dropping = normalize_router_prob_before_dropping
        self.batch_prioritized_routing = batch_prioritized_routing
        self.moe_eval_capacity_token_fraction = moe_eval_capacity_token_fraction
        self.moe_token_dropout = moe_token_dropout


class _FreshInstance(dict):
    """transformers' `ACT2FN`: looking a name up builds a new activation module."""

    def __getitem__(self, key):
        return super().__getitem__(key)()


ACT2FN = _FreshInstance(relu=nn.ReLU)


class NllbMoeTop2Router(nn.Module):
    """fairseq's top-2 gate: first and second choice by argmax, each expert filled in token order up to capacity,
    the surviving two probabilities renormalised."""

    def __init__(self, config: NllbMoeConfig):
        super().__init__()
        self.num_experts = config.num_experts
        self.expert_capacity = config.expert_capacity
        self.classifier = nn.Linear(config.hidden_size, self.num_experts, bias=config.router_bias)
        self.router_ignore_padding_tokens = config.router_ignore_padding_tokens
        self.dtype = getattr(torch, config.router_dtype)

        self.second_expert_policy = config.second_expert_policy
        self.normalize_router_prob_before_dropping = config.normalize_router_prob_before_dropping
        self.batch_prioritized_routing = config.batch_prioritized_routing
        self.moe_eval_capacity_token_fraction = config.moe_eval_capacity_token_fraction

    def _cast_classifier(self):
        # 8-bit bitsandbytes Linears (which carry SCB / CB) cannot be cast, every other classifier is
        if not (hasattr(self.classifier, "SCB") or hasattr(self.classifier, "CB")):
            self.classifier = self.classifier.to(self.dtype)

    def normalize_router_probabilities(self, router_probs, top_1_mask, top_2_mask):
        top_1_max_probs = (router_probs * top_1_mask).sum(dim=1)
        top_2_max_probs = (router_probs * top_2_mask).sum(dim=1)
        denom_s = torch.clamp(top_1_max_probs + top_2_max_probs, min=torch.finfo(router_probs.dtype).eps)
        top_1_max_probs = top_1_max_probs / denom_s
        top_2_max_probs = top_2_max_probs / denom_s
        return top_1_max_probs, top_2_max_probs

    def route_tokens(self, router_logits: torch.Tensor, input_dtype: torch.dtype = torch.float32,
                     padding_mask: torch.Tensor | None = None) -> tuple:
        nb_tokens = router_logits.shape[0]
        router_probs = nn.functional.softmax(router_logits, dim=-1, dtype=self.dtype).to(input_dtype)
        top_1_expert_index = torch.argmax(router_probs, dim=-1)
        top_1_mask = torch.nn.functional.one_hot(top_1_expert_index, num_classes=self.num_experts)

        if self.second_expert_policy == "sampling":
            gumbel = torch.distributions.gumbel.Gumbel(0, 1).rsample
            router_logits += gumbel(router_logits.shape).to(router_logits.device)

        # the second choice is the argmax once the first choice is ruled out
        logits_except_top_1 = router_logits.masked_fill(top_1_mask.bool(), float("-inf"))
        top_2_expert_index = torch.argmax(logits_except_top_1, dim=-1)
        top_2_mask = torch.nn.functional.one_hot(top_2_expert_index, num_classes=self.num_experts)

        if self.normalize_router_prob_before_dropping:
            top_1_max_probs, top_2_max_probs = self.normalize_router_probabilities(
                router_probs, top_1_mask, top_2_mask
            )

        if self.second_expert_policy == "random":
            top_2_max_probs = (router_probs * top_2_mask).sum(dim=1)
            sampled = (2 * top_2_max_probs) > torch.rand_like(top_2_max_probs.float())
            top_2_mask = top_2_mask * sampled.repeat(self.num_experts, 1).transpose(1, 0)

        if padding_mask is not None and not self.router_ignore_padding_tokens:
            if len(padding_mask.shape) == 4:
                # a causal 4-D mask: its last row, flattened, trimmed to the tokens routed here
                padding_mask = padding_mask[:, :, -1, :].reshape(-1)[-nb_tokens:]
            non_padding = ~padding_mask.bool()
            top_1_mask = top_1_mask * non_padding.unsqueeze(-1).to(top_1_mask.dtype)
            top_2_mask = top_2_mask * non_padding.unsqueeze(-1).to(top_1_mask.dtype)

        if self.batch_prioritized_routing:
            # fill the experts in order of routing confidence rather than position
            importance_scores = -1 * router_probs.max(dim=1)[0]
            sorted_top_1_mask = top_1_mask[importance_scores.argsort(dim=0)]
            sorted_cumsum1 = (torch.cumsum(sorted_top_1_mask, dim=0) - 1) * sorted_top_1_mask
            locations1 = sorted_cumsum1[importance_scores.argsort(dim=0).argsort(dim=0)]

            sorted_top_2_mask = top_2_mask[importance_scores.argsort(dim=0)]
            sorted_cumsum2 = (torch.cumsum(sorted_top_2_mask, dim=0) - 1) * sorted_top_2_mask
            locations2 = sorted_cumsum2[importance_scores.argsort(dim=0).argsort(dim=0)]
            # second choices queue behind every first choice of the same expert
            locations2 += torch.sum(top_1_mask, dim=0, keepdim=True)
        else:
            locations1 = torch.cumsum(top_1_mask, dim=0) - 1
            locations2 = torch.cumsum(top_2_mask, dim=0) - 1
            # second choices queue behind every first choice of the same expert
            locations2 += torch.sum(top_1_mask, dim=0, keepdim=True)

        if not self.training and self.moe_eval_capacity_token_fraction > 0:
            self.expert_capacity = math.ceil(self.moe_eval_capacity_token_fraction * nb_tokens)
        else:
            capacity = 2 * math.ceil(nb_tokens / self.num_experts)
            self.expert_capacity = capacity if self.expert_capacity is None else self.expert_capacity

        # a slot at or past capacity is not routed
        top_1_mask = top_1_mask * torch.lt(locations1, self.expert_capacity)
        top_2_mask = top_2_mask * torch.lt(locations2, self.expert_capacity)

        if not self.normalize_router_prob_before_dropping:
            top_1_max_probs, top_2_max_probs = self.normalize_router_probabilities(
                router_probs, top_1_mask, top_2_mask
            )

        # the [tokens, experts] combine weights: each token's two renormalised probabilities in its two columns
        gates1 = top_1_max_probs[:, None] * top_1_mask
        gates2 = top_2_max_probs[:, None] * top_2_mask
        router_probs = gates1 + gates2

        return top_1_mask, router_probs

    def forward(self, hidden_states: torch.Tensor, padding_mask: torch.Tensor | None = None) -> tuple:
        self.input_dtype = hidden_states.dtype
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.reshape((batch_size * sequence_length), hidden_dim)
        hidden_states = hidden_states.to(self.dtype)
        self._cast_classifier()
        router_logits = self.classifier(hidden_states)
        top_1_mask, router_probs = self.route_tokens(router_logits, self.input_dtype, padding_mask)
        return top_1_mask, router_probs


class NllbMoeDenseActDense(nn.Module):
    """Each expert: fc1, activation, dropout, fc2 (both Linears biased)."""

    def __init__(self, config: NllbMoeConfig, ffn_dim: int):
        super().__init__()
        self.fc1 = nn.Linear(config.d_model, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, config.d_model)
        self.dropout = nn.Dropout(config.activation_dropout)
        self.act = ACT2FN[config.activation_function]

    def forward(self, hidden_states):
        hidden_states = self.fc1(hidden_states)
        hidden_states = self.act(hidden_states)
        hidden_states = self.dropout(hidden_states)
        if (
            isinstance(self.fc2.weight, torch.Tensor)
            and hidden_states.dtype != self.fc2.weight.dtype
            and (self.fc2.weight.dtype != torch.int8 and self.fc2.weight.dtype != torch.uint8)
        ):
            hidden_states = hidden_states.to(self.fc2.weight.dtype)
        hidden_states = self.fc2(hidden_states)
        return hidden_states


class NllbMoeSparseMLP(nn.Module):
    """Top-2 router, experts in a ModuleDict named `expert_{i}`, every expert visited."""

    def __init__(self, config: NllbMoeConfig, ffn_dim: int, expert_class: type[nn.Module] = NllbMoeDenseActDense):
        super().__init__()
        self.router = NllbMoeTop2Router(config)
        self.moe_token_dropout = config.moe_token_dropout
        self.token_dropout = nn.Dropout(self.moe_token_dropout)
        self.num_experts = config.num_experts

        self.experts = nn.ModuleDict()
        for idx in range(self.num_experts):
            self.experts[f"expert_{idx}"] = expert_class(config, ffn_dim)

    def forward(self, hidden_states: torch.Tensor, padding_mask: torch.Tensor | None = False):
        batch_size, sequence_length, hidden_dim = hidden_states.shape

        top_1_mask, router_probs = self.router(hidden_states, padding_mask)
        router_mask = router_probs.bool()
        hidden_states = hidden_states.reshape((batch_size * sequence_length), hidden_dim)
        # one copy of the tokens per expert, zeroed where the token is not routed to it: [experts, tokens, d]
        masked_hidden_states = torch.einsum("bm,be->ebm", hidden_states, router_mask)
        for idx, expert in enumerate(self.experts.values()):
            token_indices = router_mask[:, idx]
            combining_weights = router_probs[token_indices, idx]
            expert_output = expert(masked_hidden_states[idx, token_indices])
            if self.moe_token_dropout > 0:
                if self.training:
                    expert_output = self.token_dropout(expert_output)
                else:
                    expert_output *= 1 - self.moe_token_dropout
            masked_hidden_states[idx, token_indices] = torch.einsum("b,be->be", combining_weights, expert_output)
        hidden_states = masked_hidden_states.sum(dim=0).reshape(batch_size, sequence_length, hidden_dim)

        top_1_expert_index = torch.argmax(top_1_mask, dim=-1)
        return hidden_states, (router_probs, top_1_expert_index)


class NllbMoeEncoderLayerFF(nn.Module):
    """The feed-forward half of `NllbMoeEncoderLayer.forward` after `ff_layer_norm` and before the residual add:
    the sparse (or dense) ffn called with the layer's `attention_mask`, then `ff_dropout`."""

    def __init__(self, config: NllbMoeConfig, is_sparse: bool = True):
        super().__init__()
        self.is_sparse = is_sparse
        if not self.is_sparse:
            self.ffn = NllbMoeDenseActDense(config, ffn_dim=config.encoder_ffn_dim)
        else:
            self.ffn = NllbMoeSparseMLP(config, ffn_dim=config.encoder_ffn_dim)
        self.ff_dropout = nn.Dropout(config.activation_dropout)

    def forward(self, hidden_states, attention_mask=None, output_router_logits=False):
        if self.is_sparse:
            hidden_states, router_states = self.ffn(hidden_states, attention_mask)
        else:
            # a dense layer reports no router states
            hidden_states, router_states = self.ffn(hidden_states), None

        hidden_states = self.ff_dropout(hidden_states)

        outputs = (hidden_states,)
        if output_router_logits:
            outputs += (router_states,)
        return outputs


def build():
    return tiny(lambda: NllbMoeEncoderLayerFF(NllbMoeConfig()), HIDDEN)
