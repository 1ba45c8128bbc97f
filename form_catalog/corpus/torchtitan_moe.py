"""torchtitan's `MoE` (Llama4 defaults): sigmoid top-1 router, TokenReorderer, for-loop GroupedExperts, a shared expert.

Mirrors pytorch/torchtitan `torchtitan/models/moe/moe.py` at commit e38d7ab (`MoEArgs`, `FeedForward`,
`_run_experts_for_loop`, `GroupedExperts.forward`, `TokenChoiceTopKRouter.forward` and
`_get_node_limited_routing_scores`, `TokenReorderer.forward`, `MoE.__init__` / `MoE.forward`), the last
commit at which the file lived at that path and still had the for-loop experts (the next commit moved it to
`torchtitan/models/common/moe/moe.py`; today's `models/common/moe.py` keeps only `torch._grouped_mm`).
Configured as the Llama4 train spec (`torchtitan/models/llama4/__init__.py`, "17bx16e") configures it: the
`MoEArgs()` defaults except the expert count (sigmoid scores, no route_norm, route_scale 1.0, no gate bias,
top_k 1, one shared expert, `score_before_experts=True`, `load_balance_coeff=1e-3` so an `expert_bias`
buffer exists), with `use_grouped_mm=False`, which `TransformerModelArgs.update_from_config` sets itself
when the GPU is older than SM90. (The DeepSeek-V3 specs use softmax top-3 with two shared experts and
`score_before_experts=False`, i.e. the `bmm` combine branch kept below but not taken.)
`MoE.forward` views [bs, slen, dim] flat and calls the router with `self.expert_bias`: a bias-free gate
Linear, a float32 sigmoid (a `score_func` string branch), the bias added for the choice only, the
node-limited group masking only `if self.num_expert_groups is not None` (it is None), `torch.topk(...,
sorted=False)` ids, the scores gathered from the unbiased scores, the debug round-robin override and the
`route_norm` renormalisation behind flags that are off, `* route_scale`, and `torch.histc` per-expert
counts. The layer adds those counts into its `tokens_per_expert` buffer under `with torch.no_grad()`
(unconditionally, in eval too). `TokenReorderer` histograms the ids again, stable-`argsort`s the flat ids
and reorders the flat scores with them; the layer gathers `x[token_indices_experts_sorted // top_k]` and,
`if self.score_before_experts`, multiplies the gathered rows by the scores in float32. `GroupedExperts`
(stacked w1/w3 [E, hidden, dim] and w2 [E, dim, hidden]) checks `isinstance(self.w1, DTensor)` (false),
branches on `self.use_grouped_mm` and runs `_run_experts_for_loop`: `num_tokens_per_expert.tolist()` on the
host, `num_padding = x.shape[0] - sum(list)`, `torch.split` of `x[: sum(list)]` by the list, a
`for expert_idx, x_expert in enumerate(x_splits)` loop of silu(x w1^T) * (x w3^T) w2^T (empty splits run
too, no skip), `torch.cat`, and a `torch.vstack` with `num_padding` zero rows. The shared SwiGLU
`FeedForward` runs on all tokens; the routed outputs are unsorted by an indexed assignment into a zero
[bs*slen*top_k, dim] buffer, reshaped to [-1, top_k, dim] and summed over k (the `bmm` with the scores when
`not score_before_experts`), added to the shared output and reshaped back.
Left out: expert/tensor parallelism (one rank: the weights are plain Parameters, so the DTensor branch
is not taken), the `torch._grouped_mm` path with its `indices_padding_wrapper` Triton padding (SM90+ only;
here it raises if reached), the DeepEP `build_moe` variant, `init_weights` (the corpus draws the weights),
and the optimizer hook that updates `expert_bias` from `tokens_per_expert` (training only; the buffer stays
zero). `torch.histc` on int64 ids is CUDA-only, so both histograms count a float copy of the ids and cast
the counts back to the ids' int64 dtype (what CUDA's int64 `histc` returns; `torch.split` needs the ints).
The real Llama4 17Bx16E has 16 experts, top-1, one shared expert (kept: top-1 and the shared expert, with
8 experts, `MoEArgs`' own default, at the tiny size).
Constructs: a `score_func` string branch and config-flag branches in the router, `torch.histc` counts
(twice), an in-place buffer update under `torch.no_grad()` in forward, stable `argsort` dispatch with a
`// top_k` gather, an `isinstance(..., DTensor)` check, `.tolist()` counts summed on the host and fed to
`torch.split`, a loop over `enumerate(splits)` with no empty skip, `torch.cat` + `torch.vstack` zero
padding, an indexed assignment (index_put) unsort, a `score_before_experts` branch choosing sum or `bmm`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from ._shell import Source, tiny

SOURCE = Source("pytorch/torchtitan", "torchtitan/models/moe/moe.py", "e38d7abe0fa09c2ec7ccac1729f77cf72faddfc5",
                "MoE.forward")
HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 8, 1


@dataclass
class MoEArgs:
    num_experts: int = 8
    num_shared_experts: int = 1

    # router
    score_func: Literal["softmax", "sigmoid"] = "sigmoid"
    route_norm: bool = False
    route_scale: float = 1.0
    gate_bias: bool = False
    score_before_experts: bool = True

    # token-choice with optional node limited routing
    top_k: int = 1
    num_expert_groups: int | None = None
    num_limited_groups: int | None = None
    use_grouped_mm: bool = True
    load_balance_coeff: float | None = 1e-3

    _debug_force_load_balance: bool = False


class FeedForward(nn.Module):
    """w2(silu(w1(x)) * w3(x)): the shared expert."""

    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _run_experts_for_loop(w1, w2, w3, x, num_tokens_per_expert):
    # host sync: the counts become a Python list
    num_tokens_per_expert_list = num_tokens_per_expert.tolist()

    # side-effect code due to the usage of generate_permute_indices
    num_padding = x.shape[0] - sum(num_tokens_per_expert_list)

    x_splits = torch.split(x[: sum(num_tokens_per_expert_list)], split_size_or_sections=num_tokens_per_expert_list,
                           dim=0)
    out_experts_splits = []
    for expert_idx, x_expert in enumerate(x_splits):
        h = F.silu(torch.matmul(x_expert, w1[expert_idx].transpose(-2, -1)))
        h = h * torch.matmul(x_expert, w3[expert_idx].transpose(-2, -1))
        h = torch.matmul(h, w2[expert_idx].transpose(-2, -1))
        out_experts_splits.append(h)
    out = torch.cat(out_experts_splits, dim=0)

    out = torch.vstack((out, out.new_zeros((num_padding, out.shape[-1]))))
    return out


class GroupedExperts(nn.Module):
    def __init__(self, dim, hidden_dim, num_experts, use_grouped_mm):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.use_grouped_mm = use_grouped_mm

    def forward(self, x, num_tokens_per_expert):
        if isinstance(self.w1, DTensor):
            w1 = self.w1.to_local()
            w2 = self.w2.to_local()
            w3 = self.w3.to_local()
        else:
            w1 = self.w1
            w2 = self.w2
            w3 = self.w3

        if self.use_grouped_mm:
            raise NotImplementedError("torch._grouped_mm with the Triton indices padding (SM90+)")
        else:
            return _run_experts_for_loop(w1, w2, w3, x, num_tokens_per_expert)


class TokenChoiceTopKRouter(nn.Module):
    def __init__(self, dim, num_experts, num_expert_groups, num_limited_groups, top_k, score_func, route_norm,
                 route_scale, gate_bias, _debug_force_load_balance=False):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=gate_bias)
        self.num_experts = num_experts
        self.num_expert_groups = num_expert_groups
        self.num_limited_groups = num_limited_groups
        self.top_k = top_k
        self.score_func = score_func
        self.route_norm = route_norm
        self.route_scale = route_scale
        self._debug_force_load_balance = _debug_force_load_balance

    def _debug_force_load_balance_routing(self, scores):
        n_tokens = scores.size(0)
        selected_experts_indices = (
            torch.arange(n_tokens * self.top_k, device=scores.device, dtype=torch.int64).reshape(n_tokens, self.top_k)
            % self.num_experts
        )
        top_scores = scores.gather(dim=1, index=selected_experts_indices)
        return selected_experts_indices, top_scores

    def _get_node_limited_routing_scores(self, scores_for_choice):
        if self.num_limited_groups is None:
            raise ValueError("num_limited_groups must be set when num_expert_groups is set")
        assert self.num_expert_groups is not None
        if self.num_experts % self.num_expert_groups != 0:
            raise ValueError(f"num_experts ({self.num_experts}) must be divisible by num_expert_groups "
                             f"({self.num_expert_groups})")
        experts_per_group = self.num_experts // self.num_expert_groups
        if experts_per_group < 2:
            raise ValueError(f"experts_per_group ({experts_per_group}) must be >= 2")
        scores_grouped = scores_for_choice.view(-1, self.num_expert_groups, experts_per_group)
        top2_scores_in_group, _ = scores_grouped.topk(2, dim=-1)
        group_scores = top2_scores_in_group.sum(dim=-1)
        _, group_idx = torch.topk(group_scores, k=self.num_limited_groups, dim=-1, sorted=False)
        group_mask = torch.ones_like(group_scores, dtype=torch.bool)
        group_mask.scatter_(1, group_idx, False)
        scores_for_choice = scores_grouped.masked_fill(group_mask.unsqueeze(-1), float("-inf")).view(
            -1, self.num_experts)
        return scores_for_choice

    def forward(self, x, expert_bias=None):
        scores = self.gate(x)

        if self.score_func == "sigmoid":
            scores = torch.sigmoid(scores.to(torch.float32))
        elif self.score_func == "softmax":
            scores = F.softmax(scores.to(torch.float32), dim=1)
        else:
            raise NotImplementedError(f"Unknown score function {self.score_func}")

        scores_for_choice = scores if expert_bias is None else scores + expert_bias
        if self.num_expert_groups is not None:
            scores_for_choice = self._get_node_limited_routing_scores(scores_for_choice)
        _, selected_experts_indices = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)

        # the bias only picks the experts; the gating values come from the original scores
        top_scores = scores.gather(dim=1, index=selected_experts_indices)

        if self._debug_force_load_balance:
            selected_experts_indices, top_scores = self._debug_force_load_balance_routing(scores)

        if self.route_norm:
            denominator = top_scores.sum(dim=-1, keepdim=True) + 1e-20
            top_scores = top_scores / denominator
        top_scores = top_scores * self.route_scale

        # CPU histc has no int64 kernel: count a float copy, return CUDA's int64 result dtype.
        flat_ids = selected_experts_indices.view(-1)
        num_tokens_per_expert = torch.histc(flat_ids.float(), bins=self.num_experts, min=0,
                                            max=self.num_experts).to(flat_ids.dtype)

        return top_scores, selected_experts_indices, num_tokens_per_expert


class TokenReorderer(nn.Module):
    """Stateless: groups the (token, slot) pairs by expert."""

    def __init__(self, num_experts, top_k):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k

    def forward(self, top_scores, selected_experts_indices):
        # CPU histc has no int64 kernel: count a float copy, return CUDA's int64 result dtype.
        flat_ids = selected_experts_indices.view(-1)
        num_tokens_per_expert = torch.histc(flat_ids.float(), bins=self.num_experts, min=0,
                                            max=self.num_experts).to(flat_ids.dtype)

        token_indices_experts_sorted = torch.argsort(selected_experts_indices.view(-1), stable=True)

        top_scores_experts_sorted = top_scores.view(-1)[token_indices_experts_sorted]

        return top_scores_experts_sorted, token_indices_experts_sorted, num_tokens_per_expert


class MoE(nn.Module):
    def __init__(self, moe_args, dim, hidden_dim):
        super().__init__()

        num_experts = moe_args.num_experts
        self.experts = GroupedExperts(dim=dim, hidden_dim=hidden_dim, num_experts=num_experts,
                                      use_grouped_mm=moe_args.use_grouped_mm)
        self.router = TokenChoiceTopKRouter(
            dim=dim, num_experts=num_experts, num_expert_groups=moe_args.num_expert_groups,
            num_limited_groups=moe_args.num_limited_groups, top_k=moe_args.top_k, score_func=moe_args.score_func,
            route_norm=moe_args.route_norm, route_scale=moe_args.route_scale, gate_bias=moe_args.gate_bias,
            _debug_force_load_balance=moe_args._debug_force_load_balance)
        self.reorderer = TokenReorderer(num_experts=num_experts, top_k=moe_args.top_k)
        self.shared_experts = (
            FeedForward(dim=dim, hidden_dim=hidden_dim * moe_args.num_shared_experts)
            if moe_args.num_shared_experts > 0
            else None
        )
        self.score_before_experts = moe_args.score_before_experts

        # auxiliary-loss-free load balancing: the bias is updated outside the model
        self.load_balance_coeff = moe_args.load_balance_coeff
        if self.load_balance_coeff is not None:
            assert self.load_balance_coeff > 0.0
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32), persistent=True)
        else:
            self.expert_bias = None
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.float32), persistent=False)

    def forward(self, x):
        bs, slen, dim = x.shape
        x = x.view(-1, dim)

        top_scores, selected_experts_indices, num_tokens_per_expert = self.router(x, self.expert_bias)

        # expert usage, read by the optimizer hook that updates expert_bias
        with torch.no_grad():
            self.tokens_per_expert.add_(num_tokens_per_expert)

        top_scores_experts_sorted, token_indices_experts_sorted, num_tokens_per_expert = self.reorderer(
            top_scores, selected_experts_indices)

        routed_input = x[token_indices_experts_sorted // self.router.top_k]

        if self.score_before_experts:
            routed_input = (routed_input.to(torch.float32) * top_scores_experts_sorted.reshape(-1, 1)).to(x.dtype)

        routed_output = self.experts(routed_input, num_tokens_per_expert)

        # shared expert first, to overlap with the combine communication
        out = self.shared_experts(x) if self.shared_experts is not None else None

        routed_output_unsorted = torch.zeros((bs * slen * self.router.top_k, dim), dtype=routed_output.dtype,
                                             device=routed_output.device)
        routed_output_unsorted[token_indices_experts_sorted] = routed_output
        routed_output_unsorted = routed_output_unsorted.reshape(-1, self.router.top_k, dim)
        if not self.score_before_experts:
            out_experts = torch.bmm(top_scores.reshape(-1, 1, self.router.top_k),
                                    routed_output_unsorted.float()).to(x.dtype).squeeze(1)
        else:
            out_experts = routed_output_unsorted.sum(dim=1)

        if out is None:
            return out_experts.reshape(bs, slen, dim)
        return (out + out_experts).reshape(bs, slen, dim)


def llama4_moe():
    moe_args = MoEArgs(num_experts=EXPERTS, top_k=TOP_K, use_grouped_mm=False)
    return MoE(moe_args, dim=HIDDEN, hidden_dim=INTER)


def build():
    return tiny(llama4_moe, HIDDEN)
