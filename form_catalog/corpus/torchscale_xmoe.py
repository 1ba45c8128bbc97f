"""TorchScale's X-MoE layer: GShard `MOELayer` with a cosine-routed `Top2Gate`, dense dispatch/combine matmuls.

Mirrors microsoft/torchscale `torchscale/component/xmoe/moe_layer.py` and `torchscale/component/xmoe/routing.py`
at commit 4d1e0e8 (`MOELayer.forward`, `MOELayer.all_to_all_wrapper`, `MOELayer.record_all_to_all_stats`,
`Top2Gate`, `top2gating`, `one_hot`, `entropy`, `gumbel_rsample`), with the experts from
`torchscale/component/feedforward_network.py` (`make_experts`, `FeedForwardNetwork`) and the MoE fields of
`torchscale/architecture/config.py` (`DecoderConfig`), built the way `DecoderLayer.__init__` builds its MoE
branch. The README enables X-MoE with `use_xmoe=True`; the config's `postprocessing` then forces
`moe_normalize_gate_prob_before_dropping=True` and `moe_second_expert_policy="random"`. `moe_top1_expert` is
off by default, so the gate is `Top2Gate` (fp32 gating on, eval token fraction 0.25). The gate projects the
flat tokens [S, M] to 16 dims (`wg_reduction`), renormalises its [E, 16] expert embeddings in place under
`torch.no_grad()` to norm 1.5 (a parameter written in forward), scores the cosine against the row-normalised
embeddings (the token side is not normalised), and replaces non-finite scores by the smallest finite one when
`not ok.all()`. `top2gating` takes the softmax, logs its entropy, sets the capacity to ceil(0.25 * S) in eval
(2 * ceil(S / E) in training), picks the argmax as first expert and, with the first masked to -inf, the
argmax as second (gumbel noise only for the "sampling" policy), renormalises the two gates by their clamped
sum before dropping, and then drops each second choice at random unless 2 * gate2 > `rand_like` (this runs in
eval too). A padding mask zeroes both masks when `input_mask.any()`. Slots are cumsum - 1 per expert, the
second choice's offset by the first choice's counts (or, with batch-prioritised routing, ranked by the top
gate through `argsort`); it computes the GShard aux loss, overflow percentages and `histc`/`sort` balance
statistics into a metadata dict, masks slots at or past capacity, builds [S, E, C] combine weights by `bmm`
of weights and one-hot slots, and the dispatch mask as their bool cast. The layer asserts one 3-d input, reads
`batch_size_valid` from the config (absent in TorchScale's config, so 0), and so takes the max-tokens branch:
the token count is made a tensor, reduced over the world and read back with `.item()`, the tokens are copied
into a zero buffer of that length and a padding mask of ones gets False on the real rows. It dispatches with
`mm(dispatch[E*C, S], x)`, reshapes to [world, E_local, C, M], `chunk`s along the experts and loops
`for chunk, expert in zip(chunks, self.experts)`, concatenates, combines with `mm(combine[S, E*C], out)`,
slices the padding off, stores the gate's metadata on the module, resets the all-to-all timers, and returns
(output, l_aux). Each expert is fc1 (with bias), GELU on a float32 copy cast back (`activation_fn="gelu"`,
here `F.gelu`), activation dropout, the sub-LayerNorm on the ffn width (`subln=True` by default), fc2, view to
the input shape and dropout (both p = 0.0).
Left out: distributed pieces in their one-process form: the all-reduce MAX of the token count is the
identity (the `.item()` read is kept), the all-to-all is the identity behind its `all2all_size > 1` test,
expert/all-to-all groups are None with world size 1, and the CUDA-event timing of the a2a stats (off by
`record_a2a_perf_stats`) is dropped; the Tutel fast-dispatch path (tutel not installed, `has_tutel` False)
and the fairseq base class; the padding branch's logger warning; `make_experts`' per-expert seeding (the
corpus weights replace the init). `histc` is applied to a float copy of the expert ids because CPU `histc`
rejects int64 (the original raises there). `use_xmoe=False` (the config default) keeps a plain linear router.
Constructs: `self.training`-dependent config reads and capacity, shape-dependent padding branches on the
config, a `.item()` host read sizing a zero buffer and slice assignments into it, a data-dependent
`if input_mask is not None and input_mask.any()` and `if not ok.all()`, an in-place parameter write under
`torch.no_grad()` in forward, `rand_like` second-expert dropping in eval, policy string branches, in-graph
logging statistics (`histc`, `sort`), `chunk` + `for chunk, expert in zip(...)`, dense dispatch/combine `mm`,
module attributes written in forward, and a tuple return.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._shell import Source, tiny

SOURCE = Source("microsoft/torchscale", "torchscale/component/xmoe/moe_layer.py",
                "4d1e0e82e5adf86dd424f1463192635b73fc8efc", "MOELayer.forward")
HIDDEN, INTER, EXPERTS = 16, 8, 8
EVAL_CAPACITY_TOKEN_FRACTION = 0.25
SAMPLE_FRACTION = 0.2

has_tutel, fused_cumsum_sub_one = False, lambda mask: torch.cumsum(mask, dim=0) - 1


class DecoderConfig:
    """The MoE and FFN fields of TorchScale's DecoderConfig (defaults as there, sizes tiny, X-MoE on)."""

    def __init__(self, **kwargs):
        self.decoder_embed_dim = kwargs.pop("decoder_embed_dim", HIDDEN)
        self.decoder_ffn_embed_dim = kwargs.pop("decoder_ffn_embed_dim", INTER)
        self.activation_fn = kwargs.pop("activation_fn", "gelu")
        self.dropout = kwargs.pop("dropout", 0.0)
        self.activation_dropout = kwargs.pop("activation_dropout", 0.0)
        self.moe_freq = kwargs.pop("moe_freq", 1)
        self.moe_top1_expert = kwargs.pop("moe_top1_expert", False)
        self.moe_expert_count = kwargs.pop("moe_expert_count", EXPERTS)
        self.moe_gating_use_fp32 = kwargs.pop("moe_gating_use_fp32", True)
        self.moe_eval_capacity_token_fraction = kwargs.pop("moe_eval_capacity_token_fraction", 0.25)
        self.moe_second_expert_policy = kwargs.pop("moe_second_expert_policy", "random")
        self.moe_normalize_gate_prob_before_dropping = kwargs.pop("moe_normalize_gate_prob_before_dropping", False)
        self.use_xmoe = kwargs.pop("use_xmoe", True)
        self.subln = kwargs.pop("subln", True)
        self.layernorm_eps = kwargs.pop("layernorm_eps", 1e-5)
        self.ddp_rank = kwargs.pop("ddp_rank", 0)
        self.postprocessing()

    def postprocessing(self):
        if self.use_xmoe:
            self.moe_normalize_gate_prob_before_dropping = True
            self.moe_second_expert_policy = "random"
            assert self.moe_freq > 0 and self.moe_expert_count > 0


