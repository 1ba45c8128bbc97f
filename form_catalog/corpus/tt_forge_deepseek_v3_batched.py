"""tt-forge's DeepSeek-V3 loader: `moe_infer` patched to run every expert on every token with `bmm`.

Mirrors tenstorrent/tt-forge-models `deepseek/deepseek_v3/pytorch/loader.py` at commit 1eec8a6
(`_patch_moe_layers` and the `_batched_moe_infer` it defines), which the loader assigns over
`type(module).moe_infer` of every module that has `moe_infer` and `experts_per_rank` (DeepSeek-V3's
`DeepseekV3MoE`) after loading `yujiepan/deepseek-v3-tiny-random` with `trust_remote_code`. The module
around it is DeepSeek-V3's Hugging Face remote code `modeling_deepseek.py` (`MoEGate`, `DeepseekV3MoE`,
`DeepseekV3MLP`), read from a stored copy. The gate scores the flattened tokens with a float32 linear and a
sigmoid, adds `e_score_correction_bias` for the choice only ("noaux_tc"), sums each group's two best
scores, keeps the best `topk_group` of `n_group` groups through a scattered [n, n_group] mask expanded to
[n, E], masks the other experts' scores to 0, takes the unsorted top-k, gathers the unbiased scores as
weights, renormalises them (+1e-20) and multiplies them by `routed_scaling_factor`. The layer (eval:
`if not self.training`) calls the patched `moe_infer(x, topk_idx, topk_weight)`: it stacks the experts'
gate/up/down `nn.Linear` weights with `torch.stack([...])` on every call, expands x to [E, T, H]
(`.contiguous()`), runs three `torch.bmm`s against the transposed stacks with the first expert's `act_fn`
between them, builds a [T, E] table `torch.zeros(T, E).scatter_add(1, topk_ids, topk_weight)` and combines
with `(routing.unsqueeze(-1) * expert_out.permute(1, 0, 2)).sum(dim=1)`; the output is viewed back and
the shared expert (`n_shared_experts` times the expert width) is added. Tiny sizes keep the group-limited
gate: 8 experts in 4 groups of 2, the best 2 groups kept (the real model: 256 experts, 8 groups, 4 kept,
top-8, one shared expert, scaling 2.5).
The original `@torch.no_grad() moe_infer` (argsort, `.cpu().numpy()` counts, loop) is kept on the class,
as the loader finds it there, and is never called once patched.
Left out: the expert-parallel branches of the original `moe_infer` and `__init__` (`ep_size > 1`,
all-to-all); there is no training branch to leave (the forward only defines `y` when not training, the
gate asserts `not self.training`).
Constructs: a method patched onto the class, `torch.stack` of per-expert Linear weights inside forward,
`expand(...).contiguous()` + `bmm` over all experts, a `scatter_add` [T, E] routing table, a broadcast
multiply and `.sum(dim=1)` combine, an unused `flat_topk_idx` view, a shared expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("tenstorrent/tt-forge-models", "deepseek/deepseek_v3/pytorch/loader.py",
                "1eec8a64bf0348683c116e7dc0ce0a4cd678f6ca", "_patch_moe_layers._batched_moe_infer")
HIDDEN, INTER, EXPERTS, TOP_K, GROUPS, TOP_GROUPS, SHARED = 16, 8, 8, 2, 4, 2, 1


class DeepseekV3MLP(nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class MoEGate(nn.Module):
    def __init__(self):
        super().__init__()
        self.top_k, self.n_routed_experts = TOP_K, EXPERTS
        self.routed_scaling_factor = 2.5
        self.scoring_func, self.topk_method = "sigmoid", "noaux_tc"
        self.n_group, self.topk_group = GROUPS, TOP_GROUPS
        self.norm_topk_prob = True
        self.weight = nn.Parameter(torch.empty(EXPERTS, HIDDEN))
        if self.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.empty(EXPERTS))

    def forward(self, hidden_states):
        bsz, seq_len, h = hidden_states.shape
        hidden_states = hidden_states.view(-1, h)
        logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32), None)
        if self.scoring_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            raise NotImplementedError(f"insupportable scoring function for MoE gating: {self.scoring_func}")

        if self.topk_method == "noaux_tc":
            assert not self.training
            scores_for_choice = scores.view(bsz * seq_len, -1) + self.e_score_correction_bias.unsqueeze(0)
            group_scores = scores_for_choice.view(bsz * seq_len, self.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
            group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores)
            group_mask.scatter_(1, group_idx, 1)
            score_mask = (
                group_mask.unsqueeze(-1)
                .expand(bsz * seq_len, self.n_group, self.n_routed_experts // self.n_group)
                .reshape(bsz * seq_len, -1)
            )
            tmp_scores = scores_for_choice.masked_fill(~score_mask.bool(), 0.0)
            _, topk_idx = torch.topk(tmp_scores, k=self.top_k, dim=-1, sorted=False)
            topk_weight = scores.gather(1, topk_idx)
        else:
            raise NotImplementedError(f"insupportable TopK function for MoE gating: {self.topk_method}")

        if self.top_k > 1 and self.norm_topk_prob:
            denominator = topk_weight.sum(dim=-1, keepdim=True) + 1e-20
            topk_weight = topk_weight / denominator
        topk_weight = topk_weight * self.routed_scaling_factor
        return topk_idx, topk_weight


class DeepseekV3MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts_per_tok = TOP_K
        self.ep_size, self.experts_per_rank, self.ep_rank = 1, EXPERTS, 0
        self.experts = nn.ModuleList(DeepseekV3MLP(HIDDEN, INTER) for _ in range(EXPERTS))
        self.gate = MoEGate()
        self.n_shared_experts = SHARED
        if self.n_shared_experts is not None:
            self.shared_experts = DeepseekV3MLP(HIDDEN, INTER * SHARED)

    def forward(self, hidden_states):
        identity = hidden_states
        orig_shape = hidden_states.shape
        topk_idx, topk_weight = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        flat_topk_idx = topk_idx.view(-1)  # noqa: F841 - computed and unused, as in the original
        if not self.training:
            y = self.moe_infer(hidden_states, topk_idx, topk_weight).view(*orig_shape)
        if self.n_shared_experts is not None:
            y = y + self.shared_experts(identity)
        return y

    @torch.no_grad()
    def moe_infer(self, x, topk_ids, topk_weight):
        """The original (ep_size == 1 path); `_patch_moe_layers` replaces it on the class."""
        cnts = topk_ids.new_zeros((topk_ids.shape[0], len(self.experts)))
        cnts.scatter_(1, topk_ids, 1)
        tokens_per_expert = cnts.sum(dim=0)
        idxs = topk_ids.view(-1).argsort()
        sorted_tokens = x[idxs // topk_ids.shape[1]]
        tokens_per_expert = tokens_per_expert.cpu().numpy()
        outputs = []
        start_idx = 0
        for i, num_tokens in enumerate(tokens_per_expert):
            end_idx = start_idx + num_tokens
            if num_tokens == 0:
                continue
            expert = self.experts[i + self.ep_rank * self.experts_per_rank]
            outputs.append(expert(sorted_tokens[start_idx:end_idx]))
            start_idx = end_idx
        outs = torch.cat(outputs, dim=0) if len(outputs) else sorted_tokens.new_empty(0)
        new_x = torch.empty_like(outs)
        new_x[idxs] = outs
        return (
            new_x.view(*topk_ids.shape, -1)
            .type(topk_weight.dtype)
            .mul_(topk_weight.unsqueeze(dim=-1))
            .sum(dim=1)
            .type(new_x.dtype)
        )


def _batched_moe_infer(self_moe, x, topk_ids, topk_weight):
    num_tokens, hidden = x.shape
    num_experts = self_moe.experts_per_rank

    gate_w = torch.stack([e.gate_proj.weight for e in self_moe.experts])
    up_w = torch.stack([e.up_proj.weight for e in self_moe.experts])
    down_w = torch.stack([e.down_proj.weight for e in self_moe.experts])

    x_exp = x.unsqueeze(0).expand(num_experts, -1, -1).contiguous()

    gate_out = torch.bmm(x_exp, gate_w.transpose(1, 2))
    up_out = torch.bmm(x_exp, up_w.transpose(1, 2))
    hidden_states = self_moe.experts[0].act_fn(gate_out) * up_out
    expert_out = torch.bmm(hidden_states, down_w.transpose(1, 2))

    routing = torch.zeros(
        num_tokens, num_experts, dtype=topk_weight.dtype, device=x.device
    ).scatter_add(1, topk_ids, topk_weight.to(topk_weight.dtype))

    return (routing.unsqueeze(-1) * expert_out.permute(1, 0, 2)).sum(dim=1)


def _patch_moe_layers(model):
    for module in model.modules():
        if hasattr(module, "moe_infer") and hasattr(module, "experts_per_rank"):
            experts = list(module.experts)
            if experts and hasattr(experts[0], "gate_proj") and hasattr(experts[0], "up_proj"):
                type(module).moe_infer = _batched_moe_infer


def patched_deepseek_v3_moe():
    moe = DeepseekV3MoE()
    _patch_moe_layers(moe)
    return moe


def build():
    return tiny(patched_deepseek_v3_moe, HIDDEN)
