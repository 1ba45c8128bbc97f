"""optimum-habana's Gaudi DeepSeek-V2 MoE, training branch: a group-limited-greedy softmax gate (bf16 logits,
per-group max, top groups masked in, top-k over the survivors, sequence-level auxiliary loss) and a dense
"padded weights" loop that runs every token through every routed expert and scales each result by that
expert's scattered routing weight, plus always-on shared experts.

Mirrors huggingface/optimum-habana `optimum/habana/transformers/models/deepseek_v2/modeling_deepseek_v2.py` at
commit 1d8504c6c7666a19d71968dba50976dceaf7c6b6 (the repository's newest stored commit; the file last changed in
859a008): `DeepseekV2MLP`, `MoEGate` (`forward`, including its aux-loss block), `AddAuxiliaryLoss` (an
`autograd.Function` that returns x unchanged and hands the loss a ones-gradient) and `DeepseekV2MoE.forward`.
`DeepseekV2MoE.forward` branches on `self.training`: the eval branch slices the experts into groups of
`SLICE_MAX_EXPERT` and calls `torch.ops.hpu.mixture_of_experts` per slice with `htcore.mark_step()` between, then
all-reduces; that branch was left out. The `self.training` branch (mirrored) is pure torch: `torch.zeros` +
`scatter_` of the top-k weights into [T, E], `reshape(-1, S, E).permute(2, 0, 1).unsqueeze(-1)` to [E, B, S, 1],
and `for i, expert in enumerate(self.experts)` adding `expert(hidden_states).reshape(-1, S, D) * padded[i]`
out of place, then `AddAuxiliaryLoss.apply`. To reach it, build() puts the MoE layers (gate included) in train
mode; the model has no dropout, so train mode changes nothing else, and the gate's aux loss (`self.training and
alpha > 0`, seq_aux: `scatter_add_` of ones into [B, E], `.div_`, a mean-weighted sum) is computed as written.
Config follows DeepSeek-V2 (`topk_method="group_limited_greedy"`, `norm_topk_prob=False` so weights are scaled by
`routed_scaling_factor`, here 1.0 as in V2-Lite rather than V2's 16.0; `aux_loss_alpha=0.001`, `seq_aux=True`,
silu, shared experts). `ACT2FN["silu"]` is `nn.SiLU()` here. Left out: the eval/HPU branch, expert parallelism
(`ep_size > 1` builds `None` experts off-rank), DeepSpeed all-reduce, attention, weight init.
Constructs: `view(-1, h)`, `F.linear` on `.type(torch.bfloat16)` casts then `.to(float32)`, softmax with dtype,
`.max(dim=-1).values` per group, two `topk(sorted=True)`, `zeros_like` + `scatter_` group mask,
`unsqueeze.expand.reshape` to an expert mask, `masked_fill(~mask.bool(), 0.0)`, Python branches on config
strings and `self.training`, in-place `scatter_add_`/`div_`, `torch.ones` with device, a dense loop over an
`nn.ModuleList`, a custom `autograd.Function`, a shared-expert add on the un-flattened input.
Sizes: hidden 16, moe intermediate 8, 8 routed experts in 4 groups (top 2 groups), top-2, 2 shared experts
(intermediate 16), 7 tokens, batch 1, one layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("huggingface/optimum-habana",
                "optimum/habana/transformers/models/deepseek_v2/modeling_deepseek_v2.py",
                "1d8504c6c7666a19d71968dba50976dceaf7c6b6", "DeepseekV2MoE.forward")
HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 8, 2


@dataclass
class DeepseekV2Config:
    """The fields the MoE layer reads (DeepSeek-V2's routing choices, sizes tiny)."""

    hidden_size: int = HIDDEN
    intermediate_size: int = 4 * HIDDEN
    moe_intermediate_size: int = INTER
    n_routed_experts: int = EXPERTS
    n_shared_experts: int | None = 2
    num_experts_per_tok: int = TOP_K
    routed_scaling_factor: float = 1.0
    scoring_func: str = "softmax"
    topk_method: str = "group_limited_greedy"
    n_group: int = 4
    topk_group: int = 2
    norm_topk_prob: bool = False
    aux_loss_alpha: float = 0.001
    seq_aux: bool = True
    hidden_act: str = "silu"


ACT2FN = {"silu": nn.SiLU()}


class DeepseekV2MLP(nn.Module):
    def __init__(self, config, hidden_size=None, intermediate_size=None):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size if hidden_size is None else hidden_size
        self.intermediate_size = config.intermediate_size if intermediate_size is None else intermediate_size

        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj


class MoEGate(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.top_k = config.num_experts_per_tok
        self.n_routed_experts = config.n_routed_experts
        self.routed_scaling_factor = config.routed_scaling_factor
        self.scoring_func = config.scoring_func
        self.alpha = config.aux_loss_alpha
        self.seq_aux = config.seq_aux
        self.topk_method = config.topk_method
        self.n_group = config.n_group
        self.topk_group = config.topk_group

        # topk selection algorithm
        self.norm_topk_prob = config.norm_topk_prob
        self.gating_dim = config.hidden_size
        self.weight = nn.Parameter(torch.empty((self.n_routed_experts, self.gating_dim)))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, hidden_states):
        bsz, seq_len, h = hidden_states.shape
        # compute gating score
        hidden_states = hidden_states.view(-1, h)

        logits = F.linear(hidden_states.type(torch.bfloat16), self.weight.type(torch.bfloat16), None).to(
            dtype=torch.float32
        )
        if self.scoring_func == "softmax":
            scores = logits.softmax(dim=-1, dtype=torch.float32)
        else:
            raise NotImplementedError(f"insupportable scoring function for MoE gating: {self.scoring_func}")

        # select top-k experts
        if self.topk_method == "greedy":
            topk_weight, topk_idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=True)
        elif self.topk_method == "group_limited_greedy":
            group_scores = scores.view(bsz * seq_len, self.n_group, -1).max(dim=-1).values  # [n, n_group]
            group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=True)[1]  # [n, top_k_group]
            group_mask = torch.zeros_like(group_scores)  # [n, n_group]
            group_mask.scatter_(1, group_idx, 1)  # [n, n_group]
            score_mask = (
                group_mask.unsqueeze(-1)
                .expand(bsz * seq_len, self.n_group, self.n_routed_experts // self.n_group)
                .reshape(bsz * seq_len, -1)
            )  # [n, e]
            tmp_scores = scores.masked_fill(~score_mask.bool(), 0.0)  # [n, e]
            topk_weight, topk_idx = torch.topk(tmp_scores, k=self.top_k, dim=-1, sorted=True)

        # norm gate to sum 1
        if self.top_k > 1 and self.norm_topk_prob:
            denominator = topk_weight.sum(dim=-1, keepdim=True) + 1e-20
            topk_weight = topk_weight / denominator
        else:
            topk_weight = topk_weight * self.routed_scaling_factor
        # expert-level computation auxiliary loss
        if self.training and self.alpha > 0.0:
            scores_for_aux = scores
            aux_topk = self.top_k
            topk_idx_for_aux_loss = topk_idx.view(bsz, -1)
            if self.seq_aux:
                scores_for_seq_aux = scores_for_aux.view(bsz, seq_len, -1)
                ce = torch.zeros(bsz, self.n_routed_experts, device=hidden_states.device)
                ce.scatter_add_(
                    1,
                    topk_idx_for_aux_loss,
                    torch.ones(bsz, seq_len * aux_topk, device=hidden_states.device),
                ).div_(seq_len * aux_topk / self.n_routed_experts)
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
    """Returns x as is; in backward, gives the aux loss a gradient of ones so it trains the gate."""

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


class DeepseekV2MoE(nn.Module):
    """A mixed expert module containing shared experts (single rank: ep_size 1)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.num_experts_per_tok = config.num_experts_per_tok
        self.ep_size = 1
        self.experts_per_rank = config.n_routed_experts
        self.ep_rank = 0
        self.experts = nn.ModuleList(
            [DeepseekV2MLP(config, intermediate_size=config.moe_intermediate_size)
             for i in range(config.n_routed_experts)]
        )
        self.gate = MoEGate(config)
        if config.n_shared_experts is not None:
            intermediate_size = config.moe_intermediate_size * config.n_shared_experts
            self.shared_experts = DeepseekV2MLP(config=config, intermediate_size=intermediate_size)

    def forward(self, hidden_states):
        identity = hidden_states
        orig_shape = hidden_states.shape
        topk_idx, topk_weight, aux_loss = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        # we cast back to the input dtype
        topk_weight = topk_weight.to(hidden_states.dtype)
        batch = orig_shape[0]
        sequence_length = orig_shape[1]
        hidden_dim = orig_shape[2]
        if self.training:
            padded_weights = torch.zeros(
                (batch * sequence_length, self.config.n_routed_experts),
                dtype=topk_weight.dtype,
                device=topk_weight.device,
            )
            padded_weights.scatter_(-1, topk_idx, topk_weight)
            padded_weights = padded_weights.reshape(-1, sequence_length, self.config.n_routed_experts)
            padded_weights = padded_weights.permute(2, 0, 1).unsqueeze(-1)

            final_hidden_states = torch.zeros(
                (batch, sequence_length, hidden_dim), dtype=hidden_states.dtype, device=hidden_states.device
            )
            for i, expert in enumerate(self.experts):
                current_hidden_state = expert(hidden_states)
                current_padded_weight = padded_weights[i]
                final_hidden_states = (
                    final_hidden_states
                    + current_hidden_state.reshape(-1, sequence_length, hidden_dim) * current_padded_weight
                )
            final_hidden_states = final_hidden_states.type(hidden_states.dtype)
            final_hidden_states = final_hidden_states.view(*orig_shape)
            final_hidden_states = AddAuxiliaryLoss.apply(final_hidden_states, aux_loss)
        else:
            # eval: per-slice torch.ops.hpu.mixture_of_experts + mark_step + all-reduce (left out)
            raise NotImplementedError("the eval branch calls torch.ops.hpu.mixture_of_experts")

        if self.config.n_shared_experts is not None:
            final_hidden_states = final_hidden_states + self.shared_experts(identity)

        return final_hidden_states


def build():
    model, inputs = tiny(lambda: DeepseekV2MoE(DeepseekV2Config()), HIDDEN)
    for moe in model.moes:
        moe.train()  # the pure-torch branch is DeepseekV2MoE's `self.training` one
    return model, inputs