gumbel_map: dict[torch.device, Any] = {}


def gumbel_rsample(shape, device):
    gumbel = gumbel_map.get(device)
    if gumbel is None:
        one = torch.tensor(1.0, device=device)
        zero = torch.tensor(0.0, device=device)
        gumbel = torch.distributions.gumbel.Gumbel(zero, one).rsample
        gumbel_map[device] = gumbel
    return gumbel(shape)


def one_hot(indices: Tensor, num_classes: int, unsqueeze_indices=False) -> Tensor:
    if unsqueeze_indices:
        indices = indices.unsqueeze(-1)
    assert indices.shape[-1] == 1, "indices need a trailing dimension of size 1"
    out = torch.zeros(indices.shape[:-1] + (num_classes,), device=indices.device, dtype=indices.dtype)
    out.scatter_(len(out.shape) - 1, indices, 1)
    return out


def entropy(probs):
    logits = torch.distributions.utils.probs_to_logits(probs)
    p_log_p = probs * logits
    return -p_log_p.sum(-1)


def top2gating(logits, input_mask=None, use_fp32=False, second_expert_policy="sampling",
               normalize_gate_prob_before_dropping=False, eval_mode=False, moe_eval_capacity_token_fraction=0.25,
               batch_prioritized_routing=False):
    metadata = {}
    if use_fp32:
        orig_dtype = logits.dtype
        logits = logits.float()
    gates = F.softmax(logits, dim=1)
    metadata["entropy_gating"] = entropy(probs=gates).mean().detach()
    num_tokens = gates.shape[0]
    num_experts = gates.shape[1]
    if moe_eval_capacity_token_fraction > 0.0 and eval_mode:
        capacity = math.ceil(moe_eval_capacity_token_fraction * num_tokens)
    else:
        capacity = 2 * math.ceil(num_tokens / num_experts)

    indices1_s = torch.argmax(gates, dim=1, keepdim=True)
    mask1 = one_hot(indices1_s, num_experts)
    if second_expert_policy == "sampling":
        logits_w_noise = logits + gumbel_rsample(logits.shape, device=logits.device)
    else:
        logits_w_noise = logits
    logits_except1 = logits_w_noise.masked_fill(mask1.bool(), float("-inf"))
    indices2_s = torch.argmax(logits_except1, dim=1, keepdim=True)
    mask2 = one_hot(indices2_s, num_experts)
    gates1_s = (gates * mask1).sum(dim=1)
    gates2_s = (gates * mask2).sum(dim=1)

    if normalize_gate_prob_before_dropping:
        denom_s = gates1_s + gates2_s
        denom_s = torch.clamp(denom_s, min=torch.finfo(denom_s.dtype).eps)
        gates1_s = gates1_s / denom_s
        gates2_s = gates2_s / denom_s

    if second_expert_policy == "random":
        sampled = (2 * gates2_s) > torch.rand_like(gates2_s)
        mask2 = mask2 * sampled.repeat(num_experts, 1).transpose(1, 0)

    if input_mask is not None and input_mask.any():
        nonpadding = ~input_mask
        mask1 = mask1 * nonpadding.unsqueeze(-1).to(mask1.dtype)
        mask2 = mask2 * nonpadding.unsqueeze(-1).to(mask1.dtype)

    if batch_prioritized_routing:
        importance_scores = -1 * gates.max(dim=1)[0]
        sorted_mask1 = mask1[importance_scores.argsort(dim=0)]
        sorted_cumsum1 = fused_cumsum_sub_one(sorted_mask1) * sorted_mask1
        importance_sorted_locations1 = sorted_cumsum1[importance_scores.argsort(dim=0).argsort(dim=0)]
        sorted_mask2 = mask2[importance_scores.argsort(dim=0)]
        sorted_cumsum2 = fused_cumsum_sub_one(sorted_mask2) * sorted_mask2
        importance_sorted_locations2 = sorted_cumsum2[importance_scores.argsort(dim=0).argsort(dim=0)]
        importance_sorted_locations2 += torch.sum(mask1, dim=0, keepdim=True)
        locations1, locations2 = importance_sorted_locations1, importance_sorted_locations2
    else:
        locations1 = fused_cumsum_sub_one(mask1)
        locations2 = fused_cumsum_sub_one(mask2)
        locations2 += torch.sum(mask1, dim=0, keepdim=True)

    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask1.to(gates.dtype), dim=0)
    l_aux = torch.mean(me * ce)
    l_aux = l_aux * num_experts * num_experts

    metadata["overflow_expert1"] = 100 * torch.sum(mask1 * torch.ge(locations1, capacity)) / torch.sum(mask1)
    metadata["overflow_expert2"] = 100 * torch.sum(mask2 * torch.ge(locations2, capacity)) / torch.sum(mask2)

    mask1 = mask1 * torch.lt(locations1, capacity)
    mask2 = mask2 * torch.lt(locations2, capacity)

    expert1_hist = 100 * torch.histc((indices1_s.squeeze() + 1).float(), bins=num_experts, min=1,
                                     max=num_experts) / num_tokens
    metadata["unused_expert1_count"] = (expert1_hist == 0).sum()
    expert1_hist = torch.sort(expert1_hist, dim=0, descending=True).values + torch.finfo(torch.float32).tiny

    expert2_hist = 100 * torch.histc((indices2_s.squeeze() + 1).float(), bins=num_experts, min=1,
                                     max=num_experts) / num_tokens
    metadata["unused_expert2_count"] = (expert2_hist == 0).sum()
    expert2_hist = torch.sort(expert2_hist, dim=0, descending=True).values + torch.finfo(torch.float32).tiny

    sample_count = max(math.ceil(num_experts * SAMPLE_FRACTION), 1)
    metadata["expert1_balance_top"] = expert1_hist[:sample_count].sum()
    metadata["expert1_balance_bottom"] = expert1_hist[-sample_count:].sum()
    metadata["expert2_balance_top"] = expert2_hist[:sample_count].sum()
    metadata["expert2_balance_bottom"] = expert2_hist[-sample_count:].sum()

    if not normalize_gate_prob_before_dropping:
        gates1_s = (gates * mask1).sum(dim=1)
        gates2_s = (gates * mask2).sum(dim=1)
        denom_s = gates1_s + gates2_s
        denom_s = torch.clamp(denom_s, min=torch.finfo(denom_s.dtype).eps)
        gates1_s /= denom_s
        gates2_s /= denom_s

    locations1_s = torch.sum(locations1 * mask1, dim=1)
    locations2_s = torch.sum(locations2 * mask2, dim=1)

    gates1 = gates1_s.unsqueeze(-1) * mask1.to(gates1_s.dtype)
    gates2 = gates2_s.unsqueeze(-1) * mask2.to(gates2_s.dtype)
    locations1_sc = one_hot(locations1_s, num_classes=capacity, unsqueeze_indices=True)
    locations2_sc = one_hot(locations2_s, num_classes=capacity, unsqueeze_indices=True)
    combine1_sec = torch.bmm(gates1.unsqueeze(-1), locations1_sc.to(gates1.dtype).unsqueeze(1))
    combine2_sec = torch.bmm(gates2.unsqueeze(-1), locations2_sc.to(gates2.dtype).unsqueeze(1))
    combine_weights = combine1_sec + combine2_sec
    dispatch_mask = combine_weights.bool()
    if use_fp32:
        return l_aux, combine_weights.to(orig_dtype), dispatch_mask, metadata
    else:
        return l_aux, combine_weights, dispatch_mask, metadata


