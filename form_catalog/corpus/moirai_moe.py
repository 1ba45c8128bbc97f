"""Salesforce uni2ts Moirai-MoE `MoEFeedForward`: routing by `torch.cdist` to fixed centroids, a Mixtral-style expert loop.

Mirrors SalesforceAIResearch/uni2ts `src/uni2ts/module/ffn.py` at commit 8d2a08d (`FeedForward`,
`GatedLinearUnitFeedForward`, `MoEFeedForward.__init__`, `MoEFeedForward.forward`), with the MoE wiring of
`TransformerEncoder.__init__` / `TransformerEncoder.forward` / `TransformerEncoderLayer.forward` from
`src/uni2ts/module/transformer.py` at the same commit (`MoiraiMoEModule` in `src/uni2ts/model/moirai_moe/module.py`
builds the encoder with `use_moe=True`, `use_glu=True`, `activation=F.silu`).
With `use_moe` the encoder builds each layer's `ffn` as `partial(MoEFeedForward, num_experts=32,
num_experts_per_token=2, in_dim=d_model, hidden_dim=d_ff, out_dim=None, activation=F.silu, bias=False,
ffn_dropout_p=dropout_p)()` and registers a float64 buffer `centroid` [num_layers, 32, d_model]
(`torch.empty`, filled from the checkpoint); its forward loops `for idx, layer in enumerate(self.layers)` and
passes `centroid=self.centroid[idx]`, and the (pre-norm) layer calls `self.ffn(self.norm2(x), centroid=centroid)`.
Each expert is a `GatedLinearUnitFeedForward` (a `FeedForward` subclass whose `_in_proj` is
`activation(fc_gate(x)) * fc1(x)`; the shared `FeedForward.forward` then does
`dropout2(fc2(dropout1(_in_proj(x))))`; bias-free Linears, dropout p = 0).
`MoEFeedForward.forward(x, centroid)` has no learned gate: it flattens `x_squashed = x.view(-1, dim)`, moves the
centroid with `centroid.to(x.device).type_as(x)`, takes `x_temp` as `x` itself for 3-D input (a
`len(x.shape) > 3` branch views higher-rank input to 3-D), `unsqueeze(0).repeat`s the centroid to
[batch, experts, dim], computes `torch.cdist(x_temp, centroid)` (Euclidean distance of every token to every
expert centroid) and views it to [tokens, experts] as `gate_logits`. Then, as mistral-inference does:
`torch.topk(gate_logits, k)` (the k *largest* distances, as written upstream), a float32 softmax over the k
values cast back with `.type_as(x)`, `results = torch.zeros_like(x_squashed)`, and
`for i, expert in enumerate(self.experts)`: `batch_idx, nth_expert = torch.where(selected_experts == i)` and
`results[batch_idx] += weights[batch_idx, nth_expert, None] * expert(x_squashed[batch_idx])` (no empty-expert
skip); finally `results.view_as(x)`.
The layer takes Moirai's [*batch, time_len, d_model] directly, the shell's [B, S, H]; the outer `MoEEncoderFFN`
holds the centroid buffer and passes `centroid=self.centroid[idx]` as the encoder does.
Left out: nothing in the MoE path is distributed or kernel-backed. The attention block, RMSNorm, the
residual and the encoder's final norm sit outside the layer (the shell supplies the residual and a norm), as do
the patch embedding, scaler and distribution head of `MoiraiMoEModule`. The centroids are loaded from the
checkpoint upstream (`torch.empty` at construction); here `MoEEncoderFFN` fills the float64 buffer with
`torch.randn` at construction because the shell initialises parameters only. The jaxtyping annotations are dropped.
Moirai-MoE-1.0-R small / base (Hub configs): d_model 384 / 768, d_ff 512 / 1024, 6 / 12 layers, 32 experts,
top-2 (experts cut to 8 here, top-2 kept).
Constructs: a keyword tensor argument (`centroid=`) from a float64 buffer indexed by a Python int, `.to(device)`
+ `type_as` casts, a Python branch on `len(x.shape)`, `unsqueeze(0).repeat`, `torch.cdist` as the router
(no gate Linear), `torch.topk` (largest) + float32 softmax over the k values, an `enumerate(self.experts)` loop
with no skip, two-way `torch.where(ids == i)`, integer-index gathers of rows and of (row, slot) weights, an
indexed in-place `+=` (getitem, add, index_put), `view_as`, GLU experts through a subclass-overridden `_in_proj`,
eval-mode `nn.Dropout` modules.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("SalesforceAIResearch/uni2ts", "src/uni2ts/module/ffn.py",
                "8d2a08df4512ab3551e53dfbb7c147e95f06731b", "MoEFeedForward.forward")
HIDDEN, INTER, EXPERTS, TOP_K = 16, 32, 8, 2


class FeedForward(nn.Module):
    def __init__(
        self,
        in_dim: int,
        hidden_dim: int | None = None,
        out_dim: int | None = None,
        activation: Callable[[torch.Tensor], torch.Tensor] = F.gelu,
        bias: bool = True,
        ffn_dropout_p: float = 0.0,
    ):
        super().__init__()
        hidden_dim = hidden_dim or 4 * in_dim
        out_dim = out_dim or in_dim

        self.in_dim = in_dim
        self.hidden_dim = hidden_dim
        self.out_dim = out_dim
        self.bias = bias
        self.ffn_dropout_p = ffn_dropout_p

        self.fc1 = nn.Linear(in_dim, hidden_dim, bias=bias)
        self.fc2 = nn.Linear(hidden_dim, out_dim, bias=bias)
        self.dropout1 = nn.Dropout(ffn_dropout_p)
        self.dropout2 = nn.Dropout(ffn_dropout_p)
        self.activation = activation

    def forward(self, x, centroid=None):
        x = self._in_proj(x)
        return self.dropout2(self.fc2(self.dropout1(x)))

    def _in_proj(self, x):
        return self.activation(self.fc1(x))


class GatedLinearUnitFeedForward(FeedForward):
    def __init__(
        self,
        in_dim: int,
        hidden_dim: int | None = None,
        out_dim: int | None = None,
        activation: Callable[[torch.Tensor], torch.Tensor] = F.silu,
        bias: bool = True,
        ffn_dropout_p: float = 0.0,
    ):
        super().__init__(
            in_dim,
            hidden_dim=hidden_dim or self.adjust_hidden_dim(4 * in_dim),
            out_dim=out_dim,
            activation=activation,
            bias=bias,
            ffn_dropout_p=ffn_dropout_p,
        )
        self.fc_gate = nn.Linear(self.in_dim, self.hidden_dim, bias=self.bias)

    @staticmethod
    def adjust_hidden_dim(dim):
        return (int(dim * 2 / 3) + 7) // 8 * 8

    def _in_proj(self, x):
        return self.activation(self.fc_gate(x)) * self.fc1(x)


class MoEFeedForward(nn.Module):
    def __init__(
        self,
        num_experts: int,
        num_experts_per_token: int,
        in_dim: int,
        hidden_dim: int | None = None,
        out_dim: int | None = None,
        activation: Callable[[torch.Tensor], torch.Tensor] = F.silu,
        bias: bool = True,
        ffn_dropout_p: float = 0.0,
    ):
        super().__init__()
        self.num_experts = num_experts
        self.num_experts_per_token = num_experts_per_token

        self.experts = nn.ModuleList(
            [
                GatedLinearUnitFeedForward(
                    in_dim=in_dim,
                    hidden_dim=hidden_dim,
                    out_dim=out_dim,
                    activation=activation,
                    bias=bias,
                    ffn_dropout_p=ffn_dropout_p,
                )
                for _ in range(num_experts)
            ]
        )

    def forward(self, x, centroid=None):
        x_squashed = x.view(-1, x.shape[-1])

        centroid = centroid.to(x.device).type_as(x)
        if len(x.shape) > 3:
            x_temp = x.view(-1, x.shape[-2], x.shape[-1])
        else:
            x_temp = x
        centroid = centroid.unsqueeze(0).repeat(x_temp.shape[0], 1, 1)
        cdist = torch.cdist(x_temp, centroid)
        gate_logits = cdist.view(-1, cdist.shape[-1])

        weights, selected_experts = torch.topk(gate_logits, self.num_experts_per_token)
        weights = nn.functional.softmax(weights, dim=1, dtype=torch.float).type_as(x)

        results = torch.zeros_like(x_squashed)
        for i, expert in enumerate(self.experts):
            batch_idx, nth_expert = torch.where(selected_experts == i)
            results[batch_idx] += weights[batch_idx, nth_expert, None] * expert(x_squashed[batch_idx])

        results = results.view_as(x)
        return results


class MoEEncoderFFN(nn.Module):
    """The MoE part of uni2ts' `TransformerEncoder` for one layer: builds the `ffn` the way `use_moe=True` does,
    holds the float64 `centroid` buffer, and calls `ffn(x, centroid=self.centroid[idx])`; the shell supplies the
    pre-norm and the residual of `TransformerEncoderLayer.forward`."""

    def __init__(self, d_model=HIDDEN, d_ff=INTER, num_layers=1, dropout_p=0.0, activation=F.silu, idx=0):
        super().__init__()
        get_ffn = partial(
            MoEFeedForward,
            num_experts=EXPERTS,
            num_experts_per_token=TOP_K,
            in_dim=d_model,
            hidden_dim=d_ff,
            out_dim=None,
            activation=activation,
            bias=False,
            ffn_dropout_p=dropout_p,
        )
        # upstream: torch.empty(...), filled by the checkpoint; random centroids here (see the docstring)
        self.register_buffer("centroid", torch.randn(num_layers, EXPERTS, d_model, dtype=torch.float64))
        self.ffn = get_ffn()
        self.idx = idx

    def forward(self, x):
        return self.ffn(x, centroid=self.centroid[self.idx])


def build():
    return tiny(MoEEncoderFFN, HIDDEN)
