"""DiT-MoE's `SparseMoeBlock`: DeepSeek-style gate and `moe_infer`, experts sliced `pretraining_tp` ways, shared expert.

Mirrors feizc/DiT-MoE `models.py` at commit bd34bbb (HEAD; the file last changed at 9010b64, "clean code")
(`MoEGate`, `AddAuxiliaryLoss`, `MoeMLP`, `SparseMoeBlock.forward`, `SparseMoeBlock.moe_infer`, and the MoE
wiring of `DiTBlock.__init__`). `DiTBlock` builds `SparseMoeBlock(hidden_size, mlp_ratio, num_experts,
num_experts_per_tok, pretraining_tp)`; `sample.py` uses `pretraining_tp=2` in float32 for DiT-S/2 and DiT-B/2
(the released 8-expert, top-2 "8E2A" checkpoints) and calls `model.eval()`. Every expert is a `MoeMLP`
(bias-free gate/up/down Linears, width `mlp_ratio * embed_dim`, SiLU); the layer also holds one shared `MoeMLP`
of width `embed_dim * n_shared_experts` (n_shared_experts fixed to 2 in `__init__`).
`MoeMLP.forward` with `pretraining_tp > 1` splits each weight into `pretraining_tp` slices (`weight.split`,
rows for gate/up, columns for down), runs list comprehensions of `F.linear` per slice, `torch.cat`s the gate
and up halves, splits `act(gate) * up` again and adds the per-slice down projections with Python's `sum` of
a list. `MoEGate.forward` views the tokens [T, h], takes `F.linear` with its own weight Parameter, a softmax
(a `scoring_func` string branch that raises otherwise), an unsorted `torch.topk` (`sorted=False`), no
renormalisation (`norm_topk_prob` False) and, only in training with alpha > 0, an auxiliary loss
(sequence-level or token-level); it returns (ids, weights, aux_loss) with aux_loss None in eval.
`SparseMoeBlock.forward` keeps the input as `identity`, flattens the tokens and the ids, and branches on
`self.training`: training repeats each token k times and fills `torch.empty_like` by a boolean-mask loop over
every expert (`y[ids == i] = expert(x[ids == i]).float()`), takes the weighted sum and passes it through
`AddAuxiliaryLoss.apply`; eval calls `moe_infer(x, flat_ids, weights.view(-1, 1))` and views back.
`moe_infer` (under `@torch.no_grad()`) argsorts the flat ids, `bincount()`s them (no minlength) and reads the
counts to the host with `.cpu().numpy().cumsum(0)`, maps sorted slots to tokens by `// k`, then
`for i, end_idx in enumerate(tokens_per_expert)`: start is the previous offset (numpy scalar),
`if start_idx == end_idx: continue`, gathers the expert's rows, runs `self.experts[i]`, scales the output in
place (`mul_`) by the sorted flat weights, re-casts the buffer with `.to(expert_out.dtype)` and adds rows with
`scatter_reduce_(0, idx.view(-1, 1).repeat(1, h), out, reduce="sum")`. The shared expert's output on the
un-flattened `identity` is added last.
Left out: the adaLN-Zero modulation around the layer in `DiTBlock.forward` (`x + gate_mlp.unsqueeze(1) *
moe(modulate(norm2(x), shift, scale))`, driven by the timestep/class embedding, which the shell does not carry;
the shell supplies a norm and the residual), the attention (timm or flash-attn), the patch/timestep/label
embedders, and the `.half()` cast that `sample.py` applies to DiT-XL/2 and DiT-G/2 (which also set
`pretraining_tp=1`). The training branch is kept but not reached in eval.
DiT-S/2 8E2A: hidden 384, mlp_ratio 4, 8 experts, top-2, pretraining_tp 2 (tiny here: hidden 16, expert width 64,
shared width 32, 8 experts, top-2, pretraining_tp 2).
Constructs: `@torch.no_grad()` on `moe_infer`, an `if self.training` branch, a string `scoring_func` branch,
`topk(sorted=False)`, `.cpu().numpy().cumsum(0)` offsets walked by `enumerate` with numpy-scalar slice bounds
and `if start == end: continue`, `bincount()` without minlength (trailing unused experts never visited),
in-place `mul_` and `scatter_reduce_`, `.to(dtype)` rebinding inside the loop, experts computed by
`weight.split` slices with list comprehensions, `torch.cat` and a Python `sum` over a list, a local
`import torch.nn.init` in `reset_parameters`, a custom `autograd.Function` in the training branch.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("feizc/DiT-MoE", "models.py", "bd34bbb2945280f0ccc2b1221f7dc8e3d6cce65d",
                "SparseMoeBlock.forward")
HIDDEN, MLP_RATIO, EXPERTS, TOP_K, PRETRAINING_TP = 16, 4, 8, 2, 2


class MoEGate(nn.Module):
    def __init__(self, embed_dim, num_experts=16, num_experts_per_tok=2, aux_loss_alpha=0.01):
        super().__init__()
        self.top_k = num_experts_per_tok
        self.n_routed_experts = num_experts

        self.scoring_func = "softmax"
        self.alpha = aux_loss_alpha
        self.seq_aux = False

        self.norm_topk_prob = False
        self.gating_dim = embed_dim
        self.weight = nn.Parameter(torch.empty((self.n_routed_experts, self.gating_dim)))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        import torch.nn.init as init
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, hidden_states):
        bsz, seq_len, h = hidden_states.shape
        hidden_states = hidden_states.view(-1, h)
        logits = F.linear(hidden_states, self.weight, None)
        if self.scoring_func == "softmax":
            scores = logits.softmax(dim=-1)
        else:
            raise NotImplementedError(f"insupportable scoring function for MoE gating: {self.scoring_func}")

        topk_weight, topk_idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)

        if self.top_k > 1 and self.norm_topk_prob:
            denominator = topk_weight.sum(dim=-1, keepdim=True) + 1e-20
            topk_weight = topk_weight / denominator

        if self.training and self.alpha > 0.0:
            scores_for_aux = scores
            aux_topk = self.top_k
            topk_idx_for_aux_loss = topk_idx.view(bsz, -1)
            if self.seq_aux:
                scores_for_seq_aux = scores_for_aux.view(bsz, seq_len, -1)
                ce = torch.zeros(bsz, self.n_routed_experts, device=hidden_states.device)
                ce.scatter_add_(1, topk_idx_for_aux_loss,
                                torch.ones(bsz, seq_len * aux_topk, device=hidden_states.device)).div_(
                    seq_len * aux_topk / self.n_routed_experts)
                aux_loss = (ce * scores_for_seq_aux.mean(dim=1)).sum(dim=1).mean() * self.alpha
            else:
                mask_ce = F.one_hot(topk_idx_for_aux_loss.view(-1), num_classes=self.n_routed_experts)
                ce = mask_ce.float().mean(0)
                Pi = scores_for_aux.mean(0)
                fi = ce * self.n_routed_experts
                aux_loss = (Pi * fi).sum() * self.alpha
        else:
            aux_loss = None
        return topk_idx, topk_weight, aux_loss


class AddAuxiliaryLoss(torch.autograd.Function):
    """Passes x through unchanged; backward hands the aux loss a gradient of ones."""

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


class MoeMLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size, pretraining_tp=2):
        super().__init__()
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn = nn.SiLU()
        self.pretraining_tp = pretraining_tp

    def forward(self, x):
        if self.pretraining_tp > 1:
            slice = self.intermediate_size // self.pretraining_tp
            gate_proj_slices = self.gate_proj.weight.split(slice, dim=0)
            up_proj_slices = self.up_proj.weight.split(slice, dim=0)
            down_proj_slices = self.down_proj.weight.split(slice, dim=1)

            gate_proj = torch.cat([F.linear(x, gate_proj_slices[i]) for i in range(self.pretraining_tp)], dim=-1)
            up_proj = torch.cat([F.linear(x, up_proj_slices[i]) for i in range(self.pretraining_tp)], dim=-1)

            intermediate_states = (self.act_fn(gate_proj) * up_proj).split(slice, dim=-1)
            down_proj = [F.linear(intermediate_states[i], down_proj_slices[i]) for i in range(self.pretraining_tp)]
            down_proj = sum(down_proj)
        else:
            down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj


class SparseMoeBlock(nn.Module):
    def __init__(self, embed_dim, mlp_ratio=4, num_experts=16, num_experts_per_tok=2, pretraining_tp=2):
        super().__init__()
        self.num_experts_per_tok = num_experts_per_tok
        self.experts = nn.ModuleList([
            MoeMLP(hidden_size=embed_dim, intermediate_size=mlp_ratio * embed_dim, pretraining_tp=pretraining_tp)
            for i in range(num_experts)
        ])
        self.gate = MoEGate(embed_dim=embed_dim, num_experts=num_experts, num_experts_per_tok=num_experts_per_tok)
        self.n_shared_experts = 2

        if self.n_shared_experts is not None:
            intermediate_size = embed_dim * self.n_shared_experts
            self.shared_experts = MoeMLP(hidden_size=embed_dim, intermediate_size=intermediate_size,
                                         pretraining_tp=pretraining_tp)

    def forward(self, hidden_states):
        identity = hidden_states
        orig_shape = hidden_states.shape
        topk_idx, topk_weight, aux_loss = self.gate(hidden_states)

        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        flat_topk_idx = topk_idx.view(-1)
        if self.training:
            hidden_states = hidden_states.repeat_interleave(self.num_experts_per_tok, dim=0)
            y = torch.empty_like(hidden_states, dtype=hidden_states.dtype)
            for i, expert in enumerate(self.experts):
                y[flat_topk_idx == i] = expert(hidden_states[flat_topk_idx == i]).float()
            y = (y.view(*topk_weight.shape, -1) * topk_weight.unsqueeze(-1)).sum(dim=1)
            y = y.view(*orig_shape)
            y = AddAuxiliaryLoss.apply(y, aux_loss)
        else:
            y = self.moe_infer(hidden_states, flat_topk_idx, topk_weight.view(-1, 1)).view(*orig_shape)
        if self.n_shared_experts is not None:
            y = y + self.shared_experts(identity)
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

            expert_cache = expert_cache.to(expert_out.dtype)
            expert_cache.scatter_reduce_(0, exp_token_idx.view(-1, 1).repeat(1, x.shape[-1]), expert_out,
                                         reduce="sum")
        return expert_cache


class DiTBlockMoE(nn.Module):
    """The MoE half of `DiTBlock`: builds `self.moe` as its `__init__` does (8 experts, top-2,
    pretraining_tp 2, as `sample.py` runs DiT-S/2 and DiT-B/2); the shell adds the norm and residual."""

    def __init__(self, hidden_size=HIDDEN, mlp_ratio=MLP_RATIO, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                 pretraining_tp=PRETRAINING_TP):
        super().__init__()
        self.moe = SparseMoeBlock(hidden_size, mlp_ratio, num_experts, num_experts_per_tok, pretraining_tp)

    def forward(self, x):
        return self.moe(x)


def build():
    return tiny(DiTBlockMoE, HIDDEN)
