"""DeepSeek-MoE 16B's DeepseekMoE: cumulative bincount offsets read to numpy, scatter_reduce_ combine.

Mirrors goingshr-debug/SMoE `models/deepseekmoe/model_path/modeling_deepseek.py` at commit 5792f68 (`MoEGate`,
`AddAuxiliaryLoss`, `DeepseekMoE.forward`, `DeepseekMoE.moe_infer`, `DeepseekMLP`), a vendored copy of the
remote code shipped with deepseek-ai/deepseek-moe-16b (it stood in for OpenBMB's MiniCPM-MoE-8x2B remote code,
whose Python was not found among the stored copies at first; `minicpm_moe` mirrors it since). The gate scores a bias-free linear with a softmax, takes the
unsorted top-k, renormalises (+1e-20) only when top_k > 1 and `norm_topk_prob` (16B ships with it off), and
in training computes a sequence-level or token-level auxiliary loss. The layer flattens tokens and has a
training branch (repeat each token top_k times, `y[flat_idx == i] = expert(x[flat_idx == i])` for every
expert, weighted sum, `AddAuxiliaryLoss`) and an inference branch, `moe_infer` under `@torch.no_grad()`:
argsort the flat expert ids, `bincount()` them (no minlength, so trailing unused experts are never
visited), read to the host and `cumsum` with `.cpu().numpy().cumsum(0)`, then
`for i, end in enumerate(offsets)`: start is the previous offset, `if start == end: continue`, gather the
expert's tokens (`x[idxs[start:end] // top_k]`), run the expert, scale in place (`mul_`) by the matching
flat weights and add into a zero buffer with `scatter_reduce_(..., reduce="sum")`. The shared experts (one
MLP `n_shared_experts` times wider) are added. Left out: `pretraining_tp > 1` weight slicing in the MLP
(a training-time tensor-parallel emulation; the config value is 1).
Constructs: `@torch.no_grad()` on `moe_infer`, `if self.training` branch, `.cpu().numpy().cumsum(0)` offsets,
a loop `for i, end in enumerate(offsets)` with `if start == end: continue`, numpy scalars as slice bounds,
in-place `mul_` and `scatter_reduce_`, boolean-mask gathers/index-puts in the training branch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("goingshr-debug/SMoE", "models/deepseekmoe/model_path/modeling_deepseek.py",
                "5792f689f8c5235fd787d530c4a625fa371c0c5f", "DeepseekMoE.moe_infer")
HIDDEN, INTER, EXPERTS, TOP_K, SHARED = 16, 8, 8, 2, 2


class DeepseekMLP(nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEGate(nn.Module):
    def __init__(self, norm_topk_prob=False, alpha=0.001, seq_aux=True):
        super().__init__()
        self.top_k, self.n_routed_experts = TOP_K, EXPERTS
        self.norm_topk_prob, self.alpha, self.seq_aux = norm_topk_prob, alpha, seq_aux
        self.weight = nn.Parameter(torch.empty(EXPERTS, HIDDEN))

    def forward(self, hidden_states):
        bsz, seq_len, h = hidden_states.shape
        flat = hidden_states.view(-1, h)
        scores = F.linear(flat, self.weight, None).softmax(dim=-1)
        weight, idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        if self.top_k > 1 and self.norm_topk_prob:
            weight = weight / (weight.sum(dim=-1, keepdim=True) + 1e-20)

        if self.training and self.alpha > 0.0:
            idx_aux = idx.view(bsz, -1)
            if self.seq_aux:
                ce = torch.zeros(bsz, self.n_routed_experts, device=flat.device)
                ones = torch.ones(bsz, seq_len * self.top_k, device=flat.device)
                ce.scatter_add_(1, idx_aux, ones).div_(seq_len * self.top_k / self.n_routed_experts)
                aux = (ce * scores.view(bsz, seq_len, -1).mean(dim=1)).sum(dim=1).mean() * self.alpha
            else:
                ce = F.one_hot(idx_aux.view(-1), num_classes=self.n_routed_experts).float().mean(0)
                aux = (scores.mean(0) * ce * self.n_routed_experts).sum() * self.alpha
        else:
            aux = None
        return idx, weight, aux


class AddAuxiliaryLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, loss):
        assert loss.numel() == 1
        ctx.dtype, ctx.required_aux_loss = loss.dtype, loss.requires_grad
        return x

    @staticmethod
    def backward(ctx, grad_output):
        grad_loss = torch.ones(1, dtype=ctx.dtype, device=grad_output.device) if ctx.required_aux_loss else None
        return grad_output, grad_loss


class DeepseekMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts_per_tok = TOP_K
        self.experts = nn.ModuleList(DeepseekMLP(HIDDEN, INTER) for _ in range(EXPERTS))
        self.gate = MoEGate()
        self.n_shared_experts = SHARED
        self.shared_experts = DeepseekMLP(HIDDEN, INTER * SHARED)

    def forward(self, hidden_states):
        residual, shape = hidden_states, hidden_states.shape
        idx, weight, aux = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        flat_idx = idx.view(-1)
        if self.training:
            hidden_states = hidden_states.repeat_interleave(self.num_experts_per_tok, dim=0)
            y = torch.empty_like(hidden_states)
            for i, expert in enumerate(self.experts):
                y[flat_idx == i] = expert(hidden_states[flat_idx == i])
            y = (y.view(*weight.shape, -1) * weight.unsqueeze(-1)).sum(dim=1)
            y = AddAuxiliaryLoss.apply(y.view(*shape), aux)
        else:
            y = self.moe_infer(hidden_states, flat_idx, weight.view(-1, 1)).view(*shape)
        if self.n_shared_experts is not None:
            y = y + self.shared_experts(residual)
        return y

    @torch.no_grad()
    def moe_infer(self, x, flat_ids, flat_weights):
        out = torch.zeros_like(x)
        order = flat_ids.argsort()
        offsets = flat_ids.bincount().cpu().numpy().cumsum(0)
        token_of = order // self.num_experts_per_tok
        for i, end in enumerate(offsets):
            start = 0 if i == 0 else offsets[i - 1]
            if start == end:
                continue
            rows = token_of[start:end]
            y = self.experts[i](x[rows])
            y.mul_(flat_weights[order[start:end]])
            out.scatter_reduce_(0, rows.view(-1, 1).repeat(1, x.shape[-1]), y, reduce="sum")
        return out


def build():
    return tiny(DeepseekMoE, HIDDEN)
