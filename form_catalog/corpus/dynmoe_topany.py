"""DynMoE's top-any gating in its DeepSpeed fork: per-expert sigmoid thresholds, capacity = the busiest expert's count.

Mirrors LINs-lab/DynMoE `DeepSpeed-0.9.5/deepspeed/moe/sharded_moe.py` at commit 4927232 (HEAD, "fix forward in
experts.py") (`einsum`, `_one_hot_to_float`, `topanygating_opt`, `GAMoEGateBackward`, `GAMoEGateT`,
`TopKGate.__init__` / `forward` and its record-routing helpers, `_AllToAll`, `MOELayer.__init__` / `forward` and
`remove_experts` / `add_experts` / `adaptive_update_experts`, `get_world_size`, `simple_all_reduce`), with
`diverse_and_simple_gate_loss` from `deepspeed/moe/loss.py`, `Experts` from `deepspeed/moe/experts.py`, `MoE`
from `deepspeed/moe/layer.py`, `drop_tokens` / `gather_tokens` from `deepspeed/moe/mappings.py` and the
`FeedForward` expert and `MoE(...)` call of `Examples/DeepSpeed-MoE/dynmoe_vit.py`, all at the same commit.
The example wraps the ViT's `FeedForward` (LayerNorm, Linear, GELU, Dropout, Linear, Dropout) as
`MoE(dim, expert=ff, num_experts=2, ep_size=1, k=-1, capacity_factor=1.5, eval_capacity_factor=2.0,
min_capacity=0.0, use_residual=False, max_expert_num=4)`: `max_expert_num > 0`, so `Experts` deep-copies the
expert 4 times, and `k == -1` makes `TopKGate` build a `GAMoEGateT` (fp32) with a [dim, 4] `sim_matrix`
(orthogonal init), per-expert `gates` thresholds, an `experts_mask` Parameter (no grad) with the first
`num_experts` = 2 entries set to 1 in place, and a frozen log-temperature.
`MoE.forward` (top-any sets `self.switch`) first runs a Python schedule on `forward_count` (`% 300`, `// 300 % 3`,
with `print`s) that can start routing records or, at its end, call `adaptive_update_experts`, and counts
forwards only in training; then `MOELayer.forward(hidden_states, used_token)` flattens the tokens [S, M] and
calls the gate. `TopKGate.forward` casts the input to float32 and gets `(logits, top_K)` from `GAMoEGateT`:
`sigmoid(normalize(x) @ normalize(sim_matrix) * exp(clamped temperature))` times `experts_mask`, thresholds
`sigmoid(gates * scale)`, `relu(logits - thresholds)` passed through the straight-through `sign` Function, so
each token takes *every* expert above its threshold (0..E of them); in eval a token with none falls back to
the argmax expert (a mask built by `repeat`/`reshape`/`.T`, `one_hot`), and K = max(count, 1) via
`torch.max` with a `torch.ones(...).to(device)`. If `record_routing` is on, it accumulates per-expert counts
and the sum of unrouted tokens (boolean-mask gather, `len(...) > 0`). `topanygating_opt` takes the 0/1 mask
as `gates.int()`, the per-expert counts `.detach().to('cpu')`, the capacity as their `torch.max` moved back to
the device (the all-reduce MAX over ranks is a no-op with one), an aux loss (the sim-matrix diversity loss +
a load-balance term over the tokens routed anywhere, behind a host-read `if non_zero_mask.sum() != 0` and
boolean-mask gathers, + mean gate), slot positions by `cumsum` and `% (capacity + 1)`, divides the gates in
place by `clamp(K, min=1)`, and one-hots the slots with a `@torch.jit.script` helper whose `num_classes` is the
tensor `capacity + 1` (the last class, the dropped slot, is sliced off): combine weights [S, E, C] with a
data-dependent C, and `dispatch_mask = combine_weights.bool()`. The layer dispatches with
`einsum("sec,sm->ecm")`, passes `drop_tokens` (identity: no mpu), the all-to-all (`_AllToAll.apply`, a copy with
one rank), reshapes to [ep_size, E_local, C, M]; `Experts.forward` `chunk`s dim 1 and loops
`for chunk, expert in zip(...)` (dropping a tuple's second item), `cat`s; then the second all-to-all,
`gather_tokens` (identity), `einsum("sec,ecm->sm")` and a reshape to the input shape. `MoE.forward` returns
(output, l_aux, exp_counts).
Left out: the collectives, which with a single rank (`ep_size=1`, DeepSpeed launched on one GPU) do nothing but
copy: `dist.all_to_all_single` in `_AllToAll` is written as `empty_like` + `copy_`, and the
`dist.all_reduce(new_capacity, MAX)` in `topanygating_opt` is dropped (identity); `simple_all_reduce` keeps its
world-size-1 early return and raises otherwise; tensor-parallel `drop_tokens` / `gather_tokens` raise if an
mpu were set (none is); `set_deepspeed_parallelism` / `_set_ep_group` (process-group setup, so `ep_group`
stays None). `multiplicative_jitter` (the Jitter policy, training only) raises. `top1gating`, `top2gating`
and the older loop-based `topanygating` (not reached with k = -1) are stubs that raise; so is Tutel
(`use_tutel` False) and the `SynchronizedWallClockTimer` (`wall_clock_breakdown` False); `log_dist` in
`MoE.__init__` and the parameter tagging in `Experts.__init__` (logging and optimizer metadata) are dropped;
`add_experts` reads `np.argwhere(mask.cpu().numpy() == 0)`, written here as the ndarray's `.nonzero()[0]`
(same first index, no numpy import). The ViT's attention and
the surrounding blocks are outside the layer; the example's `Transformer.forward` adds the MoE output to x
without a norm of its own (the expert starts with its LayerNorm); the shell adds one more LayerNorm.
`build()` restores the two non-trainable Parameters the shell re-draws (`experts_mask` to its construction
value [1, 1, 0, 0], `temperature` to log(1 / init_t) = 0), so only experts 0 and 1 are live, as when built;
it draws with seed 3, whose thresholds give tokens with 0 (argmax fallback), 1 and 2 experts.
dynmoevit_b_16: dim 768, mlp_dim 3072, MoE in layers 0/3/6/9, 2 initial experts of at most 4 (tiny here: dim 16,
mlp_dim 32, the same 2 of 4).
Constructs: a Python `forward_count` schedule with `print`s and flags, top-any routing (a variable number of
experts per token, from sigmoid thresholds), a custom straight-through `autograd.Function` (`sign`), an
eval-only argmax fallback, a `.to('cpu')` host copy of the counts and a capacity read back from it, a
data-dependent capacity used as a `one_hot` class count inside a `@torch.jit.script` function, a
`Tensor.__ne__` host read in an `if`, boolean-mask gathers in the aux loss, in-place `/=` on the gate output,
GShard `einsum` dispatch/combine through a helper with a module-level switch, an identity-with-one-rank
`autograd.Function` all-to-all, `chunk` + `zip` loop over deep-copied experts with a `type(out) is tuple`
check, a module returning (output, l_aux, counts).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn import Module

from ._shell import Source, tiny

SOURCE = Source("LINs-lab/DynMoE", "DeepSpeed-0.9.5/deepspeed/moe/sharded_moe.py",
                "49272326e794b24bbebe3a9c6df3c079b3dd887b", "MOELayer.forward")
HIDDEN, MLP_DIM, NUM_EXPERTS, MAX_EXPERT_NUM = 16, 32, 2, 4

# deepspeed.utils.groups state with no Megatron mpu and no expert tensor parallelism
_MPU = None
_EXPERT_TENSOR_PARALLEL_WORLD_SIZE = 1


def _get_expert_model_parallel_world_size():
    return _EXPERT_TENSOR_PARALLEL_WORLD_SIZE


def get_world_size(group=None):
    try:
        return torch.distributed.get_world_size(group)
    except Exception:
        return 1


def simple_all_reduce(input, group=None, op=None):
    world_size = get_world_size(group)
    if world_size == 1:
        return input
    raise NotImplementedError("multi-rank all-reduce left out (one rank here)")


def drop_tokens(input_, dim=0):
    if _MPU is None:
        return input_
    raise NotImplementedError("tensor-parallel token drop left out (no mpu)")


def gather_tokens(input_, dim=0):
    if _MPU is None:
        return input_
    raise NotImplementedError("tensor-parallel token gather left out (no mpu)")


def diverse_and_simple_gate_loss(gates, expert_mask):
    sims = torch.matmul(F.normalize(gates, dim=0).T, F.normalize(gates, dim=0))
    targets = torch.eye(sims.shape[0]).to(sims.device)
    sim_mask = torch.matmul(expert_mask.unsqueeze(0).T, expert_mask.unsqueeze(0))
    sim_loss = torch.norm(sims * sim_mask - targets * sim_mask)
    simple_loss = torch.mean(torch.norm(gates, dim=0))
    return sim_loss + simple_loss


class SynchronizedWallClockTimer:
    """Stand-in for deepspeed's timer; only used behind `wall_clock_breakdown`, which is False."""

    def __call__(self, name):
        raise NotImplementedError("wall-clock timers left out")


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, group, input: Tensor) -> Tensor:
        ctx.group = group
        input = input.contiguous()
        output = torch.empty_like(input)
        output.copy_(input)  # dist.all_to_all_single(output, input, group=group) with a single rank
        return output

    @staticmethod
    def backward(ctx: Any, *grad_output: Tensor):
        return (None, _AllToAll.apply(ctx.group, *grad_output))