class Top2Gate(nn.Module):
    def __init__(self, model_dim, num_experts, use_fp32=False, second_expert_policy="sampling",
                 normalize_gate_prob_before_dropping=False, moe_eval_capacity_token_fraction=0.25,
                 batch_prioritized_routing=False, use_xmoe=False):
        super().__init__()
        if not use_xmoe:
            self.wg = nn.Linear(model_dim, num_experts, bias=False)
        else:
            self.wg_reduction = nn.Linear(model_dim, 16, bias=False)
            wg = torch.empty(num_experts, 16)
            nn.init.orthogonal_(wg, gain=0.32)
            self.register_parameter("wg", nn.Parameter(wg))
        self.use_fp32 = use_fp32
        self.second_expert_policy = second_expert_policy
        self.normalize_gate_prob_before_dropping = normalize_gate_prob_before_dropping
        self.moe_eval_capacity_token_fraction = moe_eval_capacity_token_fraction
        self.batch_prioritized_routing = batch_prioritized_routing
        self.use_xmoe = use_xmoe

    def forward(self, input, mask=None):
        if self.use_xmoe:
            input = self.wg_reduction(input)
            with torch.no_grad():
                wg_norm = self.wg.norm(p=2.0, dim=1, keepdim=True)
                self.wg.mul_(1.5 / wg_norm)
            logits = self._cosine(input, self.wg)
            logits = self._make_finite(logits)
        else:
            logits = self.wg(input)
        return top2gating(
            logits,
            mask,
            use_fp32=self.use_fp32,
            second_expert_policy=self.second_expert_policy,
            normalize_gate_prob_before_dropping=self.normalize_gate_prob_before_dropping,
            eval_mode=not self.training,
            moe_eval_capacity_token_fraction=self.moe_eval_capacity_token_fraction,
            batch_prioritized_routing=self.batch_prioritized_routing,
        )

    def _cosine(self, mat1, mat2, eps=1e-4):
        assert mat1.dim() == 2
        assert mat2.dim() == 2
        mat2 = F.normalize(mat2.float(), p=2.0, dim=1, eps=eps)
        return mat1.float().matmul(mat2.transpose(0, 1)).type_as(mat1)

    def _make_finite(self, scores):
        ok = scores.isfinite()
        if not ok.all():
            scores[~ok] = scores[ok].min()
        return scores


