"""Uni-MoE 2.0's dynamic-capacity MoE (DCMoE): top-p expert counts, grouped sparsemixer-style picks, a null expert,
probability-based token dropping, always-on shared experts, and a compress/decompress expert dispatch.

Mirrors HITsz-TMG/UMOE-Scaling-Unified-Multimodal-LLMs `DCMoE/training/Models/UniMoEV2.py` at commit d333564
(`SharedExpertMLP`, `DynamicExpertMLP`, `allocation_expert`, `dynamic_expert_selection`, `_capacity`,
`cal_global_weight`, `UniMoEV2MoESparseMoeBlock.__init__` / `forward`, `load_balancing_loss_func`, `Experts`,
`MOELayer.forward`, `MoE.__init__` / `forward`, the MLP call of `UniMoEV2Qwen2VLDecoderLayer.forward` and the
`padding_token_mask` of `UniMoEV2Qwen2VLForConditionalGeneration.forward`) with `DCMoE/training/Models/MoE_utils.py`
(`compress_matrix`, `decompress_matrix`) and `DCMoE/inference/deepspeed_moe_inference_utils.py` (the single-GPU
patch that makes DeepSpeed's `_AllToAll.forward` return `input.contiguous()`), all at the same commit; the
settings are those of `DCMoE/script/training.sh` through `train_unimoev2_qwen2vl.py`'s `initial_model` (4 routed
experts + 1 null expert, `mlp_dynamic_top_p` 0.7, `mlp_dynamic_top_k` 0, 2 shared experts, `token_drop` on with
`drop_policy` "probs", `min_capacity` 8, `capacity_factor` 3, router/input jitter 0.01, fp32 gate, routed experts
1/4 and shared 1/8 of the dense intermediate size, `drop_token_num_print` on). The repo's single-GPU inference
script (`single_gpu_without_ep.py`) runs this same model class in eval.
The wrapper stands in for the decoder: it derives `padding_token_mask = attention_mask.bool()` from an all-ones
[B, S] attention mask (what the top-level forward does when the collator gives none), calls
`self.mlp(hidden_states, padding_token_mask, aux_balance_weight=None)` and unpacks its 6-tuple.
The block's forward (eval): keeps the input, views tokens [T, H], scores all 4 + 1 + 2 = 7 experts with the
bias-free `gate` (in training the gate runs in fp32 and the input is jittered in place), and slices the 5 dynamic
logits. `dynamic_expert_selection` gives each token its own expert count: softmax, `sort` descending, `cumsum`,
the number of experts before the mass reaches top_p, plus one. Then `for top_k in range(1, 5 + 1)`: the tokens
with that count by `torch.nonzero(..., as_tuple=True)`, `if len(group_idx) == 0: continue`, and
`allocation_expert(group_logits, top_k, jitter_eps)`, which loops k times: under `no_grad` the running max and a
relative-gap threshold mask (`(max - s) / clamp(|s|, min=|max|) > 2 * eps`), a `masked_fill(-inf)` + softmax
whose value at the argmax is that pick's weight, then the pick is knocked out with `torch.scatter(..., -inf)`;
the group's one-hot picks summed into a 0/1 row, its weights `scatter_`ed into a [n, 5] row, both added into the
[T, 5] weights and the int [T, 7] `expert_mask` with `index_add_`. The weights are renormalised by their sum +
1e-6, the mask multiplied by the expanded padding mask, the shared columns set to 1 in place
(`expert_mask[:, 5:] = 1`), and the balance loss computed (masked softmax, per-expert means). Token dropping
("probs"): capacity `ceil(T / 5 * 3)` as a tensor, raised to `min_capacity` if below (tensor comparison), cut to
T if above (printing a warning); the unselected logits filled with `finfo.min`, `torch.topk(k=capacity, dim=0)`
over tokens per expert, a `scatter`ed capacity mask (shared columns forced to 1), `logical_and` with the mask,
kept/total counts read with `.item()` and printed on rank 0 (`os.environ` read), the mask cast back to int, the
weights zeroed where dropped and renormalised. `cal_global_weight` (there are shared experts) takes a softmax of
all 7 logits masked to -inf outside the mask and scales the dynamic weights by its dynamic share. A tensor-valued
`assert` checks no unmasked weight survives outside the mask. The 4 real routed experts (the null expert's column
is sliced off: it contributes nothing) go through `MoE` -> `MOELayer.forward`: weights times mask, capacity =
`expert_mask.sum(0).max()` (a tensor; the expert-parallel all-reduce skipped with no group), the tokens expanded
to [T, 4, H] and packed per expert by `compress_matrix` (shape/ndim checks, a 0/1 check read on the host with
`.all()`, `if X == 0`, `argsort(mask, dim=0, descending=True)`, `gather`, a tensor-bounded slice `[:X]`,
`arange(X)` row mask), the mask packed the same way, `einsum("ce,cem->ecm")` dispatch, the patched identity
`_AllToAll.apply`, reshape to [ep, local, C, H], `Experts.forward` (`chunk` per local expert, a `zip` loop, a
tuple check, `torch.cat`), the identity all-to-all, reshape to [E, C, H], `decompress_matrix` (checks, argsort,
`scatter_` back to [T, 4, H]) and `einsum("se,sem->sm")`. The shared experts are added in a Python loop, each on
every token times its global weight; the result is reshaped to [B, S, H] and returned with the logits, counts,
mask, weights and loss.
Left out: DeepSpeed itself (the `deepspeed.moe` base classes become `nn.Module`; `log_dist`, the process-group
creation of `MoE.set_deepspeed_parallelism`, which the single-GPU script never calls, and the expert-parallel
all-reduces, which sit behind `ep_group is not None` / `avg_hidden_states_last` and raise here if reached;
`SynchronizedWallClockTimer` becomes a do-nothing stand-in behind the kept `wall_clock_breakdown` checks;
DeepSpeed's `einsum` helper is kept in its default `USE_EINSUM` form, i.e. `torch.einsum`), the unused `mp`
autograd Function and `NULLExpertMLP` (defined upstream but never called in the forward), Qwen2-VL attention,
vision tower and RMSNorms (the shell supplies the norm and the residual), the transformers config base (a plain
local class), weight init and the dense-to-expert weight copying of `initial_model`.
Sizes: Qwen2-VL-2B has hidden 1536, intermediate 8960 (routed 2240, shared 1120); here hidden 16, routed 16,
shared 8, with the training script's 4 + 1 null routed and 2 shared experts; batch 2 x 7 tokens, so the
capacity (ceil(14 / 5 * 3) = 9) stays below the token count (14) instead of being cut to it.
Constructs: `self.training` branches (fp32 gate, in-place input jitter), a per-token data-dependent expert count
from sort/cumsum, a `range(1, E + 1)` loop over count groups with `nonzero(as_tuple=True)` and a `len(...) == 0`
skip, a nested `range(top_k)` loop under `torch.no_grad()` with `max`, `masked_fill(-inf)`, `gather`,
out-of-place `torch.scatter(-inf)` and `torch.concat`, `scatter_` / `index_add_` into zero buffers, in-place
slice assignment, tensor-valued capacity compared in Python `if`s and used as `topk`'s k, a `print` of a tensor,
`.item()` reads and an `os.environ` check, `logical_and` of int and int masks, a tensor-valued `assert`,
`argsort`-based compress/decompress with host-read checks (`.all()` truthiness, `X == 0`, `X <= n`) and tensor
slice bounds, `einsum` dispatch/combine, an identity `torch.autograd.Function`, `chunk` + `zip` expert loop with
a `type(out) is tuple` check, a Python loop over shared experts, a 6-tuple return.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor

from ._shell import Source, tiny

SOURCE = Source("HITsz-TMG/UMOE-Scaling-Unified-Multimodal-LLMs", "DCMoE/training/Models/UniMoEV2.py",
                "d333564588a89b5846ffe28851c354319a86e005", "UniMoEV2MoESparseMoeBlock.forward")
HIDDEN, DENSE_INTER, BATCH = 16, 64, 2


class UniMoEV2Qwen2VLConfig:
    """The MoE fields of `UniMoEV2Qwen2VLConfig`, set as `initial_model` sets them from `training.sh`."""

    def __init__(self, hidden_size=HIDDEN, intermediate_size=DENSE_INTER, hidden_act="silu",
                 mlp_dynamic_expert_num=4, mlp_dynamic_null_expert_num=1, mlp_dynamic_top_p=0.7,
                 mlp_dynamic_top_k=0, mlp_fixed_expert_num=2, dynamic_mlp_size_factor=4, fixed_mlp_size_factor=8,
                 enable_expert_tensor_parallelism=False, ep_size=1, fixed_ep_size=1, router_jitter_noise=0.01,
                 input_jitter_noise=0.01, token_drop=True, drop_policy="probs", min_capacity=8,
                 capacity_factor=3.0, fp32_gate=True, avg_hidden_states_last=False, drop_token_num_print=True,
                 l_aux_weight=0.025):
        self.hidden_size = hidden_size
        self.hidden_act = hidden_act
        self.mlp_dynamic_expert_num = mlp_dynamic_expert_num
        self.mlp_dynamic_null_expert_num = mlp_dynamic_null_expert_num
        self.mlp_dynamic_top_p = mlp_dynamic_top_p
        self.mlp_dynamic_top_k = mlp_dynamic_top_k
        self.mlp_fixed_expert_num = mlp_fixed_expert_num
        self.dynamic_intermediate_size = intermediate_size // dynamic_mlp_size_factor
        self.shared_intermediate_size = intermediate_size // fixed_mlp_size_factor
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.fixed_ep_size = fixed_ep_size
        self.router_jitter_noise = router_jitter_noise
        self.input_jitter_noise = input_jitter_noise
        self.token_drop = token_drop
        self.drop_policy = drop_policy
        self.min_capacity = min_capacity
        self.capacity_factor = capacity_factor
        self.fp32_gate = fp32_gate
        self.avg_hidden_states_last = avg_hidden_states_last
        self.drop_token_num_print = drop_token_num_print
        self.l_aux_weight = l_aux_weight


ACT2FN = {"silu": nn.SiLU}


# ---- single-process stand-ins for what DeepSpeed provides ----

class _ReduceOp:
    MAX = "max"
    AVG = "avg"


class _SingleProcessDist:
    ReduceOp = _ReduceOp

    @staticmethod
    def all_reduce(tensor, op=None, group=None):
        raise NotImplementedError("expert-parallel all_reduce (needs a DeepSpeed process group)")


dist = _SingleProcessDist


class _Groups:
    mpu = None


groups = _Groups


class _NoTimer:
    def start(self):
        pass

    def stop(self):
        pass

    def elapsed(self, reset=True):
        return 0.0


class SynchronizedWallClockTimer:
    """Stand-in: only reached when `wall_clock_breakdown` is on, which it never is here."""

    def __call__(self, name):
        return _NoTimer()


MOE_TIMER, FIRST_ALLTOALL_TIMER, SECOND_ALLTOALL_TIMER = "moe", "falltoall", "salltoall"

USE_EINSUM = True


def einsum(rule, a, b):
    """DeepSpeed `sharded_moe.einsum`: `torch.einsum` by default (its hand-written rules cover other patterns)."""
    if USE_EINSUM:
        return torch.einsum(rule, a, b)
    return torch.einsum(rule, a, b)


class _AllToAll(torch.autograd.Function):
    """DeepSpeed's `_AllToAll` with the forward that `deepspeed_moe_inference_utils` patches in for one GPU."""

    @staticmethod
    def forward(ctx: Any, group, input: Tensor) -> Tensor:  # type: ignore[override]
        ctx.group = group
        input = input.contiguous()
        return input

    @staticmethod
    def backward(ctx: Any, *grad_output: Tensor):
        return (None, _AllToAll.apply(ctx.group, *grad_output))


