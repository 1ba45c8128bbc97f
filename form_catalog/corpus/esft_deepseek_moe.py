"""ESFT's DeepseekV2MoE: float32 gate, repeat_interleave + boolean-mask expert loop in eval too, dtype-bridging MLP.

Mirrors deepseek-ai/ESFT `deepseek/modeling_deepseek.py` at commit 579a771 (`DeepseekV2MLP`, `MoEGate`,
`AddAuxiliaryLoss`, `DeepseekV2MoE.forward`, `DeepseekV2MoE.moe_ep`), the DeepSeek-V2(-Lite) remote code as
ESFT (expert-specialised fine-tuning) rewrote it; it stands in for lmdeploy's PyTorch-engine MoE, because
lmdeploy's default (non-CUDA) backend has no pure-torch fused MoE (`backends/default/moe.py` only holds the
softmax top-k, and `OpType.FusedMoE` is not supported there). The gate flattens [B, S, H] to tokens and
scores them with `F.linear` on float32 copies of both the input and its weight, takes a float32 softmax
(any other `scoring_func` raises), then picks experts by `topk_method`: "greedy" is the unsorted top-k;
"group_limited_greedy" takes each group's max, keeps the `topk_group` best groups through a
`scatter_`-built mask, zeroes the other experts' scores with `masked_fill` and takes the unsorted top-k of
that. With top_k > 1 and `norm_topk_prob` the weights are divided by their sum + 1e-20, otherwise they are
multiplied by `routed_scaling_factor` (V2-Lite: norm off, factor 1.0). In training with `aux_loss_alpha > 0`
a sequence-level (`scatter_add_` of ones, in-place `div_`) or token-level (`one_hot` mean) balance loss is
computed, else the loss is None. The layer keeps its input for the shared experts, flattens tokens and
expert ids and, with one expert-parallel rank, repeats every token top_k times (`repeat_interleave`) and
fills an `empty_like` buffer expert by expert with `y[flat_topk_idx == i] = expert(x[flat_topk_idx == i])`
in train and eval alike (ESFT dropped upstream's `moe_infer`); the rows are weighted and summed over the
top-k axis, cast back to the input dtype and reshaped; in training the loss is attached by the
`AddAuxiliaryLoss` autograd function; the shared experts (one MLP `n_shared_experts` times wider) are added.
Each MLP casts its input to its own weight dtype and the result back when they differ (ESFT's fp32
trainable experts beside bf16 frozen ones). With several ranks the layer would call `moe_ep` instead:
count tokens per expert (`scatter_` of ones, sum), argsort the flat ids, gather `x[idxs // top_k]`, read
the counts to numpy, loop `for i, n in enumerate(counts)` skipping empty experts and slicing with a
running start, `torch.cat` the outputs (or `new_empty(0)`) and un-permute with `y[idxs] = outs`.
Left out: expert parallelism, i.e. the `ep_size > 1` construction (experts of other ranks as None,
`dist.get_rank()`) and `moe_ep`'s `all_to_all_single` / `All2All` exchange blocks; in one process
`ep_size` is 1, so `forward` takes the mask loop and `moe_ep` keeps only its local body (never reached
here). `PretrainedConfig` and the attention/rope fields become a small local config; `ACT2FN["silu"]` is
`nn.SiLU()`. The config class's default `topk_method` is the typo 'gready' (matches neither branch); the
shipped V2-Lite config says "greedy", used here. The real model has 64 experts, top-6, 2 shared.
Constructs: float32 gate with `.type()` casts, `topk_method` / `norm_topk_prob` / `if self.training`
branches, `if self.ep_size == 1` dispatch, boolean-mask gathers and index-puts in a loop over all experts,
`repeat_interleave`, a dtype-comparing `if` in the MLP, a custom autograd.Function in training; in the
unreached `moe_ep`: `.cpu().numpy()` counts, empty-expert `continue`, running slice bounds, `torch.cat`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import torch.nn.init as init
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("deepseek-ai/ESFT", "deepseek/modeling_deepseek.py",
                "579a7711e4b332b4c57b47e378a0cf240d85caa6", "DeepseekV2MoE.forward")
HIDDEN, INTER, EXPERTS, TOP_K, SHARED = 16, 8, 8, 2, 2


class DeepseekV2Config:
    def __init__(self, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, moe_intermediate_size=INTER,
                 n_shared_experts=SHARED, n_routed_experts=EXPERTS, ep_size=1, routed_scaling_factor=1.0,
                 topk_method="greedy", n_group=1, topk_group=1, num_experts_per_tok=TOP_K,
                 norm_topk_prob=False, scoring_func="softmax", aux_loss_alpha=0.001, seq_aux=True,
                 hidden_act="silu"):
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.moe_intermediate_size = moe_intermediate_size
        self.n_shared_experts, self.n_routed_experts = n_shared_experts, n_routed_experts
        self.ep_size, self.routed_scaling_factor = ep_size, routed_scaling_factor
        self.topk_method, self.n_group, self.topk_group = topk_method, n_group, topk_group
        self.num_experts_per_tok, self.norm_topk_prob = num_experts_per_tok, norm_topk_prob
        self.scoring_func, self.aux_loss_alpha, self.seq_aux = scoring_func, aux_loss_alpha, seq_aux
        self.hidden_act = hidden_act


class DeepseekV2MLP(nn.Module):
    def __init__(self, config, hidden_size=None, intermediate_size=None):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size if hidden_size is None else hidden_size
        self.intermediate_size = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        if x.dtype != self.up_proj.weight.dtype:
            in_dtype = x.dtype
            x = x.to(self.up_proj.weight.dtype)
            out = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
            out = out.to(in_dtype)
        else:
            out = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return out


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
        self.norm_topk_prob = config.norm_topk_prob
        self.gating_dim = config.hidden_size
        self.weight = nn.Parameter(torch.empty((self.n_routed_experts, self.gating_dim)))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, hidden_states):
        bsz, seq_len, h = hidden_states.shape
        hidden_states = hidden_states.view(-1, h)
        logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32), None)
        if self.scoring_func == "softmax":
            scores = logits.softmax(dim=-1, dtype=torch.float32)
        else:
            raise NotImplementedError(f"unsupported scoring function for MoE gating: {self.scoring_func}")

        if self.topk_method == "greedy":
            topk_weight, topk_idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        elif self.topk_method == "group_limited_greedy":
            group_scores = scores.view(bsz * seq_len, self.n_group, -1).max(dim=-1).values
            group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores)
            group_mask.scatter_(1, group_idx, 1)
            score_mask = (
                group_mask.unsqueeze(-1)
                .expand(bsz * seq_len, self.n_group, self.n_routed_experts // self.n_group)
                .reshape(bsz * seq_len, -1)
            )
            tmp_scores = scores.masked_fill(~score_mask.bool(), 0.0)
            topk_weight, topk_idx = torch.topk(tmp_scores, k=self.top_k, dim=-1, sorted=False)

        if self.top_k > 1 and self.norm_topk_prob:
            denominator = topk_weight.sum(dim=-1, keepdim=True) + 1e-20
            topk_weight = topk_weight / denominator
        else:
            topk_weight = topk_weight * self.routed_scaling_factor

        if self.training and self.alpha > 0.0:
            scores_aux, k_aux = scores, self.top_k
            idx_aux = topk_idx.view(bsz, -1)
            if self.seq_aux:
                seq_scores = scores_aux.view(bsz, seq_len, -1)
                ce = torch.zeros(bsz, self.n_routed_experts, device=hidden_states.device)
                ce.scatter_add_(
                    1, idx_aux, torch.ones(bsz, seq_len * k_aux, device=hidden_states.device)
                ).div_(seq_len * k_aux / self.n_routed_experts)
                aux_loss = (ce * seq_scores.mean(dim=1)).sum(dim=1).mean() * self.alpha
            else:
                ce = F.one_hot(idx_aux.view(-1), num_classes=self.n_routed_experts).float().mean(0)
                p_mean = scores_aux.mean(0)
                f_load = ce * self.n_routed_experts
                aux_loss = (p_mean * f_load).sum() * self.alpha
        else:
            aux_loss = None
        return topk_idx, topk_weight, aux_loss


class AddAuxiliaryLoss(torch.autograd.Function):
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
    def __init__(self, config: DeepseekV2Config | None = None):
        super().__init__()
        config = config or DeepseekV2Config()
        self.config = config
        self.num_experts_per_tok = config.num_experts_per_tok
        self.n_routed_experts = config.n_routed_experts
        self.ep_size = 1
        self.experts_per_rank = config.n_routed_experts
        self.ep_rank = 0
        self.experts = nn.ModuleList(
            [DeepseekV2MLP(config, intermediate_size=config.moe_intermediate_size)
             for _ in range(config.n_routed_experts)]
        )
        self.gate = MoEGate(config)
        if config.n_shared_experts is not None:
            shared_size = config.moe_intermediate_size * config.n_shared_experts
            self.shared_experts = DeepseekV2MLP(config=config, intermediate_size=shared_size)

    def forward(self, hidden_states):
        identity = hidden_states
        orig_shape = hidden_states.shape
        topk_idx, topk_weight, aux_loss = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        flat_topk_idx = topk_idx.view(-1)
        if self.ep_size == 1:
            hidden_states = hidden_states.repeat_interleave(self.num_experts_per_tok, dim=0)
            y = torch.empty_like(hidden_states)
            for i, expert in enumerate(self.experts):
                y[flat_topk_idx == i] = expert(hidden_states[flat_topk_idx == i])
        else:
            y = self.moe_ep(hidden_states, topk_idx)
        y = (y.view(*topk_weight.shape, -1) * topk_weight.unsqueeze(-1)).sum(dim=1)
        y = y.to(hidden_states.dtype).view(*orig_shape)
        if self.training:
            y = AddAuxiliaryLoss.apply(y, aux_loss)
        if self.config.n_shared_experts is not None:
            y = y + self.shared_experts(identity)
        return y

    def moe_ep(self, x, topk_ids):
        counts = topk_ids.new_zeros((topk_ids.shape[0], self.n_routed_experts))
        counts.scatter_(1, topk_ids, 1)
        tokens_per_expert = counts.sum(dim=0)
        idxs = topk_ids.view(-1).argsort()
        sorted_tokens = x[idxs // self.num_experts_per_tok]
        tokens_per_expert = tokens_per_expert.cpu().numpy()

        outputs = []
        start_idx = 0
        for i, num_tokens in enumerate(tokens_per_expert):
            if num_tokens == 0:
                continue
            end_idx = start_idx + num_tokens
            expert = self.experts[i + self.ep_rank * self.experts_per_rank]
            outputs.append(expert(sorted_tokens[start_idx:end_idx]))
            start_idx = end_idx

        outs = torch.cat(outputs, dim=0) if len(outputs) else sorted_tokens.new_empty(0)
        y = torch.empty_like(outs)
        y[idxs] = outs
        return y


def build():
    return tiny(DeepseekV2MoE, HIDDEN)
