"""OpenNMT-py's MoE: top-k over raw gate logits, softmax of the k, repeat_interleave + per-expert mask loop.

Mirrors OpenNMT/OpenNMT-py `onmt/modules/moe.py` at commit 97111d9 (`MoE`), with the experts it builds from
`onmt/modules/position_ffn.py` (`PositionwiseFeedForward`, `ActivationFunction`, `ACTIVATION_FUNCTIONS`) and
`onmt/modules/rmsnorm.py` (`RMSNorm`), configured as `tools/convert_HF.py` sets up Mixtral (RMS norm, silu
with a `w_3` gate, no FFN biases, no parallel residual, dropout 0.0). The layer flattens [B, S, H] to tokens,
scores them with a bias-free `nn.Linear` gate, takes `torch.topk` of the raw logits and applies a softmax to
the k picked logits only (no renormalisation step), flattens the expert ids, duplicates every token k times
with `repeat_interleave`, and fills an `empty_like` buffer: for each expert, `if torch.any(ids == i)` (a
tensor truth value), the boolean-mask rows are gathered, given a leading unit axis with `unsqueeze(0)`, run
through the expert, and written back with a boolean-mask index-put (the [1, n, H] result lands in [n, H]
rows). The buffer is viewed as [T, k, H], multiplied by the weights and summed over k, and reshaped to the
input's shape. Each expert is a whole pre-norm FFN block: its own RMSNorm (input cast to float32, `pow(2)
.mean`, `rsqrt`, cast back to the weight's dtype, times the weight), `w_1`, silu, an in-place `mul_` by
`w_3`, `w_2`, each Linear called through a `maybe_ckpt` lambda, dropouts behind `if self.dropout_p > 0`,
and it returns `inter + x`: the residual is added inside every expert, before the weighted sum (the
softmax weights sum to 1, so the layer's output carries its own input, as OpenNMT's decoder expects).
Left out: the tensor-parallel pieces (`parallel_gpu > 1`: the `all_reduce` of the gate scores and of each
expert's output, and the `d_ff // parallel_gpu` split), reduced to their one-process form; RMSNorm's
`awq_ext` fused-kernel branch (an optional CUDA extension; the plain torch path is mirrored); `skip_init` is
kept but its weights are drawn by the corpus shell; `update_dropout`. Mixtral has 8 experts, top-2.
Constructs: `x.repeat_interleave(k, dim=0)` token duplication, a loop `for i, expert in
enumerate(self.experts)` with `if torch.any(flat_expert_indices == i)` (a data-dependent branch on a
tensor), boolean-mask gathers and a boolean-mask index-put into `empty_like`, `unsqueeze(0)` on the expert
input, an in-place `inter.mul_(...)` inside each expert, per-expert norm and residual, float32 casts in
the norm, a lambda attribute called in forward, config branches (`parallel_residual`, `w_3 is not None`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init
from torch.utils.checkpoint import checkpoint

from ._shell import Source, tiny

SOURCE = Source(
    "OpenNMT/OpenNMT-py",
    "onmt/modules/moe.py",
    "97111d97551c24857076a4102eabdb468b35cff4",
    "MoE.forward",
)
HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 8, 2


class ActivationFunction:
    relu = "relu"
    gelu = "gelu"
    silu = "silu"
    gated_gelu = "gated-gelu"


ACTIVATION_FUNCTIONS = {
    ActivationFunction.relu: F.relu,
    ActivationFunction.gelu: F.gelu,
    ActivationFunction.silu: F.silu,
    ActivationFunction.gated_gelu: F.gelu,
}


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, hidden_states):
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        hidden_states = hidden_states.to(self.weight.dtype)
        return hidden_states * self.weight


class PositionwiseFeedForward(nn.Module):
    def __init__(
        self,
        d_model,
        d_ff,
        dropout=0.1,
        activation_fn=ActivationFunction.relu,
        add_ffnbias=True,
        parallel_residual=False,
        layer_norm="standard",
        norm_eps=1e-6,
        use_ckpting=(),
    ):
        super().__init__()
        self.w_1 = skip_init(nn.Linear, in_features=d_model, out_features=d_ff, bias=add_ffnbias)
        self.w_2 = skip_init(nn.Linear, in_features=d_ff, out_features=d_model, bias=add_ffnbias)
        if layer_norm == "standard" and not parallel_residual:
            self.layer_norm = nn.LayerNorm(d_model, eps=norm_eps)
        elif layer_norm == "rms" and not parallel_residual:
            self.layer_norm = RMSNorm(d_model, eps=norm_eps)
        elif not parallel_residual:
            raise ValueError(f"unsupported layer norm {layer_norm}")
        self.parallel_residual = parallel_residual
        self.dropout_p = dropout
        self.dropout_1 = nn.Dropout(dropout)
        self.dropout_2 = nn.Dropout(dropout)
        self.activation = ACTIVATION_FUNCTIONS[activation_fn]
        if activation_fn in ("silu", "gated-gelu"):
            self.w_3 = skip_init(nn.Linear, in_features=d_model, out_features=d_ff, bias=add_ffnbias)
        else:
            self.w_3 = None
        self.maybe_ckpt = checkpoint if "ffn" in use_ckpting else lambda f, x: f(x)

    def forward(self, x):
        if not self.parallel_residual:
            norm_x = self.layer_norm(x)
        else:
            norm_x = x.clone()
        inter = self.maybe_ckpt(self.w_1, norm_x)
        inter = self.activation(inter)
        if self.w_3 is not None:
            inter.mul_(self.maybe_ckpt(self.w_3, norm_x))
        if self.dropout_p > 0:
            inter = self.dropout_1(inter)
        inter = self.maybe_ckpt(self.w_2, inter)
        if self.dropout_p > 0:
            inter = self.dropout_2(inter)
        return inter + x


class MoE(nn.Module):
    def __init__(
        self,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        d_model=HIDDEN,
        d_ff=INTER,
        dropout=0.0,
        pos_ffn_activation_fn=ActivationFunction.silu,
        add_ffnbias=False,
        parallel_residual=False,
        layer_norm="rms",
        norm_eps=1e-5,
        use_ckpting=(),
    ):
        super().__init__()
        self.experts = nn.ModuleList(
            PositionwiseFeedForward(
                d_model,
                d_ff,
                dropout,
                pos_ffn_activation_fn,
                add_ffnbias,
                parallel_residual,
                layer_norm,
                norm_eps,
                use_ckpting=use_ckpting,
            )
            for _ in range(num_experts)
        )
        self.gate = nn.Linear(d_model, num_experts, bias=False)
        self.num_experts_per_tok = num_experts_per_tok

    def forward(self, x):
        orig_shape = x.shape
        x = x.view(-1, x.shape[-1])

        scores = self.gate(x)
        expert_weights, expert_indices = torch.topk(scores, self.num_experts_per_tok, dim=-1)
        expert_weights = expert_weights.softmax(dim=-1)
        flat_expert_indices = expert_indices.view(-1)

        x = x.repeat_interleave(self.num_experts_per_tok, dim=0)
        y = torch.empty_like(x)
        for i, expert in enumerate(self.experts):
            if torch.any(flat_expert_indices == i):
                y[flat_expert_indices == i] = expert(x[flat_expert_indices == i].unsqueeze(0))
        y = (y.view(*expert_weights.shape, -1) * expert_weights.unsqueeze(-1)).sum(dim=1)
        return y.view(*orig_shape)


def build():
    return tiny(MoE, HIDDEN)