# ---- DCMoE/training/Models/MoE_utils.py ----

def compress_matrix(A: torch.Tensor, mask: torch.Tensor, force_dim: int = None, allow_larger_dim=None) -> torch.Tensor:
    if A.shape[:2] != mask.shape:
        raise ValueError("First two dimensions of A and mask must match.")
    if mask.ndim != 2:
        raise ValueError("mask must be a 2D tensor.")
    if not ((mask == 0) | (mask == 1)).all():
        raise ValueError(
            f"mask must only contain 0s and 1s. dtype: {mask.dtype}. "
            f"Invalid elements found at indices: {((mask != 0) & (mask != 1)).nonzero().tolist()} "
            f"with corresponding values: {mask[((mask != 0) & (mask != 1))].tolist()}. "
        )

    S, E = mask.shape
    trailing_dims_shape = A.shape[2:]
    num_trailing_dims = len(trailing_dims_shape)
    device = A.device

    ones_per_column = mask.sum(dim=0)
    X = ones_per_column.max().item() if force_dim is None else force_dim

    if X == 0:
        return torch.empty((0, E, *trailing_dims_shape), dtype=A.dtype, device=device)

    # rows with a 1 first, per column
    sorted_row_indices_2d = torch.argsort(mask.float(), dim=0, descending=True)
    view_shape_for_indices = (S, E, *((1,) * num_trailing_dims))
    expanded_indices = sorted_row_indices_2d.view(view_shape_for_indices).expand_as(A)
    A_gathered = torch.gather(A, 0, expanded_indices)

    if X <= A_gathered.shape[0]:
        B_candidate = A_gathered[:X, ...]
    elif allow_larger_dim or allow_larger_dim is None:
        if allow_larger_dim is None:
            print(f"[Warning compress_matrix] Target dimension X ({X}) is larger than "
                  f"A's original row count S ({S}). Padding B_candidate with zeros.")
        B_candidate = A_gathered
        zeros_shape = [X - A_gathered.shape[0]] + list(B_candidate.shape[1:])
        B_candidate = torch.cat(
            (B_candidate, torch.zeros(zeros_shape, dtype=B_candidate.dtype, device=B_candidate.device)), dim=0)
    else:
        raise AssertionError(f"Target dimension X ({X}) is larger than A's original row count S ({S}) "
                             f"and allow_larger_dim is False. Padding is disallowed.")

    row_indices_for_B = torch.arange(X, device=device).unsqueeze(1)
    b_mask_2d = row_indices_for_B < ones_per_column.unsqueeze(0)
    view_shape_for_b_mask = (X, E, *((1,) * num_trailing_dims))
    B = B_candidate * b_mask_2d.view(view_shape_for_b_mask).to(A.dtype)

    return B