class FeedForwardNetwork(nn.Module):
    def __init__(self, embed_dim, ffn_dim, activation_fn, dropout, activation_dropout, layernorm_eps, subln=False):
        super().__init__()
        self.embed_dim = embed_dim
        assert activation_fn == "gelu"
        self.activation_fn = F.gelu
        self.activation_dropout_module = nn.Dropout(activation_dropout)
        self.dropout_module = nn.Dropout(dropout)
        self.fc1 = nn.Linear(self.embed_dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, self.embed_dim)
        self.ffn_layernorm = nn.LayerNorm(ffn_dim, eps=layernorm_eps) if subln else None

    def forward(self, x):
        x_shape = x.shape
        x = x.reshape(-1, x.size(-1))
        x = self.fc1(x)
        x = self.activation_fn(x.float()).type_as(x)
        x = self.activation_dropout_module(x)
        if self.ffn_layernorm is not None:
            x = self.ffn_layernorm(x)
        x = self.fc2(x)
        x = x.view(x_shape)
        x = self.dropout_module(x)
        return x


def make_experts(args, embed_dim, expert_ffn_dim):
    world_size = 1
    assert args.moe_expert_count >= world_size and args.moe_expert_count % world_size == 0
    local_moe_expert_count = args.moe_expert_count // world_size
    expert_list = [
        FeedForwardNetwork(embed_dim, expert_ffn_dim, args.activation_fn, args.dropout, args.activation_dropout,
                           args.layernorm_eps, args.subln)
        for _ in range(local_moe_expert_count)
    ]
    return nn.ModuleList(expert_list)


