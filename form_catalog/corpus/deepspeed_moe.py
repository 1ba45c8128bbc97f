"""DeepSpeed's `MoE` layer: GShard top-2 capacity gate, Gumbel-sampled second expert, sparse slot dispatch.

Mirrors deepspeedai/DeepSpeed `deepspeed/moe/sharded_moe.py` at commit edaa722 (`gumbel_rsample`, `einsum`,
`_capacity`, `_one_hot_to_float`, `_route_slots`, `_sparse_encode`, `_sparse_decode`, `top2gating`,
`TopKGate`, `MOELayer`), with `deepspeed/moe/experts.py` (`Experts`), `deepspeed/moe/layer.py` (`MoE`),
the `jit_script_compat` decorator from `deepspeed/utils/torch.py` and `bwc_tensor_model_parallel_world_size`
from `deepspeed/utils/bwc.py`. The layer is built as `MoE(hidden_size, expert, num_experts=8, k=2)` with the
wrapper's defaults: `ep_size=1`, `capacity_factor=1.0`, `eval_capacity_factor=1.0`, `min_capacity=4` (the
wrapper's default; the gate's own is 8), `use_residual=False`, no noisy-gate policy, `drop_tokens=True`,
`use_rts=True`, `use_tutel=False`, `top2_2nd_expert_sampling=True`; eval mode.
`MoE.forward(hidden_states, used_token=None)` calls `MOELayer.forward(*input)`, which reshapes `input[0]`
to tokens [S, M] and calls `TopKGate.forward(tokens, input[1], True, self.use_tutel)` (sparse routes on):
the gate scores a bias-free Linear in float32 (`F.linear` with `wg.weight.float()`), picks the eval
capacity factor by `self.training`, and for `k == 2` runs `top2gating`: softmax; `argmax` as first expert
and its `one_hot`; Gumbel noise (a `Gumbel(0, 1).rsample` bound method cached per device in a module-level
dict) added in place to the logits (`top2_2nd_expert_sampling` defaults to True and is passed whatever
`self.training` is, so the second expert is sampled in eval too); the first expert `masked_fill`ed with
-inf and a second `argmax`; queue slots by `cumsum - 1`, the second offset by the first's per-expert
counts; the aux loss mean(me * ce) * E * E; the per-expert counts; the capacity from `_capacity` (a
`@jit_script_compat` helper, which with torch >= 2.0 on Python 3.11 is `torch.compile(fn)`: ceil(S / E * 2 *
factor) as an int64 tensor, raised to `min_capacity` under a tensor `if`); both masks multiplied in place by
`torch.lt(slot, capacity)`; the kept gates picked with `einsum("se,se->s")` (USE_EINSUM is True, so
`torch.einsum`), renormalised by their sum clamped at eps with in-place `/=`; and, since `sparse_routes`,
evicted routes flagged -1 with `torch.where(mask.any(dim=1), idx, -1)`, returning (l_aux, capacity tensor,
E, stacked int32 indices [2, S], int32 slots [2, S], gates [2, S], counts). The layer stores l_aux and the
counts as attributes, reads the capacity on the host (`C = int(C)`), maps every route to a flat slot
e * C + c with a scratch slot E * C for evicted routes (`torch.where`), and `_sparse_encode` inverts the map:
a `full` source index with `scatter_` of token ids, a zero pad row `cat`ed on, `index_select` and a view
to [E, C, M]. The tensor-parallel world size is read (`groups.mpu` is None: 1); with `ep_size == 1` the
all-to-all branch is skipped and `.contiguous()` taken; the input is reshaped to [ep_size, E_local, C, M]
and `Experts.forward` `chunk`s it along dim 1 and loops `for chunk, expert in zip(chunks, experts)`
(dropping the second item of a tuple output), then `cat`s; the result is reshaped to [E, C, M],
`.contiguous()` again, and `_sparse_decode` `cat`s a zero row, `index_select`s every route's slot into
[2, S, M], weights by the gates and sums the two routes. `MoE.forward` returns (output, l_aux, exp_counts).
The expert is the user's module; here a Linear-GELU-Linear FFN (DeepSpeed's own unit test passes a
`Sequential` of two Linears); `Experts` deep-copies it per local expert.
Left out: expert-parallel communication (`_AllToAll` is an identity with one rank and is not reached with
`ep_size == 1`; the branches raise here if reached) and the `set_deepspeed_parallelism` process-group
setup (so `ep_group` stays None); the tensor-parallel `drop_tokens` / `gather_tokens` of
`deepspeed/moe/mappings.py` (behind `tensor_model_world_size > 1`, false with no mpu; raise if reached);
the Tutel fast dispatcher (`TUTEL_INSTALLED` False, `use_tutel` False; raise if reached); `top1gating` and
`topkgating` (k is 2; stubs raise); the no-drop capacity all-reduce (drop_tokens is True); the
`SynchronizedWallClockTimer` (behind `wall_clock_breakdown`, False; a stand-in that raises); `log_dist`
and the parameter tagging in `Experts.__init__` (logging and optimizer metadata); the residual-MoE branch
(`use_residual=False`); `multiplicative_jitter` (the Jitter policy, training only; raises). The
`jit_script_compat` fallbacks to `torch.jit.script` are kept, without their debug logging, and its version
test compares major.minor instead of parsing with `packaging`.
Constructs: `torch.compile`d helpers called from the forward (`_capacity` with a tensor `if`), a
module-level dict cache of a distribution's `rsample` bound method (Gumbel noise in eval), in-place `+=`
on logits, `argmax` + `one_hot` + `masked_fill` top-2, cumsum slots with in-place capacity masking,
einsum through a flag-dispatched helper, in-place `/=`, `torch.where` route flags, a host read
`int(C)` of a tensor capacity that sizes the dispatch buffer, `scatter_` + `index_select` encode/decode
with a pad row, module attributes written in forward, `*input` unpacking, config-gated distributed
branches, a `chunk` + `zip` expert loop with an `isinstance` tuple check, and a 3-tuple return.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn import Module

from ._shell import Source, tiny

SOURCE = Source("deepspeedai/DeepSpeed", "deepspeed/moe/sharded_moe.py",
                "edaa7221267243c7be7fb49c5d5f5c4fb97b4641", "MOELayer.forward")
HIDDEN, INTER, EXPERTS, TOP_K = 16, 32, 8, 2

TOPK_GATE_TIMER = "topk_gate"
MOE_TIMER = "moe"
FIRST_ALLTOALL_TIMER = "1st_a2a"
SECOND_ALLTOALL_TIMER = "2nd_a2a"

TUTEL_INSTALLED = False  # the `from tutel import moe` import fails here
USE_EINSUM = True

gumbel_map: dict[torch.device, Callable] = {}


class groups:  # noqa: N801 - stands in for the `deepspeed.utils.groups` module
    """One rank: no model-parallel unit, expert tensor parallelism of one."""

    mpu = None

    @staticmethod
    def _get_expert_model_parallel_world_size():
        return 1


def bwc_tensor_model_parallel_world_size(mpu=None):
    if mpu is None:
        return 1
    if hasattr(mpu, "get_tensor_model_parallel_world_size"):
        return mpu.get_tensor_model_parallel_world_size()
    elif hasattr(mpu, "get_slice_parallel_world_size"):
        return mpu.get_slice_parallel_world_size()
    else:
        return mpu.get_model_parallel_world_size()


def drop_tokens(input_, dim=0):
    raise NotImplementedError("deepspeed.moe.mappings.drop_tokens splits across tensor-parallel ranks")


def gather_tokens(input_, dim=0):
    raise NotImplementedError("deepspeed.moe.mappings.gather_tokens all-gathers across tensor-parallel ranks")


class SynchronizedWallClockTimer:
    """Stand-in: only used behind `wall_clock_breakdown`, which is False."""

    def __call__(self, name):
        raise NotImplementedError("deepspeed timers (wall_clock_breakdown is False)")


def required_torch_version(min_version):
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    want_major, want_minor = (int(part) for part in str(min_version).split(".")[:2])
    return (major, minor) >= (want_major, want_minor)


def jit_script_compat(fn):
    can_try_compile = (required_torch_version(min_version=2.0) and hasattr(torch, "compile")
                       and not (sys.version_info >= (3, 12) and not required_torch_version(min_version=2.4)))
    if can_try_compile:
        try:
            return torch.compile(fn)
        except Exception:
            pass
    try:
        return torch.jit.script(fn)
    except Exception:
        return fn


def gumbel_rsample(shape: tuple, device: torch.device) -> Tensor:
    gumbel = gumbel_map.get(device)
    if gumbel is None:
        one = torch.tensor(1.0, device=device)
        zero = torch.tensor(0.0, device=device)
        gumbel = torch.distributions.gumbel.Gumbel(zero, one).rsample
        gumbel_map[device] = gumbel
    return gumbel(shape)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, group, input: Tensor) -> Tensor:
        raise NotImplementedError("all_to_all_single across expert-parallel ranks")


def einsum(rule, a, b):
    if USE_EINSUM:
        return torch.einsum(rule, a, b)
    elif rule == "s,se->se":
        return a.reshape(a.shape[0], -1) * b
    elif rule == "se,sc->sec":
        return a.unsqueeze(2) * b.unsqueeze(1)
    elif rule == "se,se->s":
        return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).reshape(-1)
    elif rule == "se,sec->sec":
        return a.unsqueeze(2) * b
    elif rule == "sec,sm->ecm":
        s, e, c, m = a.shape[0], a.shape[1], a.shape[2], b.shape[1]
        return torch.matmul(a.reshape(s, -1).t(), b).reshape(e, c, m)
    elif rule == "sec,ecm->sm":
        return torch.matmul(a.reshape(a.shape[0], -1), b.reshape(-1, b.shape[-1]))
    elif rule == "ks,ksm->sm":
        k, s, m = b.shape[0], b.shape[1], b.shape[2]
        a = a.t().unsqueeze(1)
        b = b.reshape(k, -1).t().reshape(s, m, k)
        return torch.bmm(a, b.transpose(1, 2)).squeeze(2)
    else:
        return torch.einsum(rule, a, b)


@jit_script_compat
def _capacity(gates: Tensor, capacity_factor: Tensor, min_capacity: Tensor) -> Tensor:
    num_tokens = gates.shape[0]
    num_experts = gates.shape[1]
    capacity = torch.ceil((num_tokens / num_experts) * capacity_factor).to(torch.int64)
    if capacity < min_capacity:
        capacity = min_capacity.to(torch.int64)
    return capacity


@jit_script_compat
def _one_hot_to_float(x, num_classes):
    return F.one_hot(x, num_classes=num_classes).float()


def _route_slots(indices: Tensor, locations: Tensor, num_experts: int, capacity: int) -> Tensor:
    """Flat slot e * capacity + c of every (route, token); evicted routes go to one scratch slot."""
    flat_slot = indices.long() * capacity + locations.long()
    scratch = torch.full_like(flat_slot, num_experts * capacity)
    return torch.where(indices >= 0, flat_slot, scratch)


def _sparse_encode(reshaped_input: Tensor, slots: Tensor, num_experts: int, capacity: int) -> Tensor:
    num_tokens, d_model = reshaped_input.shape
    source = torch.full((num_experts * capacity + 1, ), num_tokens, dtype=torch.long, device=slots.device)
    tokens = torch.arange(num_tokens, device=slots.device).expand_as(slots)
    source.scatter_(0, slots.reshape(-1), tokens.reshape(-1))
    padded_input = torch.cat([reshaped_input, reshaped_input.new_zeros(1, d_model)])
    return padded_input.index_select(0, source[:-1]).view(num_experts, capacity, d_model)


def _sparse_decode(expert_output: Tensor, slots: Tensor, gates: Tensor, num_tokens: int) -> Tensor:
    d_model = expert_output.size(-1)
    padded_output = torch.cat([expert_output, expert_output.new_zeros(1, d_model)])
    routed = padded_output.index_select(0, slots.reshape(-1)).view(slots.size(0), num_tokens, d_model)
    combined = (routed * gates.unsqueeze(-1)).sum(0)
    return combined.to(expert_output.dtype)


def top1gating(*args, **kwargs):
    raise NotImplementedError("top1gating: not reached with k=2")


def topkgating(*args, **kwargs):
    raise NotImplementedError("topkgating: not reached with k=2")


def top2gating(logits: Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group=None, top2_2nd_expert_sampling: bool = True, sparse_routes: bool = False):
    """Implements Top2Gating on logits."""
    gates = F.softmax(logits, dim=1)

    indices1_s = torch.argmax(gates, dim=1)
    num_experts = int(gates.shape[1])
    mask1 = F.one_hot(indices1_s, num_classes=num_experts)

    if top2_2nd_expert_sampling:
        # the second expert by the Gumbel-max trick
        logits += gumbel_rsample(logits.shape, device=logits.device)

    logits_except1 = logits.masked_fill(mask1.bool(), float("-inf"))
    indices2_s = torch.argmax(logits_except1, dim=1)
    mask2 = F.one_hot(indices2_s, num_classes=num_experts)

    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1
    locations2 += torch.sum(mask1, dim=0, keepdim=True)

    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask1.float(), dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts

    exp_counts = torch.sum(mask1 + mask2, dim=0).detach().to(logits.device)

    if drop_tokens:
        capacity = _capacity(gates, torch.tensor(capacity_factor * 2), torch.tensor(min_capacity))
        mask1 *= torch.lt(locations1, capacity)
        mask2 *= torch.lt(locations2, capacity)
    else:
        raise NotImplementedError("no-drop capacity (drop_tokens is True)")

    locations1_s = torch.sum(locations1 * mask1, dim=1)
    locations2_s = torch.sum(locations2 * mask2, dim=1)

    mask1_float = mask1.float()
    mask2_float = mask2.float()
    gates1_s = einsum("se,se->s", gates, mask1_float)
    gates2_s = einsum("se,se->s", gates, mask2_float)
    denom_s = gates1_s + gates2_s
    denom_s = torch.clamp(denom_s, min=torch.finfo(denom_s.dtype).eps)
    gates1_s /= denom_s
    gates2_s /= denom_s

    if sparse_routes:
        indices1_s = torch.where(mask1.any(dim=1), indices1_s, torch.full_like(indices1_s, -1))
        indices2_s = torch.where(mask2.any(dim=1), indices2_s, torch.full_like(indices2_s, -1))
        return (l_aux, capacity, num_experts, torch.stack([indices1_s, indices2_s]).to(torch.int32),
                torch.stack([locations1_s, locations2_s]).to(torch.int32),
                torch.stack([gates1_s, gates2_s]), exp_counts)

    gates1 = einsum("s,se->se", gates1_s, mask1_float)
    gates2 = einsum("s,se->se", gates2_s, mask2_float)
    locations1_sc = _one_hot_to_float(locations1_s, capacity)
    locations2_sc = _one_hot_to_float(locations2_s, capacity)
    combine_weights = einsum("se,sc->sec", gates1, locations1_sc) + einsum("se,sc->sec", gates2, locations2_sc)
    dispatch_mask = combine_weights.bool()
    return l_aux, combine_weights, dispatch_mask, exp_counts


class TopKGate(Module):
    def __init__(self, model_dim, num_experts, k=1, capacity_factor=1.0, eval_capacity_factor=1.0,
                 min_capacity=8, noisy_gate_policy=None, drop_tokens=True, use_rts=True, ep_group=None,
                 top2_2nd_expert_sampling=True):
        super().__init__()
        self.wg = torch.nn.Linear(model_dim, num_experts, bias=False)
        self.ep_group = ep_group
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.timers = SynchronizedWallClockTimer()
        self.wall_clock_breakdown = False
        self.gate_time = 0.0
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling

    def forward(self, input, used_token=None, sparse_routes=False, use_tutel=False):
        if self.wall_clock_breakdown:
            self.timers(TOPK_GATE_TIMER).start()

        input_fp32 = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            raise NotImplementedError("multiplicative jitter (training only)")
        logits = torch.nn.functional.linear(input_fp32, weight=self.wg.weight.float(), bias=None)

        if self.k == 1:
            gate_output = top1gating(logits, self.capacity_factor if self.training else self.eval_capacity_factor,
                                     self.min_capacity, used_token,
                                     self.noisy_gate_policy if self.training else None, self.drop_tokens,
                                     self.use_rts, self.ep_group, sparse_routes, use_tutel)
        elif self.k == 2:
            gate_output = top2gating(logits, self.capacity_factor if self.training else self.eval_capacity_factor,
                                     self.min_capacity, self.drop_tokens, self.ep_group,
                                     self.top2_2nd_expert_sampling, sparse_routes)
        else:
            gate_output = topkgating(logits, self.k,
                                     self.capacity_factor if self.training else self.eval_capacity_factor,
                                     self.min_capacity, self.drop_tokens, self.ep_group,
                                     sparse_routes=sparse_routes)

        if self.wall_clock_breakdown:
            self.timers(TOPK_GATE_TIMER).stop()
            self.gate_time = self.timers(TOPK_GATE_TIMER).elapsed(reset=False)

        return gate_output


class MOELayer(Module):
    def __init__(self, gate, experts, ep_group_name, ep_size, num_local_experts, use_tutel=False):
        super().__init__()
        self.gate = gate
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
        self.use_tutel = use_tutel and TUTEL_INSTALLED

    def forward(self, *input: Tensor, **kwargs: Any) -> Tensor:
        if self.wall_clock_breakdown:
            self.timers(MOE_TIMER).start()

        d_model = input[0].shape[-1]
        reshaped_input = input[0].reshape(-1, d_model)

        self.l_aux, C, E, indices_, locations_, gates_, self.exp_counts = self.gate(
            reshaped_input, input[1], True, self.use_tutel)
        S, M = reshaped_input.size(0), reshaped_input.size(1)
        C = int(C)  # the capacity, read on the host once

        if self.use_tutel:
            raise NotImplementedError("tutel fast_dispatcher (not installed)")
        else:
            slots = _route_slots(indices_, locations_, E, C)
            dispatched_input = _sparse_encode(reshaped_input, slots, E, C)

        if self.wall_clock_breakdown:
            self.timers(FIRST_ALLTOALL_TIMER).start()

        tensor_model_world_size = bwc_tensor_model_parallel_world_size(groups.mpu)
        if tensor_model_world_size > 1:
            dispatched_input = drop_tokens(dispatched_input, dim=1)

        if self.ep_size > 1:
            dispatched_input = _AllToAll.apply(self.ep_group, dispatched_input)
        else:
            dispatched_input = dispatched_input.contiguous()

        if self.wall_clock_breakdown:
            self.timers(FIRST_ALLTOALL_TIMER).stop()
            self.time_falltoall = self.timers(FIRST_ALLTOALL_TIMER).elapsed(reset=False)

        if tensor_model_world_size > 1 and groups._get_expert_model_parallel_world_size() > 1:
            dispatched_input = gather_tokens(dispatched_input, dim=1)

        # ecm -> gecm
        dispatched_input = dispatched_input.reshape(self.ep_size, self.num_local_experts, -1, d_model)
        expert_output = self.experts(dispatched_input)
        # gecm -> ecm
        expert_output = expert_output.reshape(self.ep_size * self.num_local_experts, -1, d_model)
        if tensor_model_world_size > 1 and groups._get_expert_model_parallel_world_size() > 1:
            expert_output = drop_tokens(expert_output, dim=1)

        if self.wall_clock_breakdown:
            self.timers(SECOND_ALLTOALL_TIMER).start()

        if self.ep_size > 1:
            expert_output = _AllToAll.apply(self.ep_group, expert_output)
        else:
            expert_output = expert_output.contiguous()

        if self.wall_clock_breakdown:
            self.timers(SECOND_ALLTOALL_TIMER).stop()
            self.time_salltoall = self.timers(SECOND_ALLTOALL_TIMER).elapsed(reset=False)

        if tensor_model_world_size > 1:
            expert_output = gather_tokens(expert_output, dim=1)

        if self.use_tutel:
            raise NotImplementedError("tutel fast_dispatcher decode (not installed)")
        else:
            combined_output = _sparse_decode(expert_output.view(E * C, M), slots, gates_, S)

        a = combined_output.reshape(input[0].shape)

        if self.wall_clock_breakdown:
            self.timers(MOE_TIMER).stop()
            self.time_moe = self.timers(MOE_TIMER).elapsed(reset=False)

        return a


class Experts(nn.Module):
    def __init__(self, expert, num_local_experts=1, expert_group_name=None):
        super().__init__()
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts

    def forward(self, inputs):
        chunks = inputs.chunk(self.num_local_experts, dim=1)
        expert_outputs: list[torch.Tensor] = []

        for chunk, expert in zip(chunks, self.deepspeed_experts):  # noqa: B905 - as the original
            out = expert(chunk)
            if isinstance(out, tuple):
                out = out[0]  # the bias term is ignored
            expert_outputs += [out]

        return torch.cat(expert_outputs, dim=1)


class MoE(nn.Module):
    def __init__(self, hidden_size, expert, num_experts=1, ep_size=1, k=1, capacity_factor=1.0,
                 eval_capacity_factor=1.0, min_capacity=4, use_residual=False, noisy_gate_policy=None,
                 drop_tokens=True, use_rts=True, use_tutel=False, enable_expert_tensor_parallelism=False,
                 top2_2nd_expert_sampling=True):
        super().__init__()
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        assert num_experts % ep_size == 0, \
            f"Number of experts ({num_experts}) should be divisible by expert parallel size ({ep_size})"
        self.ep_size = ep_size
        self.expert_group_name = f"ep_size_{self.ep_size}"
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size

        assert noisy_gate_policy is None or noisy_gate_policy in ["None", "Jitter", "RSample"], \
            "Unsupported noisy_gate_policy: " + noisy_gate_policy

        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        self.deepspeed_moe = MOELayer(TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor,
                                               min_capacity, noisy_gate_policy, drop_tokens, use_rts, None,
                                               top2_2nd_expert_sampling),
                                      experts, self.expert_group_name, self.ep_size, self.num_local_experts,
                                      use_tutel=use_tutel)
        if self.use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def forward(self, hidden_states, used_token=None):
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            output_mlp = self.mlp(hidden_states)
            if isinstance(output_mlp, tuple):
                output_mlp = output_mlp[0]
            coef = self.coefficient(hidden_states)
            coef = F.softmax(coef, dim=-1)
            output = output * coef[..., 0:1] + output_mlp * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts


def make_layer():
    expert = nn.Sequential(nn.Linear(HIDDEN, INTER), nn.GELU(), nn.Linear(INTER, HIDDEN))
    return MoE(hidden_size=HIDDEN, expert=expert, num_experts=EXPERTS, k=TOP_K)


def build():
    return tiny(make_layer, HIDDEN)