def decompress_matrix(B: torch.Tensor, mask: torch.Tensor, allow_larger_dim=None) -> torch.Tensor:
    if B.shape[1] != mask.shape[1]:
        raise ValueError("B's second dimension and mask's second dimension (E) must match.")
    if mask.ndim != 2:
        raise ValueError("mask must be a 2D tensor.")
    if not ((mask == 0) | (mask == 1)).all():
        raise ValueError("mask must only contain 0s and 1s.")

    S, E = mask.shape
    X = B.shape[0]
    trailing_dims_shape = B.shape[2:]
    num_trailing_dims = len(trailing_dims_shape)
    device = B.device

    if X == 0:
        return torch.zeros((S, E, *trailing_dims_shape), dtype=B.dtype, device=device)
    if X <= S:
        pass
    elif allow_larger_dim or allow_larger_dim is None:
        if allow_larger_dim is None:
            print(f"[Warning decompress_matrix] Input B.shape[0] ({X}) is larger than "
                  f"target A's row count S ({S}). Truncating B to its first {S} rows.")
        B = B[:S, ...]
        X = S
    else:
        raise AssertionError(f"Input B.shape[0] ({X}) is larger than target A's row count S ({S}) "
                             f"and allow_larger_dim is False. Truncation is disallowed.")

    sorted_row_indices_2d = torch.argsort(mask.float(), dim=0, descending=True)
    target_A_row_indices_2d = sorted_row_indices_2d[:X, :]
    A_reconstructed = torch.zeros((S, E, *trailing_dims_shape), dtype=B.dtype, device=device)
    view_shape_for_target_indices = (X, E, *((1,) * num_trailing_dims))
    expanded_target_indices = target_A_row_indices_2d.view(view_shape_for_target_indices).expand_as(B)
    A_reconstructed.scatter_(dim=0, index=expanded_target_indices, src=B)

    return A_reconstructed


