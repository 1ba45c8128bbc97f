"""pytorch-mixtures' `ExpertChoiceMoE`: expert-choice routing (each expert takes its top-C tokens from the
transposed logits, a softmax over those C tokens), a raw-parameter router, data-dependent `assert`s on the
logits and weights, and an advanced-index `out[tokens] += w * expert(x[tokens])` loop.

Mirrors jaisidhsingh/pytorch-mixtures (the `pytorch-mixtures` PyPI package) at commit 9ec73e6:
`pytorch_mixtures/expert_choice_moe.py` (`ExpertChoiceMoE.compute_routing` / `apply_routing_on_experts`),
`pytorch_mixtures/basic_moe.py` (the abstract base `MoE`: `__init__`, `forward`), `pytorch_mixtures/utils.py`
(`_assert_no_nan`, `FeedForward`, `EXPERT_REGISTRY`) and `pytorch_mixtures/configs.py` (`MoEConfig`), with the
README's configuration (`expert_fn="ff"`, `expert_act="silu"`, capacity factor 1.25, float32). `MoE.forward`
reshapes [B, L, D] to tokens, scores them with `x @ self.weight` (a raw [D, E] Parameter, xavier-initialised, no
Linear), asserts the logits are finite (`assert torch.isfinite(t).all(), msg`, a host read of a tensor bool),
and calls the two abstract methods. `compute_routing` computes the capacity on the host from the token count,
`topk = min(int(capacity_factor * T / E), T)`, takes `torch.topk(logits.T, k=topk)` (per expert, its C best
tokens: weights and token ids, each [E, C]), softmaxes the weights over the C chosen tokens (dim -1, in the
configured dtype) and asserts them finite. `apply_routing_on_experts` starts from `zeros_like(x)` and loops
`for i, expert in enumerate(self.experts)`: `token_idx = selected[i]` (the expert's C token ids, distinct),
`final_output[token_idx] += weights[i, :, None] * expert(x[token_idx])` (advanced-index read-add-write; a token
may be chosen by several experts, by none, or by all). The output is reshaped back to [B, L, D]. A token's weights
over the experts that chose it need not sum to one (each expert's softmax is over tokens, not experts). The "ff"
expert is `FeedForward`: biased `up` Linear(D, intermediate), `getattr(F, "silu")`, biased `down` Linear.
Left out: `TopkMoE` (the token-choice sibling) and the package's tests; the `"swiglu"` expert of `EXPERT_REGISTRY`
is kept but not used (its `down` expects the full intermediate width while `act(g) * u` has half of it, so it
fails on any input; the README and tests use `"ff"`). Nothing of the forward is left out.
Sizes: the README runs D 768, intermediate 3072, 8 experts, capacity 1.25 on 16 x 128 tokens; here D 16,
intermediate 8, 4 experts, capacity 1.25 on 7 tokens, so each expert takes int(1.25 * 7 / 4) = 2 tokens.
Constructs: expert-choice routing (`topk` over tokens of the transposed [E, T] logits, softmax over tokens), a
capacity computed with `int()`/`min()` from the token count, a raw-Parameter `x @ W` router, data-dependent
`assert torch.isfinite(t).all()` checks (twice), an ABC with abstract methods and a registry of expert classes,
`getattr(F, name)` activation lookup, `enumerate` over the experts with `selected[i]` rows, and an in-place
advanced-index `+=` into a `zeros_like` buffer.
"""

from __future__ import annotations

import typing as tp
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._shell import Source, tiny

SOURCE = Source(
    "jaisidhsingh/pytorch-mixtures",
    "pytorch_mixtures/expert_choice_moe.py",
    "9ec73e641e82c593e1e718951252fc7ecc3152e6",
    "ExpertChoiceMoE.apply_routing_on_experts",
)
HIDDEN, INTER, EXPERTS, CAPACITY = 16, 8, 4, 1.25