USE_EINSUM = True


def einsum(rule, a, b):
    if USE_EINSUM:
        return torch.einsum(rule, a, b)
    elif rule == "s,se->se":
        return a.reshape(a.shape[0], -1) * b
    elif rule == "se,sc->sec":
        return a.unsqueeze(2) * b.unsqueeze(1)
    elif rule == "se,se->s":
        return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).reshape(-1)
    elif rule == "sec,sm->ecm":
        s, e, c, m = a.shape[0], a.shape[1], a.shape[2], b.shape[1]
        return torch.matmul(a.reshape(s, -1).t(), b).reshape(e, c, m)
    elif rule == "sec,ecm->sm":
        return torch.matmul(a.reshape(a.shape[0], -1), b.reshape(-1, b.shape[-1]))
    else:
        return torch.einsum(rule, a, b)


@torch.jit.script
def _one_hot_to_float(x, num_classes):
    return F.one_hot(x, num_classes=num_classes).float()


def top1gating(*args, **kwargs):
    raise NotImplementedError("top-1 gating not reached with k = -1")


def top2gating(*args, **kwargs):
    raise NotImplementedError("top-2 gating not reached with k = -1")


def topanygating_opt(logits: Tensor, capacity_factor: float, min_capacity: int, K: Tensor, gate_tensor=None,
                     expert_mask=None, ep_group=None):
    gates = logits
    mask = gates.int()
    exp_counts = torch.sum(mask, dim=0).detach().to("cpu")

    new_capacity = torch.max(exp_counts).to(logits.device)
    # dist.all_reduce(new_capacity, op=MAX, group=world): a no-op with one rank
    capacity = new_capacity

    num_experts = int(gates.shape[1])

    if gate_tensor is None or expert_mask is None:
        me = torch.mean(gates, dim=0)
        ce = torch.mean(mask.float(), dim=0)
        l_aux = torch.mean(me * ce) * num_experts * num_experts
    else:
        non_zero_mask = torch.sum(gates, dim=1) > 0
        if non_zero_mask.sum() != 0:
            normalized_gates = gates[non_zero_mask]
            normalized_gates = normalized_gates / (torch.sum(normalized_gates, dim=1, keepdim=True))
            me = torch.mean(normalized_gates, dim=0)
            ce = torch.mean(mask[non_zero_mask].float(), dim=0)
            load_balance_loss = torch.mean(me * ce) * num_experts * num_experts
        else:
            load_balance_loss = 0
        efficiency_loss = torch.mean(gates)
        l_aux = diverse_and_simple_gate_loss(gate_tensor, expert_mask) + load_balance_loss + efficiency_loss

    locations1 = torch.cumsum(mask, dim=0)
    locations1_s = ((locations1 * mask) - 1) % (capacity + 1)

    gates /= torch.clamp(K, min=1).unsqueeze(1)

    locations1_sc = _one_hot_to_float(locations1_s, capacity + 1)
    combine_weights = einsum("se,sec->sec", gates, locations1_sc[:, :, :-1])

    dispatch_mask = combine_weights.bool()
    return l_aux, combine_weights, dispatch_mask, exp_counts


