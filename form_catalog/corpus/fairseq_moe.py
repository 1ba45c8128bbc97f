"""fairseq's GShard `MOELayer` with `Top2Gate`: capacity-limited top-2 routing as dense matmul dispatch/combine.

Mirrors facebookresearch/fairseq `fairseq/modules/moe/top2gate.py` and `fairseq/modules/moe/moe_layer.py` at
commit 26d62ae (`top2gating`, `Top2Gate.forward`, `MOELayer.forward`, `one_hot`, `entropy`,
`get_fused_cumsum_sub_one`), with the experts as the moe branch's `FeedForwardNetwork` (fc1, activation,
dropout, fc2, dropout). The gate is a bias-free linear router on the flattened tokens [S, M]; it takes the
softmax, the argmax as first expert and, after masking it with -inf on the logits, the argmax of the
(optionally gumbel-noised) logits as second. In eval the capacity is ceil(0.25 * S) (the eval token
fraction), in training 2 * ceil(S / E). Slots are cumsum(mask) - 1 along the tokens, the second choice's
slots offset by the first choice's per-expert counts; assignments at or past the capacity are dropped. The
gate also computes logging metadata in the forward (gate entropy, overflow percentages, `histc` expert
histograms sorted for balance statistics, unused-expert counts) and the GShard aux loss. The two kept gates
are renormalised by their clamped sum, turned into [S, E] weights, multiplied with one-hot slots via
`torch.bmm` into combine weights [S, E, C], and the dispatch mask is their boolean cast. The layer asserts
the input shapes, pads the batch up to `batch_size_valid` when it differs (not the case here), flattens to
[S, M], dispatches with `mm(dispatch[E*C, S], x)`, reshapes to [world, E_local, C, M], `chunk`s along the
experts and loops `for chunk, expert in zip(chunks, self.experts)`, concatenates, and combines with
`mm(combine[S, E*C], out[E*C, M])`, then slices the padding off and returns (output, {"moe_gate_loss": l_aux}).
Left out: all-to-all and its timing (one process, so the world size is 1), the Tutel fast-dispatch path
(`use_tutel` off), prefix-token language statistics (`prefix_tokens` is None), batch-prioritized routing
(off by default) and the max-tokens padding branch that all-reduces the token count (it needs an
initialised process group; the config sets `batch_size_valid`). `histc` is applied to a float copy of the
indices because CPU `histc` rejects int64. The model uses `second_expert_policy="all"` (no gumbel noise) so
eval outputs are deterministic; fairseq's default `sampling` adds gumbel noise even in eval.
Constructs: `if self.training`-dependent capacity (`eval_mode=not self.training`), Python `math.ceil`
capacity on shapes, policy string branches, in-graph logging statistics (`histc`, `sort`, divisions), a
shape-dependent padding branch on `args`, `chunk` + `for chunk, expert in zip(...)` expert loop, dense
dispatch/combine `mm` (no gathers), and a dict in the returned tuple.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("facebookresearch/fairseq", "fairseq/modules/moe/moe_layer.py",
                "26d62ae8fbf3deccf01a138d704be1e5c346ca9a", "MOELayer.forward")
HIDDEN, INTER, EXPERTS = 16, 8, 4
SAMPLE_FRACTION = 0.2


class Args:
    """The argparse namespace fairseq hands the layer (only the fields its forward reads)."""

    moe_expert_count = EXPERTS
    batch_size = 1
    batch_size_valid = 1
    use_tutel_moe = False
    moe_eval_capacity_max_seqlen = False
    record_a2a_perf_stats = False
    dummy_a2a = False


def one_hot(indices: torch.Tensor, num_classes: int, unsqueeze_indices=False) -> torch.Tensor:
    if unsqueeze_indices:
        indices = indices.unsqueeze(-1)
    assert indices.shape[-1] == 1, "last dimension of indices must be have size 1"
    out = torch.zeros(indices.shape[:-1] + (num_classes,), device=indices.device, dtype=indices.dtype)
    out.scatter_(len(out.shape) - 1, indices, 1)
    return out


def entropy(probs):
    logits = torch.distributions.utils.probs_to_logits(probs)
    return -(probs * logits).sum(-1)


def gumbel_rsample(shape, device):
    zero, one = torch.tensor(0.0, device=device), torch.tensor(1.0, device=device)
    return torch.distributions.gumbel.Gumbel(zero, one).rsample(shape)


def get_fused_cumsum_sub_one(use_tutel):
    return lambda mask: torch.cumsum(mask, dim=0) - 1


def top2gating(logits, input_mask=None, use_fp32=False, second_expert_policy="sampling",
               normalize_gate_prob_before_dropping=False, eval_mode=False, moe_eval_capacity_token_fraction=0.25,
               batch_prioritized_routing=False, moe_eval_capacity_length=None):
    metadata = {}
    if use_fp32:
        orig_dtype = logits.dtype
        logits = logits.float()
    gates = F.softmax(logits, dim=1)
    metadata["entropy_gating"] = entropy(probs=gates).mean().detach()

    num_tokens, num_experts = gates.shape[0], gates.shape[1]
    if moe_eval_capacity_token_fraction > 0.0 and eval_mode:
        if moe_eval_capacity_length is None:
            capacity = math.ceil(moe_eval_capacity_token_fraction * num_tokens)
        else:
            capacity = math.ceil(moe_eval_capacity_token_fraction * moe_eval_capacity_length)
    else:
        capacity = 2 * math.ceil(num_tokens / num_experts)

    first = torch.argmax(gates, dim=1, keepdim=True)
    mask1 = one_hot(first, num_experts)
    if second_expert_policy == "sampling":
        noisy = logits + gumbel_rsample(logits.shape, device=logits.device)
    else:
        noisy = logits
    second = torch.argmax(noisy.masked_fill(mask1.bool(), float("-inf")), dim=1, keepdim=True)
    mask2 = one_hot(second, num_experts)

    gates1_s = (gates * mask1).sum(dim=1)
    gates2_s = (gates * mask2).sum(dim=1)
    if normalize_gate_prob_before_dropping:
        denom = torch.clamp(gates1_s + gates2_s, min=torch.finfo(gates1_s.dtype).eps)
        gates1_s, gates2_s = gates1_s / denom, gates2_s / denom

    if second_expert_policy == "random":
        sampled = (2 * gates2_s) > torch.rand_like(gates2_s)
        mask2 = mask2 * sampled.repeat(num_experts, 1).transpose(1, 0)

    if input_mask is not None:
        nonpadding = ~input_mask
        mask1 = mask1 * nonpadding.unsqueeze(-1).to(mask1.dtype)
        mask2 = mask2 * nonpadding.unsqueeze(-1).to(mask1.dtype)
    metadata["median_prefix_count_expert1"] = 0

    cumsum_sub_one = get_fused_cumsum_sub_one(False)
    if batch_prioritized_routing:
        order = (-1 * gates.max(dim=1)[0]).argsort(dim=0)
        back = order.argsort(dim=0)
        loc1 = (cumsum_sub_one(mask1[order]) * mask1[order])[back]
        loc2 = (cumsum_sub_one(mask2[order]) * mask2[order])[back]
        loc2 += torch.sum(mask1, dim=0, keepdim=True)
    else:
        loc1 = cumsum_sub_one(mask1)
        loc2 = cumsum_sub_one(mask2)
        loc2 += torch.sum(mask1, dim=0, keepdim=True)

    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask1.to(gates.dtype), dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts

    metadata["overflow_expert1"] = 100 * torch.sum(mask1 * torch.ge(loc1, capacity)) / torch.sum(mask1)
    metadata["overflow_expert2"] = 100 * torch.sum(mask2 * torch.ge(loc2, capacity)) / torch.sum(mask2)

    mask1 = mask1 * torch.lt(loc1, capacity)
    mask2 = mask2 * torch.lt(loc2, capacity)

    sample_count = max(math.ceil(num_experts * SAMPLE_FRACTION), 1)
    for rank, chosen in (("1", first), ("2", second)):
        hist = 100 * torch.histc((chosen.squeeze() + 1).float(), bins=num_experts, min=1, max=num_experts)
        hist = hist / num_tokens
        metadata[f"unused_expert{rank}_count"] = (hist == 0).sum()
        hist = torch.sort(hist, dim=0, descending=True).values + torch.finfo(torch.float32).tiny
        metadata[f"expert{rank}_balance_top"] = hist[:sample_count].sum()
        metadata[f"expert{rank}_balance_bottom"] = hist[-sample_count:].sum()

    if not normalize_gate_prob_before_dropping:
        gates1_s = (gates * mask1).sum(dim=1)
        gates2_s = (gates * mask2).sum(dim=1)
        denom = torch.clamp(gates1_s + gates2_s, min=torch.finfo(gates1_s.dtype).eps)
        gates1_s /= denom
        gates2_s /= denom

    slot1 = torch.sum(loc1 * mask1, dim=1)
    slot2 = torch.sum(loc2 * mask2, dim=1)
    weights1 = gates1_s.unsqueeze(-1) * mask1.to(gates1_s.dtype)
    weights2 = gates2_s.unsqueeze(-1) * mask2.to(gates2_s.dtype)
    slot1_sc = one_hot(slot1, num_classes=capacity, unsqueeze_indices=True)
    slot2_sc = one_hot(slot2, num_classes=capacity, unsqueeze_indices=True)
    combine1 = torch.bmm(weights1.unsqueeze(-1), slot1_sc.to(weights1.dtype).unsqueeze(1))
    combine2 = torch.bmm(weights2.unsqueeze(-1), slot2_sc.to(weights2.dtype).unsqueeze(1))
    combine_weights = combine1 + combine2
    dispatch_mask = combine_weights.bool()
    if use_fp32:
        return l_aux, combine_weights.to(orig_dtype), dispatch_mask, metadata
    return l_aux, combine_weights, dispatch_mask, metadata


class Top2Gate(nn.Module):
    def __init__(self, model_dim, num_experts, use_fp32=False, second_expert_policy="sampling",
                 normalize_gate_prob_before_dropping=False, moe_eval_capacity_token_fraction=0.25,
                 batch_prioritized_routing=False):
        super().__init__()
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.use_fp32 = use_fp32
        self.second_expert_policy = second_expert_policy
        self.normalize_gate_prob_before_dropping = normalize_gate_prob_before_dropping
        self.moe_eval_capacity_token_fraction = moe_eval_capacity_token_fraction
        self.batch_prioritized_routing = batch_prioritized_routing

    def forward(self, input, mask=None, moe_eval_capacity_length=None):
        return top2gating(
            self.wg(input), mask, use_fp32=self.use_fp32, second_expert_policy=self.second_expert_policy,
            normalize_gate_prob_before_dropping=self.normalize_gate_prob_before_dropping,
            eval_mode=not self.training, moe_eval_capacity_token_fraction=self.moe_eval_capacity_token_fraction,
            batch_prioritized_routing=self.batch_prioritized_routing,
            moe_eval_capacity_length=moe_eval_capacity_length,
        )


class FeedForwardNetwork(nn.Module):
    def __init__(self, embed_dim, ffn_dim, dropout=0.1, activation_dropout=0.0):
        super().__init__()
        self.fc1 = nn.Linear(embed_dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, embed_dim)
        self.activation_dropout_module = nn.Dropout(activation_dropout)
        self.dropout_module = nn.Dropout(dropout)

    def forward(self, x):
        x = self.activation_dropout_module(F.relu(self.fc1(x)))
        return self.dropout_module(self.fc2(x))


class MOELayer(nn.Module):
    def __init__(self, gate, experts, args, max_positions: int | None = None, tok_dropout=0.0):
        super().__init__()
        self.gate = gate
        self.experts = experts if type(experts) is nn.ModuleList else nn.ModuleList([experts])
        self.world_size = 1
        self.all2all_size = 1
        self.num_local_experts = len(self.experts)
        self.args = args
        self.in_generation = False
        self.a2a_cuda_event_intervals = []
        self.a2a_cpu_time_ms = 0.0
        self.use_tutel = getattr(args, "use_tutel_moe", False)
        self.moe_eval_capacity_max_seqlen = getattr(args, "moe_eval_capacity_max_seqlen", False)
        self.max_positions = max_positions
        self.tok_dropout = tok_dropout

    def forward(self, *input, input_padding_mask=None, **kwargs):
        assert len(input) == 1, "only single input Tensor supported"
        input = input[0]
        assert len(input.shape) == 3, "input Tensor must have dimensions: (s)equence, (t)oken, (m)odel"
        d_model = input.shape[2]
        input_shape = list(input.shape)
        expected_bsz = (getattr(self.args, "batch_size", 0) if self.training
                        else getattr(self.args, "batch_size_valid", 0))
        if expected_bsz is None:
            expected_bsz = 0
        if not self.in_generation and expected_bsz != 0 and input_shape[0] != expected_bsz:
            assert input_shape[0] < expected_bsz, f"{input_shape[0]} < {expected_bsz}"
            padded = torch.zeros((expected_bsz, input_shape[1], input_shape[2]), dtype=input.dtype,
                                 layout=input.layout, device=input.device)
            padded[: input_shape[0], :, :] = input
            input = padded
            padded_mask = torch.ones((expected_bsz, input_shape[1]), dtype=torch.bool, device=input.device)
            if input_padding_mask is not None:
                padded_mask[: input_shape[0], :] = input_padding_mask
            else:
                padded_mask[: input_shape[0], :] = False
            input_padding_mask = padded_mask

        reshaped_input = input.reshape(-1, d_model)
        reshaped_shape = reshaped_input.shape
        reshaped_mask = input_padding_mask.reshape(-1) if input_padding_mask is not None else None

        if self.moe_eval_capacity_max_seqlen:
            eval_capacity_length = self.max_positions * input.shape[0]
        else:
            eval_capacity_length = None

        l_aux, combine_weights, dispatch_mask, self.metadata = self.gate(reshaped_input, reshaped_mask,
                                                                         eval_capacity_length)
        dispatch_mask = dispatch_mask.to(input.dtype).permute(1, 2, 0)
        E, C, S = dispatch_mask.size()
        M = reshaped_input.size(1)
        assert reshaped_input.size() == (S, M)
        dispatched = torch.mm(dispatch_mask.view(E * C, S), reshaped_input)

        dispatched = dispatched.reshape(self.all2all_size, self.num_local_experts, -1, d_model)
        chunks = dispatched.chunk(self.num_local_experts, dim=1)
        outputs = []
        for chunk, expert in zip(chunks, self.experts, strict=False):
            outputs += [expert(chunk)]
        expert_output = torch.cat(outputs, dim=1)
        if self.tok_dropout > 0.0:
            if self.training:
                keep = torch.empty(expert_output.shape[:-1], device=expert_output.device).uniform_() > self.tok_dropout
                expert_output = keep.unsqueeze(-1) * expert_output
            else:
                expert_output = expert_output * (1 - self.tok_dropout)
        expert_output = expert_output.reshape(self.all2all_size * self.num_local_experts, -1, d_model)

        combined = combine_weights.view(S, E * C).mm(expert_output.view(E * C, M))
        combined = combined[: reshaped_shape[0], :]
        combined = combined.reshape(input.shape)
        combined = combined[: input_shape[0], :, :]
        self.a2a_cpu_time_ms = 0.0
        self.a2a_cuda_event_intervals = []
        return combined, {"moe_gate_loss": l_aux}


def _layer():
    args = Args()
    gate = Top2Gate(HIDDEN, EXPERTS, second_expert_policy="all")
    experts = nn.ModuleList(FeedForwardNetwork(HIDDEN, INTER) for _ in range(EXPERTS))
    return MOELayer(gate, experts, args)


def build():
    return tiny(_layer, HIDDEN)