# ---- DCMoE/training/Models/UniMoEV2.py ----

class SharedExpertMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.shared_intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]()

    def forward(self, hidden_state):
        return self.down_proj(self.act_fn(self.gate_proj(hidden_state)) * self.up_proj(hidden_state))


class DynamicExpertMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.dynamic_intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]()

    def forward(self, hidden_state):
        return self.down_proj(self.act_fn(self.gate_proj(hidden_state)) * self.up_proj(hidden_state))


def allocation_expert(scores, top_k, jitter_eps):
    masked_scores = scores
    multiplier_list = []
    selected_experts_list = []

    for _ in range(top_k):
        with torch.no_grad():
            mask_logits_threshold, max_ind = masked_scores.max(dim=-1, keepdim=True)
            factor = scores.abs().clamp(min=mask_logits_threshold.abs())
            mask_logits_threshold = ((mask_logits_threshold - scores) / factor) > (2 * jitter_eps)

        masked_gates = masked_scores.masked_fill(mask_logits_threshold, float("-inf"))
        selected_experts = max_ind
        masked_gates = torch.softmax(masked_gates, dim=-1)
        multiplier_o = masked_gates.gather(dim=-1, index=selected_experts)
        multiplier = multiplier_o

        # knock the pick out before the next round
        masked_scores = torch.scatter(masked_scores, -1, selected_experts, float("-inf"))

        multiplier_list.append(multiplier)
        selected_experts_list.append(selected_experts)

    multiplier = torch.concat(multiplier_list, dim=-1)
    selected_experts = torch.concat(selected_experts_list, dim=-1)

    return multiplier, selected_experts