class MOELayer(nn.Module):
    def __init__(self, gate, experts, args):
        super().__init__()
        self.gate = gate
        if type(experts) is nn.ModuleList:
            self.experts = experts
        else:
            self.experts = nn.ModuleList([experts])
        self.expert_group = None
        self.all2all_group = None
        self.world_size = 1
        self.all2all_size = 1
        for p in experts.parameters():
            p.expert = True
        self.num_local_experts = len(self.experts)
        self.args = args
        self.in_generation = False
        self.a2a_cuda_event_intervals = []
        self.a2a_cpu_time_ms = 0.0

    def forward(self, *input: Tensor, input_padding_mask=None, **kwargs: Any):
        assert len(input) == 1, "one input tensor only"
        input = input[0]
        assert len(input.shape) == 3, "input must be (sequence, token, model)"
        if input_padding_mask is not None:
            assert len(input_padding_mask.shape) == 2, "padding mask must be (sequence, token)"
            assert input_padding_mask.shape[0] == input.shape[0]
            assert input_padding_mask.shape[1] == input.shape[1]

        d_model = input.shape[2]
        input_shape = list(input.shape)
        expected_bsz = (
            getattr(self.args, "batch_size", 0) if self.training else getattr(self.args, "batch_size_valid", 0)
        )
        if expected_bsz is None:
            expected_bsz = 0
        if not self.in_generation and expected_bsz != 0 and input_shape[0] != expected_bsz:
            assert input_shape[0] < expected_bsz, f"{input_shape[0]} < {expected_bsz}"
            padded_input = torch.zeros((expected_bsz, input_shape[1], input_shape[2]), dtype=input.dtype,
                                       layout=input.layout, device=input.device)
            padded_input[: input_shape[0], :, :] = input
            input = padded_input
            padded_input_padding_mask = torch.ones((expected_bsz, input_shape[1]), dtype=torch.bool,
                                                   device=input.device)
            if input_padding_mask is not None:
                padded_input_padding_mask[: input_shape[0], :] = input_padding_mask
            else:
                padded_input_padding_mask[: input_shape[0], :] = False
            input_padding_mask = padded_input_padding_mask

        reshaped_input = input.reshape(-1, d_model)
        reshaped_input_shape = reshaped_input.shape
        reshaped_input_padding_mask = input_padding_mask.reshape(-1) if input_padding_mask is not None else None

        if expected_bsz == 0:
            expected_dim = reshaped_input_shape[0] * torch.ones((1,), dtype=torch.long, device=input.device)
            # all-reduce (MAX) over the world: the identity in one process
            expected_dim = int(expected_dim.item())
            padded_input = torch.zeros((expected_dim, reshaped_input_shape[1]), dtype=input.dtype,
                                       layout=input.layout, device=input.device)
            padded_input[: reshaped_input_shape[0], :] = reshaped_input
            reshaped_input = padded_input
            padded_input_padding_mask = torch.ones((expected_dim,), dtype=torch.bool, device=padded_input.device)
            if reshaped_input_padding_mask is not None:
                padded_input_padding_mask[: reshaped_input_shape[0]] = reshaped_input_padding_mask
            else:
                padded_input_padding_mask[: reshaped_input_shape[0]] = False
            reshaped_input_padding_mask = padded_input_padding_mask

        l_aux, combine_weights, dispatch_mask, self.metadata = self.gate(reshaped_input, reshaped_input_padding_mask)
        dispatch_mask = dispatch_mask.to(input.dtype).permute(1, 2, 0)
        E, C, S = dispatch_mask.size()
        M = reshaped_input.size(1)
        assert reshaped_input.size() == (S, M)
        dispatched_input = torch.mm(dispatch_mask.view(E * C, S), reshaped_input)

        if self.all2all_size > 1:
            dispatched_input = self.all_to_all_wrapper(dispatched_input)

        dispatched_input = dispatched_input.reshape(self.all2all_size, self.num_local_experts, -1, d_model)
        chunks = dispatched_input.chunk(self.num_local_experts, dim=1)
        expert_outputs = []
        for chunk, expert in zip(chunks, self.experts, strict=False):
            expert_outputs += [expert(chunk)]
        expert_output = torch.cat(expert_outputs, dim=1)

        if self.all2all_size > 1:
            expert_output = self.all_to_all_wrapper(expert_output)

        expert_output = expert_output.reshape(self.all2all_size * self.num_local_experts, -1, d_model)
        combined_output = combine_weights.view(S, E * C).mm(expert_output.view(E * C, M))

        combined_output = combined_output[: reshaped_input_shape[0], :]
        combined_output = combined_output.reshape(input.shape)
        combined_output = combined_output[: input_shape[0], :, :]

        self.record_all_to_all_stats()

        return combined_output, l_aux

    def prepare_for_inference_(self):
        self.in_generation = True

    def all_to_all_wrapper(self, input: Tensor):
        # one process: the exchange hands the (contiguous) input back
        return input.contiguous()

    def record_all_to_all_stats(self):
        if getattr(self.args, "record_a2a_perf_stats", False):
            self.metadata["all_to_all_cpu_time_ms"] = self.a2a_cpu_time_ms
        self.a2a_cpu_time_ms = 0.0
        self.a2a_cuda_event_intervals = []


def build_moe_layer(args: DecoderConfig | None = None) -> MOELayer:
    """The MoE branch of `DecoderLayer.__init__` (top-2 unless `moe_top1_expert`, which is off)."""
    args = args or DecoderConfig()
    assert not args.moe_top1_expert
    gate = Top2Gate(args.decoder_embed_dim, args.moe_expert_count, args.moe_gating_use_fp32,
                    args.moe_second_expert_policy, args.moe_normalize_gate_prob_before_dropping,
                    args.moe_eval_capacity_token_fraction, use_xmoe=args.use_xmoe)
    experts = make_experts(args, args.decoder_embed_dim, args.decoder_ffn_embed_dim)
    return MOELayer(gate, experts, args)


def build():
    return tiny(build_moe_layer, HIDDEN)