@dataclass
class MoEConfig:
    hidden_dim: int
    intermediate_dim: int
    num_experts: int
    expert_fn: str
    expert_act: str
    router_fn: tp.Literal["ec", "topk", "soft"] | None
    capacity_factor: float | None
    topk: int | None
    dtype: torch.dtype


# --- utils.py ----------------------------------------------------------------------------------------------


def _assert_no_nan(t: torch.Tensor, name: str) -> None:
    assert torch.isfinite(t).all(), f"{name} contains NaN/Inf"


class SwiGLU(nn.Module):
    def __init__(self, config: MoEConfig):
        super().__init__()
        self.cfg = config
        self.gate_up = nn.Linear(config.hidden_dim, config.intermediate_dim, bias=False)
        self.down = nn.Linear(config.intermediate_dim, config.hidden_dim)
        self.act = getattr(F, config.expert_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act(g) * u)


class FeedForward(nn.Module):
    def __init__(self, config: MoEConfig):
        super().__init__()
        self.cfg = config
        self.up = nn.Linear(config.hidden_dim, config.intermediate_dim)
        self.down = nn.Linear(config.intermediate_dim, config.hidden_dim)
        self.act = getattr(F, config.expert_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


EXPERT_REGISTRY = {"swiglu": SwiGLU, "ff": FeedForward}


# --- basic_moe.py ------------------------------------------------------------------------------------------


class MoE(ABC, nn.Module):
    def __init__(self, config: MoEConfig):
        super().__init__()
        self.cfg = config
        self.weight = nn.Parameter(torch.empty(config.hidden_dim, config.num_experts))
        nn.init.xavier_uniform_(self.weight)
        self.experts = nn.ModuleList(
            [EXPERT_REGISTRY[config.expert_fn](config) for _ in range(config.num_experts)]
        )

    @abstractmethod
    def compute_routing(self, router_logits: torch.Tensor) -> tp.Tuple[torch.Tensor]:  # noqa: UP006
        raise NotImplementedError("Must be implemented specific to one's desired routing scheme.")

    @abstractmethod
    def apply_routing_on_experts(
        self, x: torch.Tensor, weights: torch.Tensor, selected: torch.Tensor
    ) -> torch.Tensor:
        raise NotImplementedError("Must be implemented specific to one's desired routing scheme.")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, D = x.shape
        x = x.reshape(-1, D)
        router_logits = x @ self.weight
        _assert_no_nan(router_logits, "router_logits")
        weights, selected = self.compute_routing(router_logits)
        output = self.apply_routing_on_experts(x, weights, selected)
        output = output.reshape(B, L, D)
        return output


# --- expert_choice_moe.py ----------------------------------------------------------------------------------


class ExpertChoiceMoE(MoE):
    def compute_routing(self, router_logits: torch.Tensor) -> tp.Tuple[torch.Tensor]:  # noqa: UP006
        num_tokens = router_logits.shape[0]
        # each expert's capacity, from the token count
        topk = min(int(self.cfg.capacity_factor * num_tokens / self.cfg.num_experts), num_tokens)
        # experts choose tokens: the top-C tokens of each row of the [E, T] logits
        weights, selected_tokens = torch.topk(router_logits.T, k=topk)
        weights = F.softmax(weights, dim=-1, dtype=self.cfg.dtype)
        _assert_no_nan(weights, "ec_weights")
        return weights, selected_tokens

    def apply_routing_on_experts(
        self, x: torch.Tensor, weights: torch.Tensor, selected: torch.Tensor
    ) -> torch.Tensor:
        final_output = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            token_idx = selected[i]
            final_output[token_idx] += weights[i, :, None] * expert(x[token_idx])
        return final_output


CONFIG = MoEConfig(
    hidden_dim=HIDDEN,
    intermediate_dim=INTER,
    num_experts=EXPERTS,
    expert_fn="ff",
    expert_act="silu",
    router_fn="ec",
    capacity_factor=CAPACITY,
    topk=None,
    dtype=torch.float32,
)


def build():
    return tiny(lambda: ExpertChoiceMoE(CONFIG), HIDDEN)