def dynamic_expert_selection(logits, top_p):
    dynamic_scores = torch.softmax(logits, dim=-1)
    dynamic_scores_sorted, _ = torch.sort(dynamic_scores, dim=-1, descending=True)
    dynamic_scores_cumsum = dynamic_scores_sorted.cumsum(dim=-1)
    dynamic_top_k = (~(dynamic_scores_cumsum >= top_p)).sum(dim=-1)
    dynamic_top_k = dynamic_top_k + 1
    return dynamic_top_k


def _capacity(num_tokens, num_experts, capacity_factor: Tensor, min_capacity: Tensor) -> Tensor:
    capacity = torch.ceil((num_tokens / num_experts) * capacity_factor).to(torch.int64)
    if capacity < min_capacity:
        capacity = min_capacity.to(torch.int64)
    return capacity


def cal_global_weight(expert_mask: torch.Tensor, full_router_logits: torch.Tensor, mlp_dynamic_expert_num: int,
                      routing_weights: torch.Tensor):
    global_weight = torch.softmax(full_router_logits.masked_fill(expert_mask == 0, float("-inf")), dim=-1)
    global_dynamic_weight = global_weight[:, :mlp_dynamic_expert_num]
    global_fixed_weight = global_weight[:, mlp_dynamic_expert_num:]
    # scale the dynamic weights by the dynamic experts' share of the global softmax
    global_dynamic_weight = routing_weights * global_dynamic_weight.sum(-1).unsqueeze(-1).expand(
        -1, routing_weights.shape[-1])
    global_weight = torch.cat((global_dynamic_weight, global_fixed_weight), dim=-1)
    return global_weight


def load_balancing_loss_func(expert_mask: torch.Tensor, mlp_dynamic_expert_num: int, global_weight=None,
                             full_router_logits=None, routing_weights=None, aux_balance_weight=None, version=2):
    min_dtype = torch.finfo(full_router_logits.dtype).min
    global_weight = full_router_logits.masked_fill(expert_mask == 0, min_dtype)
    global_weight = global_weight[:, :mlp_dynamic_expert_num]
    global_weight = torch.softmax(global_weight, dim=-1)
    expert_mask = expert_mask[:, :mlp_dynamic_expert_num]
    num_experts = expert_mask.shape[-1]
    if aux_balance_weight is None:
        tokens_per_expert = torch.mean(expert_mask.float(), dim=0)
        router_prob_per_expert = torch.mean(global_weight, dim=0)
    else:
        batch_size, sequence_length = aux_balance_weight.shape
        num_hidden_layers = global_weight.shape[0] // (batch_size * sequence_length)
        expert_attention_mask = aux_balance_weight[None, :, :, None].expand(
            (num_hidden_layers, batch_size, sequence_length, num_experts)).reshape(-1, num_experts).to(
            global_weight.device)
        tokens_per_expert = torch.sum(expert_mask.float() * expert_attention_mask, dim=0) / torch.sum(
            expert_attention_mask, dim=0)
        router_prob_per_expert = torch.sum(global_weight * expert_attention_mask, dim=0) / torch.sum(
            expert_attention_mask, dim=0)

    overall_loss = torch.sum(tokens_per_expert * router_prob_per_expert)

    return overall_loss * num_experts


class Experts(nn.Module):
    def __init__(self, expert, num_local_experts=1, expert_group_name=None):
        super().__init__()

        self.deepspeed_experts = torch.nn.ModuleList([copy.deepcopy(expert) for i in range(num_local_experts)])
        self.num_local_experts = num_local_experts

        for expert in self.deepspeed_experts:
            for _name, param in expert.named_parameters():
                param.allreduce = False
                param.group_name = expert_group_name

    def forward(self, inputs):
        chunks = inputs.chunk(self.num_local_experts, dim=1)
        expert_outputs = []
        for chunk, expert in zip(chunks, self.deepspeed_experts):  # noqa: B905 - as the original
            out = expert(chunk)
            if type(out) is tuple:
                out = out[0]
            expert_outputs += [out]

        expert_output = torch.cat(expert_outputs, dim=1)
        return expert_output