class GAMoEGateBackward(torch.autograd.Function):
    """sign() forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, scores: Tensor):
        return torch.sign(scores)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor):
        return grad_output


class GAMoEGateT(nn.Module):
    def __init__(self, model_dim, num_global_experts, fp32_gate=False, max_expert_num=64, adaptive_experts=False,
                 init_t=1.0):
        super().__init__()
        self.expert_num = num_global_experts
        self.register_parameter("sim_matrix", nn.Parameter(
            nn.init.orthogonal_(torch.empty(max_expert_num, model_dim, dtype=torch.float32)).T.contiguous(),
            requires_grad=True))
        self.register_parameter("gates", nn.Parameter(torch.zeros(size=(max_expert_num,)), requires_grad=True))
        self.register_parameter("experts_mask", nn.Parameter(torch.zeros(size=(max_expert_num,)),
                                                             requires_grad=False))
        self.register_parameter("temperature", nn.Parameter(
            torch.log(torch.full([1], 1.0 / init_t, dtype=torch.float32)), requires_grad=False))
        self.clamp_max = torch.log(torch.tensor(1.0 / 0.01, dtype=torch.float32)).item()

        self.experts_mask.requires_grad_(False)
        self.experts_mask[:num_global_experts] = 1.0

        self.fp32_gate = fp32_gate
        self.max_expert_num = max_expert_num
        self.adaptive_experts = adaptive_experts

    def forward(self, x):
        if self.fp32_gate:
            x = x.float()
            sim_matrix = self.sim_matrix.float()
            gates = self.gates.float()
        else:
            sim_matrix = self.sim_matrix
            gates = self.gates

        logit_scale = torch.clamp(self.temperature, max=self.clamp_max).exp()
        logits = torch.sigmoid(torch.matmul(F.normalize(x, dim=1), F.normalize(sim_matrix, dim=0)) * logit_scale)
        logits = logits * self.experts_mask
        gates = torch.sigmoid(self.gates * logit_scale)

        if self.training:
            logits = F.relu(logits - gates)
            logits = GAMoEGateBackward.apply(logits)
            top_k = torch.sum(logits > 0, dim=1).to(torch.int)
        else:
            new_logits = F.relu(logits - gates)
            new_logits = GAMoEGateBackward.apply(new_logits)
            top_k = torch.sum(new_logits > 0, dim=1).to(torch.int)

            # tokens above no threshold fall back to their best-scoring expert
            mask = (torch.sum(new_logits, dim=1) == 0).to(torch.int).repeat(logits.shape[1]).reshape(
                logits.shape[1], -1).T
            max_index = torch.argmax(logits, dim=1)
            one_hot = F.one_hot(max_index, num_classes=logits.shape[1])
            logits = mask * one_hot + new_logits

            top_k = torch.max(top_k, torch.ones(top_k.shape).to(top_k.device)).to(torch.int)

        return logits, top_k


class TopKGate(Module):
    wg: nn.Module

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8, noisy_gate_policy: str | None = None,
                 drop_tokens: bool = True, use_rts: bool = True, max_expert_num: int = 4, ep_group=None) -> None:
        super().__init__()
        if k != 1 and k != 2 and k != -1:
            raise ValueError("Only top-1, top-2, and top-Any gatings are supported.")

        self.k = k
        if k == 1 or k == 2:
            self.wg = nn.Linear(model_dim, num_experts, bias=False).float()
        else:
            assert max_expert_num >= num_experts, (
                f"Number of experts ({num_experts}) should be less than max number of experts ({max_expert_num})")
            self.wg = GAMoEGateT(model_dim, num_experts, max_expert_num=max_expert_num, fp32_gate=True,
                                 adaptive_experts=True, init_t=1.0)
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.timers = SynchronizedWallClockTimer()
        self.wall_clock_breakdown = False
        self.gate_time = 0.0
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts

        self.max_expert_num = max_expert_num
        self.record_routing = False
        self.ep_group = ep_group
        self.total_tokens = None

    def begin_record_routing(self):
        self.reset_record_routing()
        self.record_routing = True

    def end_record_routing(self):
        self.record_routing = False

    def reset_record_routing(self):
        if not isinstance(self.wg, GAMoEGateT):
            raise ValueError("Only support GAMoE for record routing!")
        self.routing_records = None
        self.sample_records = None

    def forward(self, input: Tensor, used_token: Tensor | None = None, use_tutel: bool = False):
        if self.wall_clock_breakdown:
            self.timers("TopKGate").start()

        if isinstance(self.wg, nn.Linear) and self.wg.weight.dtype != torch.float32:
            self.wg = self.wg.float()
        input_fp32 = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            raise NotImplementedError("multiplicative jitter (training only) left out")

        if isinstance(self.wg, nn.Linear):
            logits = self.wg(input_fp32)
            top_K = self.k
        else:
            logits, top_K = self.wg(input_fp32)

        if self.record_routing:
            assert isinstance(self.wg, GAMoEGateT)
            current_routing_records = torch.sum(torch.sign(logits), dim=0)
            if self.routing_records is None:
                self.routing_records = current_routing_records
            else:
                self.routing_records += current_routing_records

            if self.total_tokens is None:
                self.total_tokens = logits.shape[0]
            else:
                self.total_tokens += logits.shape[0]

            sample_routing = torch.sum(torch.sign(logits), dim=1)
            samples_not_routing = input_fp32[sample_routing == 0]
            if len(samples_not_routing) > 0:
                current_sample_records = torch.sum(samples_not_routing, dim=0)
                if self.sample_records is None:
                    self.sample_records = current_sample_records
                else:
                    self.sample_records += current_sample_records
            elif self.sample_records is None:
                self.sample_records = torch.zeros(input_fp32[0].shape).to(input_fp32[0].device)

        if self.k == 1:
            gate_output = top1gating(logits, self.capacity_factor if self.training else self.eval_capacity_factor,
                                     self.min_capacity, used_token, self.noisy_gate_policy if self.training else None,
                                     self.drop_tokens, self.use_rts, use_tutel)
        elif self.k == 2:
            gate_output = top2gating(logits, self.capacity_factor if self.training else self.eval_capacity_factor,
                                     self.min_capacity)
        elif isinstance(self.wg, GAMoEGateT):
            gate_output = topanygating_opt(logits, self.capacity_factor if self.training else self.eval_capacity_factor,
                                           self.min_capacity, top_K, self.wg.sim_matrix, self.wg.experts_mask,
                                           self.ep_group)
        else:
            raise ValueError("invaild k")

        if self.wall_clock_breakdown:
            self.timers("TopKGate").stop()
            self.gate_time = self.timers("TopKGate").elapsed(reset=False)

        return gate_output


class Experts(nn.Module):
    def __init__(self, expert, num_local_experts=1, expert_group_name=None):
        super().__init__()
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for i in range(num_local_experts)])
        self.num_local_experts = num_local_experts

    def forward(self, inputs):
        chunks = inputs.chunk(self.num_local_experts, dim=1)
        expert_outputs = []
        for chunk, expert in zip(chunks, self.deepspeed_experts, strict=False):
            out = expert(chunk)
            if type(out) is tuple:
                out = out[0]
            expert_outputs += [out]
        expert_output = torch.cat(expert_outputs, dim=1)
        return expert_output


class MOELayer(Module):
    def __init__(self, gate: Module, experts: Module, ep_group_name, ep_size, num_local_experts: int,
                 use_tutel: bool = False) -> None:
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
        self.use_tutel = False  # use_tutel and TUTEL_INSTALLED and gate.k == 1: Tutel is not installed

    def begin_record_routing(self):
        self.gate.begin_record_routing()

    def end_record_routing(self):
        self.gate.end_record_routing()

    def remove_experts(self):
        assert self.gate.record_routing, "must record routing before removing experts"
        assert isinstance(self.gate.wg, GAMoEGateT), "gate network must have experts mask to allow adaptive process"
        if self.gate.routing_records is None:
            return
        routing_records = simple_all_reduce(self.gate.routing_records, self.ep_group)
        signed_routing_records = torch.sign(routing_records)
        updated_experts_mask = self.gate.wg.experts_mask * signed_routing_records
        self.gate.wg.experts_mask.data = updated_experts_mask.to(self.gate.wg.experts_mask.device)
        self.gate.wg.experts_mask.data = updated_experts_mask

    def add_experts(self):
        assert self.gate.record_routing, "must record routing before adding experts"
        assert isinstance(self.gate.wg, GAMoEGateT), "gate network must have experts mask to allow adaptive process"
        self.gate.sample_records = simple_all_reduce(self.gate.sample_records, self.ep_group)
        if sum(self.gate.sample_records) == 0:
            return
        normalized_sample_records = self.gate.sample_records / torch.norm(self.gate.sample_records)
        # upstream: np.argwhere(experts_mask.cpu().numpy() == 0), then [0][0]
        non_active_experts = (self.gate.wg.experts_mask.cpu().numpy() == 0).nonzero()[0]
        if len(non_active_experts) > 0:
            new_expert_index = non_active_experts[0]
            self.gate.wg.experts_mask.data[new_expert_index] = 1.0
            self.gate.wg.sim_matrix.data[:, new_expert_index] = normalized_sample_records.data
            self.gate.wg.gates.data[new_expert_index] = torch.tensor(0.0)

    def adaptive_update_experts(self):
        self.remove_experts()
        self.add_experts()
        self.gate.wg.expert_num = int(sum(self.gate.wg.experts_mask))

    def forward(self, *input: Tensor, **kwargs: Any) -> Tensor:
        if self.wall_clock_breakdown:
            self.timers("moe").start()

        d_model = input[0].shape[-1]
        reshaped_input = input[0].reshape(-1, d_model)

        if self.use_tutel:
            raise NotImplementedError("Tutel fast dispatcher left out")
        else:
            self.l_aux, combine_weights, dispatch_mask, self.exp_counts = self.gate(reshaped_input, input[1])
            dispatched_input = einsum("sec,sm->ecm", dispatch_mask.type_as(input[0]), reshaped_input)

        if self.wall_clock_breakdown:
            self.timers("falltoall").start()

        if _get_expert_model_parallel_world_size() == 1:
            dispatched_input = drop_tokens(dispatched_input, dim=1)

        dispatched_input = _AllToAll.apply(self.ep_group, dispatched_input)

        if self.wall_clock_breakdown:
            self.timers("falltoall").stop()
            self.time_falltoall = self.timers("falltoall").elapsed(reset=False)

        dispatched_input = dispatched_input.reshape(self.ep_size, self.num_local_experts, -1, d_model)

        expert_output = self.experts(dispatched_input)

        if self.wall_clock_breakdown:
            self.timers("salltoall").start()

        expert_output = _AllToAll.apply(self.ep_group, expert_output)

        if self.wall_clock_breakdown:
            self.timers("salltoall").stop()
            self.time_salltoall = self.timers("salltoall").elapsed(reset=False)

        expert_output = expert_output.reshape(self.ep_size * self.num_local_experts, -1, d_model)

        if _get_expert_model_parallel_world_size() == 1:
            expert_output = gather_tokens(expert_output, dim=1)

        combined_output = einsum("sec,ecm->sm", combine_weights.type_as(input[0]), expert_output)

        a = combined_output.reshape(input[0].shape)

        if self.wall_clock_breakdown:
            self.timers("moe").stop()
            self.time_moe = self.timers("moe").elapsed(reset=False)

        return a


class MoE(nn.Module):
    def __init__(self, hidden_size, expert, num_experts=1, ep_size=1, k=1, capacity_factor=1.0,
                 eval_capacity_factor=1.0, min_capacity=4, use_residual=False, noisy_gate_policy: str | None = None,
                 drop_tokens: bool = True, use_rts=True, use_tutel: bool = False,
                 enable_expert_tensor_parallelism: bool = False, max_expert_num: int = 4):
        super().__init__()
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        assert num_experts % ep_size == 0 or (max_expert_num > 0 and max_expert_num % ep_size == 0), (
            f"Number of experts ({num_experts}) should be divisible by expert parallel size ({ep_size})")
        self.ep_size = ep_size
        self.expert_group_name = f"ep_size_{self.ep_size}"
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size

        if max_expert_num > 0:
            self.num_local_experts = max_expert_num // self.ep_size
            self.num_experts = max_expert_num
        else:
            self.num_local_experts = num_experts // self.ep_size

        assert noisy_gate_policy is None or noisy_gate_policy in ["None", "Jitter", "RSample"], (
            "Unsupported noisy_gate_policy: " + noisy_gate_policy)

        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        self.deepspeed_moe = MOELayer(TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor,
                                               min_capacity, noisy_gate_policy, drop_tokens, use_rts, max_expert_num),
                                      experts, self.expert_group_name, self.ep_size, self.num_local_experts,
                                      use_tutel=use_tutel)
        if self.use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

        self.forward_count = 0
        self.test_time_record = False
        self.switch = True if k == -1 else False

    def begin_record_routing(self):
        self.deepspeed_moe.begin_record_routing()

    def end_record_routing(self):
        self.deepspeed_moe.end_record_routing()

    def adaptive_update_experts(self):
        self.deepspeed_moe.adaptive_update_experts()

    def forward(self, hidden_states, used_token=None, if_begin_record_routing: bool = False,
                if_end_record_routing: bool = False):
        if self.switch:
            if self.forward_count % 300 == 0 and (self.forward_count // 300) % 3 == 1:
                if_begin_record_routing = True
                if_end_record_routing = False
                print(f"Start record routing at {self.forward_count}")
            elif self.forward_count % 300 == 0 and (self.forward_count // 300) % 3 == 2:
                if_begin_record_routing = False
                if_end_record_routing = True
                print(f"Update at {self.forward_count}")
            else:
                if_begin_record_routing = False
                if_end_record_routing = False

            if self.test_time_record and self.switch and not self.training:
                self.begin_record_routing()
                self.test_time_record = False

            if if_begin_record_routing:
                self.begin_record_routing()

        output = self.deepspeed_moe(hidden_states, used_token)

        if self.use_residual:
            output_mlp = self.mlp(hidden_states)
            if type(output_mlp) is tuple:
                output_mlp = output_mlp[0]
            coef = self.coefficient(hidden_states)
            coef = F.softmax(coef, dim=-1)
            output = output * coef[..., 0:1] + output_mlp * coef[..., 1:]

        if self.switch:
            if if_end_record_routing:
                self.adaptive_update_experts()
                self.end_record_routing()

            if self.training:
                self.forward_count += 1

        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts


class FeedForward(nn.Module):
    """The ViT feed-forward of `dynmoe_vit.py`, used as the expert."""

    def __init__(self, dim, hidden_dim, dropout=0.0):
        super().__init__()
        self.net = nn.Sequential(
            nn.LayerNorm(dim),
            nn.Linear(dim, hidden_dim),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(hidden_dim, dim),
            nn.Dropout(dropout),
        )

    def forward(self, x):
        return self.net(x)


def dynmoe_vit_ffn(dim=HIDDEN, mlp_dim=MLP_DIM, dropout=0.0):
    """The MoE replacement of `Transformer.__init__` in `dynmoe_vit.py` for one MoE layer."""
    return MoE(dim, expert=FeedForward(dim, mlp_dim, dropout=dropout), num_experts=NUM_EXPERTS, ep_size=1, k=-1,
               capacity_factor=1.5, eval_capacity_factor=2.0, min_capacity=0.0, use_residual=False,
               max_expert_num=MAX_EXPERT_NUM)


def build():
    # seed 3: the tiny draw gives tokens above no threshold (argmax fallback), above one, and above both
    model, inputs = tiny(dynmoe_vit_ffn, HIDDEN, seed=3)
    with torch.no_grad():  # the shell re-draws every Parameter; put back the two that are state, not weights
        for moe in model.moes:
            wg = moe.deepspeed_moe.gate.wg
            wg.experts_mask.zero_()
            wg.experts_mask[:NUM_EXPERTS] = 1.0
            wg.temperature.fill_(0.0)  # log(1 / init_t), init_t = 1.0
    return model, inputs
