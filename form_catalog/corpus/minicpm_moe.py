"""MiniCPM-MoE-8x2B's remote-code `MiniCPMMoE`: float32 softmax top-2 renormalised, `moe_infer` over numpy offsets.

Mirrors the `modeling_minicpm.py` that OpenBMB shipped with openbmb/MiniCPM-MoE-8x2B for `trust_remote_code=True`
(transformers has no MiniCPM-MoE port; OpenBMB/MiniCPM on GitHub holds only the dense model's file), as vendored
by the GitHub repository guqiqi/Samoyeds at commit 6f1c117 (`model_config/MiniCPM/modeling_minicpm.py`:
`MiniCPMMLP.__init__` / `forward`, `AddAuxiliaryLoss`, `MiniCPMMoE.__init__` / `forward` / `moe_infer`, and the
MLP half of `MiniCPMDecoderLayer.forward`), with `model_config/MiniCPM/config.json` at the same commit for the
MoE fields (8 experts, `num_experts_per_tok` 2, `hidden_act` "silu", `scale_depth` 1.4).
`MiniCPMMoE.forward(hidden_states)` keeps the input shape and dtype, views the tokens [T, H], scores them with
the bias-free `gate` Linear, takes a softmax in float32 (`dtype=torch.float32`), `torch.topk(..., 2)`, divides
the two weights by their sum (no epsilon) and casts them back to the input dtype; the chosen ids are flattened
to [T * k] (`topk_idx_flat`). `if self.training` it repeats every token k times, fills `y[topk_idx_flat == i]`
expert by expert through boolean-mask gathers and index-puts, takes the weighted sum over k, and attaches a
load-balancing loss (`bincount(minlength=E)` load times mean probability) through `AddAuxiliaryLoss`.
Otherwise it calls `moe_infer(hidden_states, topk_idx_flat, expert_weights.view(-1, 1))`, decorated
`@torch.no_grad()`: a `zeros_like` buffer, `argsort` of the flat ids, `bincount()` (no minlength, so trailing
experts nobody chose are never visited) read to the host with `.cpu().numpy().cumsum(0)`, token rows
`idxs // num_experts_per_tok`, then `for i, end_idx in enumerate(tokens_per_expert)`: the start is the previous
offset (`0 if i == 0`), `if start_idx == end_idx: continue`, gather `x[exp_token_idx]`, run `self.experts[i]`,
scale in place with `mul_` by the sorted flat weights, and `scatter_reduce_(0, idx.view(-1, 1).repeat(1, H),
out, reduce='sum')` into the buffer. The result is viewed back to the input shape. The experts are SwiGLU MLPs
named w1 (gate), w3 (up), w2 (down) behind a config-valued `if self.config.pretraining_tp > 1` weight-slicing
branch (kept; the default is 1). The decoder layer adds the MoE output to the residual scaled by
`scale_depth / math.sqrt(num_hidden_layers)` (`MiniCPMDecoderLayerMLP` keeps that scaling; the shell adds).
Left out: attention, `MiniCPMRMSNorm` (the shell supplies the pre-MoE norm and the residual), the
`PretrainedConfig` base (a plain local class with the hub defaults), `ACT2FN` (its "silu" entry is `nn.SiLU()`),
weight init (the shell draws weights), caches. Nothing of the MoE forward was left out.
Sizes: MiniCPM-MoE-8x2B has hidden 2304, intermediate 5760, 8 experts, top-2, 40 layers (the vendored
config.json says 1 layer, cut down for the repository's benchmark); here hidden 16, intermediate 32, 8 experts,
top-2, `num_hidden_layers` 40 for the residual scale.
Constructs: float32 softmax + `topk` + renormalisation + dtype cast, an `if self.training` branch with
boolean-mask gathers / index-puts and a custom autograd Function, `@torch.no_grad()` on a helper method,
`argsort`, `bincount()` without minlength read to the host with `.cpu().numpy().cumsum(0)`, a loop
`for i, end_idx in enumerate(<numpy array>)` with numpy scalars as slice bounds and `if start_idx == end_idx:
continue`, tensor-index gathers, in-place `mul_` and `scatter_reduce_(..., reduce='sum')`, a config-valued
`pretraining_tp` branch in the expert, a residual-scale multiply in the decoder half.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("guqiqi/Samoyeds", "model_config/MiniCPM/modeling_minicpm.py",
                "6f1c117f5fca797f2b4e4171ea023d65260e9302", "MiniCPMMoE.forward")
HIDDEN, INTER, EXPERTS, TOP_K, NUM_LAYERS = 16, 32, 8, 2, 40


class MiniCPMConfig:
    """The MoE fields of the hub's `configuration_minicpm.MiniCPMConfig` (defaults as there, sizes tiny)."""

    def __init__(self, hidden_size=HIDDEN, intermediate_size=INTER, hidden_act="silu", num_hidden_layers=NUM_LAYERS,
                 pretraining_tp=1, scale_depth=1.4, num_experts=EXPERTS, num_experts_per_tok=TOP_K):
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.num_hidden_layers = num_hidden_layers
        self.pretraining_tp = pretraining_tp
        self.scale_depth = scale_depth
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok


ACT2FN = {"silu": nn.SiLU()}


class MiniCPMMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.w1 = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.w3 = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.w2 = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        if self.config.pretraining_tp > 1:
            slice = self.intermediate_size // self.config.pretraining_tp  # noqa: A001 - the original's name
            gate_proj_slices = self.w1.weight.split(slice, dim=0)
            up_proj_slices = self.w3.weight.split(slice, dim=0)
            down_proj_slices = self.w2.weight.split(slice, dim=1)

            gate_proj = torch.cat(
                [F.linear(x, gate_proj_slices[i]) for i in range(self.config.pretraining_tp)], dim=-1
            )
            up_proj = torch.cat([F.linear(x, up_proj_slices[i]) for i in range(self.config.pretraining_tp)], dim=-1)

            intermediate_states = (self.act_fn(gate_proj) * up_proj).split(slice, dim=2)
            down_proj = [
                F.linear(intermediate_states[i], down_proj_slices[i]) for i in range(self.config.pretraining_tp)
            ]
            down_proj = sum(down_proj)
        else:
            down_proj = self.w2(self.act_fn(self.w1(x)) * self.w3(x))

        return down_proj


class AddAuxiliaryLoss(torch.autograd.Function):
    """Adds the aux loss's gradient in backward; forward returns x unchanged."""

    @staticmethod
    def forward(ctx, x, loss):
        assert loss.numel() == 1
        ctx.dtype = loss.dtype
        ctx.required_aux_loss = loss.requires_grad
        return x

    @staticmethod
    def backward(ctx, grad_output):
        grad_loss = None
        if ctx.required_aux_loss:
            grad_loss = torch.ones(1, dtype=ctx.dtype, device=grad_output.device)
        return grad_output, grad_loss


class MiniCPMMoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.num_experts = config.num_experts
        self.num_experts_per_tok = config.num_experts_per_tok
        self.experts = nn.ModuleList(
            [MiniCPMMLP(config) for i in range(self.num_experts)]
        )
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.intermediate_size = config.intermediate_size

    def forward(self, hidden_states):
        orig_shape = hidden_states.shape
        orig_dtype = hidden_states.dtype
        hidden_states = hidden_states.view(-1, orig_shape[-1])
        token_num = hidden_states.shape[0]
        scores = self.gate(hidden_states)
        scores_prob = F.softmax(scores, dim=-1, dtype=torch.float32)
        expert_weights, expert_indices = torch.topk(scores_prob, self.num_experts_per_tok, dim=-1)
        expert_weights = expert_weights / expert_weights.sum(dim=-1, keepdim=True)
        topk_idx_flat = expert_indices.view(-1)
        expert_weights = expert_weights.to(orig_dtype)

        if self.training:
            hidden_states = hidden_states.repeat_interleave(self.num_experts_per_tok, dim=0)
            y = torch.empty_like(hidden_states)
            for i in range(self.num_experts):
                y[topk_idx_flat == i] = self.experts[i](hidden_states[topk_idx_flat == i])
            y = (y.view(*expert_weights.shape, -1) * expert_weights.unsqueeze(-1)).sum(dim=1)
            y = y.view(*orig_shape)

            load = expert_indices.view(-1).bincount(minlength=self.num_experts)
            load_mean = load / (token_num * self.num_experts_per_tok)
            importance_mean = scores_prob.mean(dim=0)
            balance_loss = self.num_experts * torch.sum(importance_mean * load_mean)

            y = AddAuxiliaryLoss.apply(y, balance_loss)
        else:
            y = self.moe_infer(hidden_states, topk_idx_flat, expert_weights.view(-1, 1)).view(*orig_shape)
        return y

    @torch.no_grad()
    def moe_infer(self, x, flat_expert_indices, flat_expert_weights):
        expert_cache = torch.zeros_like(x)
        idxs = flat_expert_indices.argsort()
        tokens_per_expert = flat_expert_indices.bincount().cpu().numpy().cumsum(0)
        token_idxs = idxs // self.num_experts_per_tok
        for i, end_idx in enumerate(tokens_per_expert):
            start_idx = 0 if i == 0 else tokens_per_expert[i - 1]
            if start_idx == end_idx:
                continue
            expert = self.experts[i]
            exp_token_idx = token_idxs[start_idx:end_idx]
            expert_tokens = x[exp_token_idx]
            expert_out = expert(expert_tokens)
            expert_out.mul_(flat_expert_weights[idxs[start_idx:end_idx]])
            expert_cache.scatter_reduce_(0, exp_token_idx.view(-1, 1).repeat(1, x.shape[-1]), expert_out, reduce="sum")
        return expert_cache


class MiniCPMDecoderLayerMLP(nn.Module):
    """The MLP half of `MiniCPMDecoderLayer.forward` after the post-attention norm: the MoE output, scaled as
    the decoder scales it before adding the residual (the shell adds the residual)."""

    def __init__(self, config):
        super().__init__()
        self.mlp = MiniCPMMoE(config)
        self.scale_depth = config.scale_depth
        self.num_hidden_layers = config.num_hidden_layers

    def forward(self, hidden_states):
        hidden_states = self.mlp(hidden_states)
        return hidden_states * (self.scale_depth / math.sqrt(self.num_hidden_layers))


def build():
    return tiny(lambda: MiniCPMDecoderLayerMLP(MiniCPMConfig()), HIDDEN)