class MOELayer(nn.Module):
    def __init__(self, experts: nn.Module, ep_group_name, ep_size, num_local_experts: int) -> None:
        super().__init__()

        self.experts = experts
        self.ep_group = None
        self.ep_size = ep_size
        self.ep_group_name = ep_group_name
        self.num_local_experts = num_local_experts
        self.time_falltoall = 0.0
        self.time_salltoall = 0.0
        self.time_moe = 0.0
        self.timers = SynchronizedWallClockTimer()
        self.wall_clock_breakdown = False

    def _set_ep_group(self, ep_group):
        self.ep_group = ep_group

    def forward(self, hidden_states: Tensor, expert_mask: Tensor, router_weight: Tensor) -> Tensor:
        router_weight = router_weight * expert_mask

        if self.wall_clock_breakdown:
            self.timers(MOE_TIMER).start()

        d_model = hidden_states.shape[-1]
        seq_len = hidden_states.shape[0]
        expert_num = expert_mask.shape[-1]
        capacity = expert_mask.sum(dim=0).max()
        if self.ep_group is not None:
            dist.all_reduce(capacity, op=dist.ReduceOp.MAX, group=self.ep_group)

        compres_hidden_states = hidden_states.unsqueeze(1).expand(seq_len, expert_num, d_model)
        compres_hidden_states = compress_matrix(compres_hidden_states, expert_mask, force_dim=capacity,
                                                allow_larger_dim=True)
        compres_expert_mask = compress_matrix(expert_mask, expert_mask, force_dim=capacity, allow_larger_dim=True)
        dispatched_input = einsum("ce,cem->ecm", compres_expert_mask, compres_hidden_states)

        if self.wall_clock_breakdown:
            self.timers(FIRST_ALLTOALL_TIMER).start()

        assert groups.mpu is None
        dispatched_input = _AllToAll.apply(self.ep_group, dispatched_input)

        if self.wall_clock_breakdown:
            self.timers(FIRST_ALLTOALL_TIMER).stop()
            self.time_falltoall = self.timers(FIRST_ALLTOALL_TIMER).elapsed(reset=False)

        dispatched_input = dispatched_input.reshape(self.ep_size, self.num_local_experts, -1, d_model)

        expert_output = self.experts(dispatched_input)

        if self.wall_clock_breakdown:
            self.timers(SECOND_ALLTOALL_TIMER).start()

        expert_output = _AllToAll.apply(self.ep_group, expert_output)

        if self.wall_clock_breakdown:
            self.timers(SECOND_ALLTOALL_TIMER).stop()
            self.time_salltoall = self.timers(SECOND_ALLTOALL_TIMER).elapsed(reset=False)

        expert_output = expert_output.reshape(self.ep_size * self.num_local_experts, -1, d_model)

        expert_output = decompress_matrix(expert_output.transpose(0, 1), expert_mask, allow_larger_dim=True)
        combined_output = einsum("se,sem->sm", router_weight, expert_output)

        if self.wall_clock_breakdown:
            self.timers(MOE_TIMER).stop()
            self.time_moe = self.timers(MOE_TIMER).elapsed(reset=False)

        return combined_output


class MoE(nn.Module):
    def __init__(self, config, expert, num_experts, ep_size, moe_name_prefix="ep_size"):
        super().__init__()

        self.enable_expert_tensor_parallelism = config.enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.num_experts = num_experts

        assert self.num_experts % self.ep_size == 0, (
            f"Number of experts ({self.num_experts}) should be divisible by expert parallel size ({self.ep_size})")

        self.expert_group_name = f"{moe_name_prefix}_{self.ep_size}"
        self.num_local_experts = self.num_experts // self.ep_size

        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        self.deepspeed_moe = MOELayer(experts, self.expert_group_name, self.ep_size, self.num_local_experts)

    def forward(self, *input_args, **input_kwargs):
        return self.deepspeed_moe(*input_args, **input_kwargs)


class UniMoEV2MoESparseMoeBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_dim = config.hidden_size
        self.mlp_dynamic_expert_num = config.mlp_dynamic_expert_num + config.mlp_dynamic_null_expert_num
        self.mlp_dynamic_real_expert_num = config.mlp_dynamic_expert_num
        self.mlp_dynamic_null_expert_num = config.mlp_dynamic_null_expert_num
        self.mlp_dynamic_top_p = config.mlp_dynamic_top_p
        self.mlp_dynamic_top_k = config.mlp_dynamic_top_k
        self.mlp_fixed_expert_num = config.mlp_fixed_expert_num
        self.num_experts = self.mlp_dynamic_expert_num + self.mlp_fixed_expert_num

        if self.mlp_dynamic_top_p == 0:
            print(f"mlp_dynamic_top_p is 0, will use mlp_dynamic_top_k={self.mlp_dynamic_top_k} instead !!!")

        self.gate = nn.Linear(self.hidden_dim, self.num_experts, bias=False)
        self.fixed_real_moe = nn.ModuleList([SharedExpertMLP(config) for _ in range(self.mlp_fixed_expert_num)])
        self.dynamic_real_moe = MoE(config, DynamicExpertMLP(config), self.mlp_dynamic_real_expert_num,
                                    config.ep_size)
        self.router_jitter_noise = config.router_jitter_noise
        self.input_jitter_noise = config.input_jitter_noise
        self.min_capacity = config.min_capacity
        self.capacity_factor = config.capacity_factor
        self.token_drop = config.token_drop
        self.drop_policy = config.drop_policy
        self.avg_hidden_states_last = config.avg_hidden_states_last
        self.drop_token_num_print = config.drop_token_num_print
        self.fp32_gate = config.fp32_gate

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor, aux_balance_weight: torch.Tensor):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        original_hidden_states = hidden_states

        if self.training and self.fp32_gate:
            hidden_states = hidden_states.float()

        if self.training and self.input_jitter_noise > 0:
            hidden_states *= torch.empty_like(hidden_states).uniform_(1.0 - self.input_jitter_noise,
                                                                      1.0 + self.input_jitter_noise)

        hidden_states = hidden_states.view(-1, hidden_dim)

        if self.training and self.fp32_gate:
            full_router_logits = torch.nn.functional.linear(hidden_states, weight=self.gate.weight.float(), bias=None)
        else:
            full_router_logits = self.gate(hidden_states)
        dynamic_router_logits = full_router_logits[:, : self.mlp_dynamic_expert_num]

        if self.mlp_dynamic_top_p != 0:
            dynamic_top_k = dynamic_expert_selection(dynamic_router_logits, self.mlp_dynamic_top_p)
        else:
            dynamic_top_k = torch.full((dynamic_router_logits.shape[0],), self.mlp_dynamic_top_k, dtype=torch.int,
                                       device=dynamic_router_logits.device)

        expert_mask = torch.zeros((batch_size * sequence_length, self.num_experts), dtype=torch.int,
                                  device=hidden_states.device)
        routing_weights = torch.zeros((batch_size * sequence_length, self.mlp_dynamic_expert_num),
                                      dtype=hidden_states.dtype, device=hidden_states.device)

        # tokens grouped by how many experts they take
        for top_k in range(1, self.mlp_dynamic_expert_num + 1):
            group_idx = torch.nonzero(dynamic_top_k == top_k, as_tuple=True)[0]
            if len(group_idx) == 0:
                continue

            dynamic_group_logits = dynamic_router_logits[group_idx]
            group_routing_weights, group_selected_experts = allocation_expert(
                dynamic_group_logits,
                top_k=top_k,
                jitter_eps=self.router_jitter_noise,
            )
            group_expert_mask = torch.nn.functional.one_hot(group_selected_experts, num_classes=self.num_experts)
            group_expert_mask = group_expert_mask.sum(dim=1)

            group_weight = torch.zeros((len(group_idx), self.mlp_dynamic_expert_num), dtype=hidden_states.dtype,
                                       device=hidden_states.device)
            group_weight.scatter_(dim=-1, index=group_selected_experts, src=group_routing_weights)
            routing_weights.index_add_(0, group_idx, group_weight)
            expert_mask.index_add_(0, group_idx, group_expert_mask.to(expert_mask.dtype))

        routing_weights = routing_weights / (
            routing_weights.sum(dim=-1).unsqueeze(-1).expand(-1, routing_weights.shape[-1]) + 1e-6)

        if attention_mask is not None:
            assert len(attention_mask.shape) == 2, f"{attention_mask.shape}"
            attention_mask = attention_mask.to(expert_mask.dtype).view(-1).unsqueeze(-1).expand(-1, self.num_experts)
            expert_mask = expert_mask * attention_mask

        if self.mlp_dynamic_expert_num < self.num_experts:
            expert_mask[:, self.mlp_dynamic_expert_num:] = 1  # shared experts see every token

        aux_loss = load_balancing_loss_func(
            expert_mask=expert_mask,
            mlp_dynamic_expert_num=self.mlp_dynamic_expert_num,
            global_weight=None,
            full_router_logits=full_router_logits,
            routing_weights=routing_weights,
            aux_balance_weight=aux_balance_weight,
        )

        if self.token_drop:
            expert_mask_dtype = expert_mask.dtype
            capacity = _capacity(batch_size * sequence_length, self.mlp_dynamic_expert_num,
                                 torch.tensor(self.capacity_factor), torch.tensor(self.min_capacity))
            if self.drop_policy == "probs":
                if capacity > dynamic_router_logits.shape[0]:
                    print(f"[warning] token capacity({capacity}) > token num({dynamic_router_logits.shape[0]}), "
                          f"setting capacity=token num")
                    capacity = dynamic_router_logits.shape[0]
                dynamic_expert_mask = expert_mask[:, : self.mlp_dynamic_expert_num].bool()
                token_drop_router_logits = torch.masked_fill(dynamic_router_logits, ~dynamic_expert_mask,
                                                             torch.finfo(dynamic_router_logits.dtype).min)
                capacity_probs, capacity_indices = torch.topk(token_drop_router_logits, k=capacity, dim=0,
                                                              sorted=False)
                capacity_mask = torch.zeros_like(expert_mask).scatter(0, capacity_indices, 1)
                capacity_mask[:, self.mlp_dynamic_expert_num:] = 1
                expert_mask = torch.logical_and(expert_mask, capacity_mask)

                ori_token_num = dynamic_expert_mask.sum().item()
                cur_token_num = expert_mask[:, : self.mlp_dynamic_expert_num].sum().item()
                if self.drop_token_num_print and ("RANK" not in os.environ or int(os.environ["RANK"]) == 0):
                    print(f"drop {ori_token_num - cur_token_num} tokens from total {ori_token_num} tokens")

            elif self.drop_policy == "position":
                locations = torch.cumsum(expert_mask, dim=0) - 1
                expert_mask *= torch.lt(locations, capacity)
            else:
                raise ValueError(f"Invalid drop_policy: {self.drop_policy}")
            expert_mask = expert_mask.to(expert_mask_dtype)

            routing_weights = routing_weights.masked_fill(~(expert_mask[:, : self.mlp_dynamic_expert_num].bool()), 0.0)
            routing_weights = routing_weights / (
                routing_weights.sum(dim=-1).unsqueeze(-1).expand(-1, routing_weights.shape[-1]) + 1e-6)

        if self.mlp_dynamic_expert_num < self.num_experts:
            global_weight = cal_global_weight(expert_mask, full_router_logits, self.mlp_dynamic_expert_num,
                                              routing_weights)
        else:
            global_weight = routing_weights
        assert ((expert_mask == 0) & (attention_mask == 1) & (global_weight != 0)).sum() == 0

        hidden_states = original_hidden_states.view(-1, hidden_dim)
        final_hidden_states = torch.zeros((batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype,
                                          device=hidden_states.device)
        global_weight = global_weight.to(hidden_states.dtype)
        current_hidden_states = self.dynamic_real_moe(
            hidden_states,
            expert_mask=expert_mask[:, : self.mlp_dynamic_real_expert_num],
            router_weight=global_weight[:, : self.mlp_dynamic_real_expert_num],
        )
        final_hidden_states = final_hidden_states + current_hidden_states

        for expert_idx in range(self.mlp_fixed_expert_num):
            expert_layer = self.fixed_real_moe[expert_idx]
            current_state = hidden_states
            current_global_weight = global_weight[:, self.mlp_dynamic_expert_num + expert_idx].unsqueeze(-1)
            current_hidden_states = expert_layer(current_state) * current_global_weight
            final_hidden_states = final_hidden_states + current_hidden_states

        final_hidden_states = final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)

        if not self.training and self.avg_hidden_states_last:
            dist.all_reduce(final_hidden_states, op=dist.ReduceOp.AVG,
                            group=self.dynamic_real_moe.deepspeed_moe.ep_group)

        return final_hidden_states, full_router_logits, dynamic_top_k, expert_mask, global_weight, aux_loss


class UniMoEV2MLPCall(nn.Module):
    """The decoder's MLP call, with the padding mask the top-level forward derives from the attention mask."""

    def __init__(self):
        super().__init__()
        self.mlp = UniMoEV2MoESparseMoeBlock(UniMoEV2Qwen2VLConfig())

    def forward(self, hidden_states):
        # the processor's attention mask for unpadded prompts; the collator's aux_balance_weight is training-only
        attention_mask = torch.ones(hidden_states.shape[:2], dtype=torch.long, device=hidden_states.device)
        aux_balance_weight = None
        padding_token_mask = attention_mask.bool()
        hidden_states, router_logits, router_top_k, router_expert_mask, router_weight, aux_loss = self.mlp(
            hidden_states, padding_token_mask, aux_balance_weight)
        return hidden_states


def build():
    return tiny(UniMoEV2MLPCall, HIDDEN, batch=BATCH)
