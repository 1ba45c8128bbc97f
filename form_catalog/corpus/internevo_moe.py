"""InternEvo's `GShardMOELayer` behind its `MoE` wrapper: DeepSpeed-style capacity top-2 gate, einsum dispatch.

Mirrors InternLM/InternEvo `internlm/model/moe/gshard_layer.py` at commit c628a8c (`multiplicative_jitter`,
`gumbel_rsample`, `einsum`, `_capacity`, `_top_idx`, `top1gating`, `top2gating`, `TopKGate`,
`GShardMOELayer`), with `internlm/model/moe/moe.py` (`MoE`), `base_layer.py` (`BaseMoELayer`), `experts.py`
(`Experts`), and the expert MLP from `internlm/model/modules/mlp.py` (`BaseFeedForward`, `FeedForward`),
`internlm/model/ops/linear.py` (`ColumnParallelLinearTorch`, `RowParallelLinearTorch`) and
`internlm/model/utils.py` (`fused_dense_func`, `FusedDenseFunc`, `AllReduceFunc`, `linear_bias_wgrad_torch`,
`Silu`). That commit is the head of `develop` in the newest snapshot read (2024-03-28); the default MoE
config (`configs/7B_MoE4_sft.py`) sets `moe_type="GShard"`, 4 experts, `top_k=2`, capacity factors 1.0,
`min_capacity=4`, `drop_tokens=True`, `use_rts=True`, no noisy-gate policy and `moe_use_residual=False`;
the other registered layers (`MegaBlockMoE`, `MegaBlockdMoE`) need the megablocks/stk kernels.
`MoE.forward` calls the registered layer (looked up by name in a registry from the config) with
`used_token=None`. `GShardMOELayer.forward` takes `*inputs`, flattens `inputs[0]` to tokens [S, M] and calls
`TopKGate`, which (after an optional jitter of the input in training) scores a bias-free linear and, for
k == 2, runs `top2gating`: softmax; a `@torch.jit.script` `_capacity` computing ceil(S / E * 2 * factor) as
a tensor and raising it to `min_capacity` under a tensor `if`; `argmax` as first expert; the second is the
`argmax` of the logits plus Gumbel noise (drawn through a per-device cache of a `Gumbel(0, 1).rsample`
bound method, in eval too) after the first is `masked_fill`ed with the dtype's min; queue slots are
`cumsum - 1` (the second choices offset by the first's per-expert counts); the per-expert counts go to the
host (`.detach().to("cpu")`); the aux loss is mean(me * ce) * E * E; both masks are multiplied in place by
`torch.lt(slot, capacity)`; the kept gates are picked with einsum "se,se->s", renormalised by their sum
clamped at eps (in-place `/=`), spread back with "s,se->se", and multiplied with `one_hot(slot,
num_classes=capacity)` (a 0-dim tensor as class count) via "se,sc->sec" into combine weights [S, E, C];
the dispatch mask is their bool cast. The layer stores the loss and counts as module attributes,
dispatches with `einsum("sec,sm->ecm")`, reshapes to [ep_size, E_local, C, M], and `Experts` `chunk`s
along dim 1 and loops `for chunk, expert in zip(chunks, experts)` (dropping a tuple's second item), then
`cat`s; the result is reshaped to [E, C, M] and combined with `einsum("sec,ecm->sm")`. `MoE.forward`
returns (output, l_aux, exp_counts). Each expert is a SwiGLU MLP w2(Silu(w1 x, w3 x)) with a scripted
`Silu`, its width rounded up to `multiple_of`; each linear is `FusedDenseFunc.apply` (an autograd
Function under `custom_fwd`/`custom_bwd` with autocast checks, `contiguous`, a size check and `F.linear`),
and the row linear's output goes through `AllReduceFunc.apply`. `top1gating` (k == 1: optional
RSample noise, `used_token` masking, random token selection with a cached `Uniform.rsample`, scripted
`_top_idx` topk over tokens, `scatter_`) and the residual-MoE branch are kept though the config does not
take them. `USE_EINSUM` is True, so `torch.einsum` runs; its fallback rule table is kept.
Left out: the expert-parallel all-to-alls (`gpc.get_world_size(EXPERT) > 1`; identity in one process) and
the all-reduce of the capacity in `top1gating`'s no-drop branch (a MAX over one rank); the tensor-parallel
pieces at one rank: the sequence-parallel all-gather in `FusedDenseFunc` and the reduce-scatter in the row
linear (`sequence_parallel` is False in "mtp" mode), the `AllReduceFunc` collective (its forward keeps
`contiguous()`), the rank/world-size split of linear widths, and the `fused_dense_lib` CUDA weight-gradient
branch in backward; the megatron timers behind `wall_clock_breakdown` (False); the global context `gpc`
(a tiny local `Config` carries the fields read), the expert-group name registry, `set_fp32_attr_to_module`
on the gate (the model is float32) and the init in the decoder layer (overwritten by the corpus weights).
The accelerator query becomes `torch.cuda.is_available()`, `torch.cuda.amp.custom_fwd/bwd` are written as
`torch.amp.custom_fwd/bwd(device_type="cuda")` and `get_autocast_gpu_dtype()` as `get_autocast_dtype("cuda")`
(the non-deprecated spellings). Sizes: `mlp_ratio` 0.5 and `multiple_of` 8 give width 8 (the defaults are
4/3 and 256).
Constructs: `@torch.jit.script` helpers (a tensor capacity with a tensor `if`), a module-global dict cache
of distribution `rsample` bound methods (Gumbel noise in eval), `argmax` + `masked_fill` top-2, cumsum
slots with in-place capacity masking, a host copy `.to("cpu")` of the counts, `one_hot` with a tensor class
count, in-place `/=`, einsum dispatch/combine behind a module flag, module attributes written in forward,
a registry lookup and config reads, `*inputs` unpacking, `chunk` + zip expert loop with an `isinstance`
tuple check, custom autograd Functions with amp decorators for every linear, and a 3-tuple return.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Module, ModuleList

from ._shell import Source, tiny

SOURCE = Source("InternLM/InternEvo", "internlm/model/moe/gshard_layer.py",
                "c628a8c87411258e90c50f6a49f6a5e1f507ddb8", "GShardMOELayer.forward")
HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 4, 2
MLP_RATIO, MULTIPLE_OF = INTER / HIDDEN, 8


class Config:
    """The fields of InternEvo's global config that the MoE code reads (gpc.config.model / .moe / .parallel)."""

    moe_type = "GShard"
    mlp_ratio = MLP_RATIO
    moe_use_residual = False
    dtype = torch.float32
    sequence_parallel = False
    moe = dict(top_k=TOP_K, capacity_factor=1.0, eval_capacity_factor=1.0, min_capacity=4,
               noisy_gate_policy=None, drop_tokens=True, use_rts=True)


config = Config()


# ---- expert MLP: internlm/model/utils.py, ops/linear.py, modules/mlp.py (one rank) ----

def linear_bias_wgrad_torch(my_input, grad_output, has_d_bias):
    assert my_input.dtype == grad_output.dtype
    grad_weight = torch.matmul(grad_output.t(), my_input)
    grad_bias = grad_output.sum(dim=0) if has_d_bias else None
    return grad_weight, grad_bias


class FusedDenseFunc(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, weight, bias, return_residual=False, process_group=None, sequence_parallel=True,
                gather_dim=0, is_using_cuda: bool = True):
        ctx.compute_weight_gradient = weight.requires_grad
        ctx.return_residual = return_residual
        ctx.process_group = process_group
        ctx.sequence_parallel = sequence_parallel
        ctx.gather_dim = gather_dim
        ctx.is_using_cuda = is_using_cuda

        if torch.is_autocast_enabled():
            x = x.to(dtype=torch.get_autocast_dtype("cuda"))
        x = x.contiguous()
        total_x = x

        if torch.is_autocast_enabled():
            weight = weight.to(dtype=torch.get_autocast_dtype("cuda"))
            bias = bias.to(dtype=torch.get_autocast_dtype("cuda")) if bias is not None else None
        weight = weight.contiguous()
        batch_shape, n = total_x.shape[:-1], total_x.shape[-1]
        batch_dim = batch_shape.numel()
        if min(batch_dim, n, *weight.shape) > 65535 * 32:
            raise RuntimeError("fused_dense only supports matrix dims <= 2M")
        output = F.linear(total_x, weight, bias)
        if ctx.compute_weight_gradient:
            ctx.save_for_backward(x, weight)
        else:
            ctx.save_for_backward(weight)
        return output if not return_residual else (output, x)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_output, *args):
        grad_output = grad_output.contiguous()
        if ctx.return_residual:
            (grad_input,) = args
            grad_input = grad_input.contiguous()
        backward_func = linear_bias_wgrad_torch
        if ctx.compute_weight_gradient:
            x, weight = ctx.saved_tensors
            total_x = x
        else:
            (weight,) = ctx.saved_tensors
            total_x = None
        batch_shape = grad_output.shape[:-1]
        batch_dim = batch_shape.numel()
        grad_output = grad_output.reshape(batch_dim, grad_output.shape[-1])
        if ctx.needs_input_grad[0]:
            if not ctx.return_residual:
                grad_input = F.linear(grad_output, weight.t())
            else:
                grad_input = torch.addmm(grad_input.reshape(batch_dim, grad_input.shape[-1]), grad_output, weight)
            grad_input = grad_input.reshape(*batch_shape, grad_input.shape[-1])
        else:
            grad_input = None
        if ctx.needs_input_grad[1]:
            assert ctx.compute_weight_gradient
            grad_weight, grad_bias = backward_func(
                total_x.reshape(batch_dim, total_x.shape[-1]), grad_output, ctx.needs_input_grad[2]
            )
        else:
            grad_weight = None
            grad_bias = grad_output if ctx.needs_input_grad[2] else None
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


def fused_dense_func(x: Tensor, weight: Tensor, bias: Tensor | None = None, return_residual: bool = False,
                     process_group=None, sequence_parallel: bool = True, gather_dim: int = 0):
    dtype_eligible = x.dtype in [torch.float16, torch.bfloat16] or (
        x.dtype == torch.float32 and torch.is_autocast_enabled()
    )
    is_using_cuda = torch.cuda.is_available() and dtype_eligible
    return FusedDenseFunc.apply(x, weight, bias, return_residual, process_group, sequence_parallel, gather_dim,
                                is_using_cuda)


class AllReduceFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_: Tensor, process_group) -> Tensor:
        ctx.process_group = process_group
        output = input_.contiguous()
        return output

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        _ = ctx
        return grad_output, None


all_reduce = AllReduceFunc.apply


def Silu(w1_o, w2_o):  # noqa: N802 - the source's name
    return F.silu(w1_o) * w2_o


Silu = torch.jit.script(Silu)


class ColumnParallelLinearTorch(torch.nn.Linear):
    def __init__(self, in_features, out_features, process_group, bias=True, sequence_parallel=True,
                 multiple_of=1, device=None, dtype=None):
        if out_features % multiple_of:
            raise ValueError(f"out_features ({out_features}) must be a multiple of {multiple_of}")
        local_multiple = out_features // multiple_of
        super().__init__(in_features, local_multiple * multiple_of, bias=bias, device=device, dtype=dtype)
        self.process_group = process_group
        self.sequence_parallel = sequence_parallel

    def forward(self, x, gather_dim=1):
        return fused_dense_func(x, self.weight, self.bias, process_group=self.process_group,
                                sequence_parallel=self.sequence_parallel, gather_dim=gather_dim)


class RowParallelLinearTorch(torch.nn.Linear):
    def __init__(self, in_features, out_features, process_group, bias=True, sequence_parallel=True,
                 multiple_of=1, device=None, dtype=None):
        if in_features % multiple_of:
            raise ValueError(f"in_features ({in_features}) must be a multiple of {multiple_of}")
        local_multiple = in_features // multiple_of
        super().__init__(local_multiple * multiple_of, out_features, bias=bias, device=device, dtype=dtype)
        self.process_group = process_group
        self.sequence_parallel = sequence_parallel

    def forward(self, x, reduce_dim=1):
        out = fused_dense_func(x, self.weight, self.bias)
        return all_reduce(out, self.process_group)


class BaseFeedForward(torch.nn.Module):
    def __init__(self, in_features, hidden_features, out_features=None, process_group=None, bias=True,
                 device=None, dtype=None, multiple_of=MULTIPLE_OF, column_cls=None, row_cls=None):
        super().__init__()
        hidden_features = multiple_of * ((hidden_features + multiple_of - 1) // multiple_of)
        self.w1 = column_cls(in_features, hidden_features, process_group, bias,
                             sequence_parallel=config.sequence_parallel, device=device, dtype=dtype)
        self.w2 = row_cls(hidden_features, out_features, process_group, bias=bias,
                          sequence_parallel=config.sequence_parallel, device=device, dtype=dtype)
        self.w3 = column_cls(in_features, hidden_features, process_group, bias,
                             sequence_parallel=config.sequence_parallel, device=device, dtype=dtype)

    def forward(self, x):
        w1_o = self.w1(x)
        w3_o = self.w3(x)
        out = self.w2(Silu(w1_o, w3_o))
        return out


class FeedForward(BaseFeedForward):
    def __init__(self, in_features, hidden_features, out_features=None, process_group=None, bias=True,
                 device=None, dtype=None, multiple_of=MULTIPLE_OF):
        super().__init__(in_features, hidden_features, out_features, process_group, bias, device, dtype,
                         multiple_of, ColumnParallelLinearTorch, RowParallelLinearTorch)


# ---- internlm/model/moe/gshard_layer.py ----

uniform_map: dict[torch.device, Callable] = {}
gumbel_map: dict[torch.device, Callable] = {}
exp_selection_uniform_map: dict[torch.device, Callable] = {}


def multiplicative_jitter(x, device: torch.device, epsilon=1e-2):
    if epsilon == 0:
        return x
    uniform = uniform_map.get(device)
    if uniform is None:
        uniform = torch.distributions.uniform.Uniform(
            low=torch.tensor(1.0 - epsilon, device=device), high=torch.tensor(1.0 + epsilon, device=device)
        ).rsample
        uniform_map[device] = uniform
    return x * uniform(x.shape)


def gumbel_rsample(shape: tuple, device: torch.device) -> Tensor:
    gumbel = gumbel_map.get(device)
    if gumbel is None:
        one = torch.tensor(1.0, device=device)
        zero = torch.tensor(0.0, device=device)
        gumbel = torch.distributions.gumbel.Gumbel(zero, one).rsample
        gumbel_map[device] = gumbel
    return gumbel(shape)


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
    elif rule == "ks,ksm->sm":
        k, s, m = b.shape[0], b.shape[1], b.shape[2]
        a = a.t().unsqueeze(1)
        b = b.reshape(k, -1).t().reshape(s, m, k)
        return torch.bmm(a, b.transpose(1, 2)).squeeze(2)
    else:
        return torch.einsum(rule, a, b)


@torch.jit.script
def _capacity(gates: Tensor, capacity_factor: Tensor, min_capacity: Tensor) -> Tensor:
    num_tokens = gates.shape[0]
    num_experts = gates.shape[1]
    capacity = torch.ceil((num_tokens / num_experts) * capacity_factor).to(torch.int64)
    if capacity < min_capacity:
        capacity = min_capacity.to(torch.int64)
    return capacity


@torch.jit.script
def _top_idx(source, k):
    return torch.topk(source, k=k, dim=0)[1]


def top1gating(logits: Tensor, capacity_factor: float, min_capacity: int, used_token: Tensor = None,
               noisy_gate_policy: str | None = None, drop_tokens: bool = True,
               use_rts: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if noisy_gate_policy == "RSample":
        logits_w_noise = logits + gumbel_rsample(logits.shape, device=logits.device)
    gates = F.softmax(logits, dim=1)

    capacity = _capacity(gates, torch.tensor(capacity_factor), torch.tensor(min_capacity))

    indices1_s = torch.argmax(logits_w_noise if noisy_gate_policy == "RSample" else gates, dim=1)
    num_experts = int(gates.shape[1])
    mask1 = F.one_hot(indices1_s, num_classes=num_experts)

    if used_token is not None:
        mask1 = einsum("s,se->se", used_token, mask1)

    exp_counts = torch.sum(mask1, dim=0).detach().to("cpu")

    if not drop_tokens:
        new_capacity = torch.max(exp_counts).to(logits.device)
        capacity = new_capacity

    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask1.type_as(logits), dim=0)
    l_aux = torch.sum(me * ce) * num_experts

    if use_rts:
        uniform = exp_selection_uniform_map.get(logits.device)
        if uniform is None:
            uniform = torch.distributions.uniform.Uniform(
                low=torch.tensor(0.0, device=logits.device), high=torch.tensor(1.0, device=logits.device)
            ).rsample
            exp_selection_uniform_map[logits.device] = uniform
        mask1_rand = mask1 * uniform(mask1.shape)
    else:
        mask1_rand = mask1

    assert logits.shape[0] >= min_capacity, "fewer tokens than min_capacity: lower it or feed more tokens"

    top_idx = _top_idx(mask1_rand, capacity)

    new_mask1 = mask1 * torch.zeros_like(mask1).scatter_(0, top_idx, 1)
    mask1 = new_mask1

    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations1_s = torch.sum(locations1 * mask1, dim=1)

    mask1_float = mask1.type_as(logits)
    gates = gates * mask1_float

    locations1_sc = F.one_hot(locations1_s, num_classes=capacity).type_as(logits)
    combine_weights = einsum("se,sc->sec", gates, locations1_sc)
    dispatch_mask = combine_weights.bool()
    return l_aux, combine_weights, dispatch_mask, exp_counts


def top2gating(logits: Tensor, capacity_factor: float, min_capacity: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    gates = F.softmax(logits, dim=1)

    capacity = _capacity(gates, torch.tensor(capacity_factor * 2), torch.tensor(min_capacity))

    indices1_s = torch.argmax(gates, dim=1)
    num_experts = int(gates.shape[1])
    mask1 = F.one_hot(indices1_s, num_classes=num_experts)

    logits_w_noise = logits + gumbel_rsample(logits.shape, device=logits.device)
    logits_except1 = logits_w_noise.masked_fill(mask1.bool(), torch.finfo(logits.dtype).min)
    indices2_s = torch.argmax(logits_except1, dim=1)
    mask2 = F.one_hot(indices2_s, num_classes=num_experts)

    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1
    locations2 += torch.sum(mask1, dim=0, keepdim=True)

    exp_counts = torch.sum(mask1, dim=0).detach().to("cpu")

    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask1.type_as(logits), dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts

    mask1 *= torch.lt(locations1, capacity)
    mask2 *= torch.lt(locations2, capacity)

    locations1_s = torch.sum(locations1 * mask1, dim=1)
    locations2_s = torch.sum(locations2 * mask2, dim=1)

    mask1_float = mask1.type_as(logits)
    mask2_float = mask2.type_as(logits)
    gates1_s = einsum("se,se->s", gates, mask1_float)
    gates2_s = einsum("se,se->s", gates, mask2_float)
    denom_s = gates1_s + gates2_s
    denom_s = torch.clamp(denom_s, min=torch.finfo(denom_s.dtype).eps)
    gates1_s /= denom_s
    gates2_s /= denom_s

    gates1 = einsum("s,se->se", gates1_s, mask1_float)
    gates2 = einsum("s,se->se", gates2_s, mask2_float)
    locations1_sc = F.one_hot(locations1_s, num_classes=capacity).type_as(logits)
    locations2_sc = F.one_hot(locations2_s, num_classes=capacity).type_as(logits)
    combine1_sec = einsum("se,sc->sec", gates1, locations1_sc)
    combine2_sec = einsum("se,sc->sec", gates2, locations2_sc)
    combine_weights = combine1_sec + combine2_sec
    dispatch_mask = combine_weights.bool()
    return l_aux, combine_weights, dispatch_mask, exp_counts


class TopKGate(Module):
    wg: torch.nn.Linear

    def __init__(self, model_dim: int, num_experts: int, topk: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8, noisy_gate_policy: str | None = None,
                 drop_tokens: bool = True, use_rts: bool = True) -> None:
        super().__init__()
        if topk not in (1, 2):
            raise ValueError("TopKGate supports k = 1 or 2 only")
        self.wg = torch.nn.Linear(model_dim, num_experts, bias=False)
        self.k = topk
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.wall_clock_breakdown = False
        self.gate_time = 0.0
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts

    def forward(self, inputs: torch.Tensor, used_token: torch.Tensor = None) -> tuple[Tensor, Tensor, Tensor]:
        if self.noisy_gate_policy == "Jitter" and self.training:
            inputs = multiplicative_jitter(inputs, device=inputs.device)
        logits = self.wg(inputs)

        if self.k == 1:
            gate_output = top1gating(
                logits,
                self.capacity_factor if self.training else self.eval_capacity_factor,
                self.min_capacity,
                used_token,
                self.noisy_gate_policy if self.training else None,
                self.drop_tokens,
                self.use_rts,
            )
        else:
            gate_output = top2gating(
                logits, self.capacity_factor if self.training else self.eval_capacity_factor, self.min_capacity
            )
        return gate_output


# ---- internlm/model/moe/experts.py, base_layer.py ----

class Experts(torch.nn.Module):
    def __init__(self, experts: Module | ModuleList, num_local_experts=1, expert_group_name=None):
        super().__init__()
        if isinstance(experts, ModuleList):
            self.wrapped_experts = cast(ModuleList, experts)
        else:
            self.wrapped_experts = ModuleList([experts])
        self.num_local_experts = num_local_experts
        assert self.num_local_experts == len(self.wrapped_experts)
        for expert in self.wrapped_experts:
            for _, param in expert.named_parameters():
                param.is_expert = True
                param.group_name = expert_group_name

    def forward(self, inputs, split_size_or_sections=None, **kwargs):
        if self.num_local_experts == 1:
            return self.wrapped_experts[0](inputs, **kwargs)

        if split_size_or_sections is None:
            chunks = inputs.chunk(self.num_local_experts, dim=1)
        else:
            chunks = inputs.split(split_size_or_sections, dim=1)
        expert_outputs = []
        for chunk, expert in zip(chunks, self.wrapped_experts):  # noqa: B905 - as in the source
            out = expert(chunk, **kwargs)
            if isinstance(out, tuple):
                out = out[0]
            expert_outputs += [out]
        expert_output = torch.cat(expert_outputs, dim=1)
        return expert_output


class BaseMoELayer(Module):
    def __init__(self, gate: Module, experts: Module | ModuleList, ep_group, ep_size: int,
                 num_local_experts: int) -> None:
        super().__init__()
        expert_group_name = f"moe_ep_size_{ep_size}"
        self.gate = gate
        self.experts = Experts(experts, num_local_experts, expert_group_name)
        self.ep_group = ep_group
        self.ep_size = ep_size
        self.num_local_experts = num_local_experts
        self.l_aux = torch.tensor(0.0, dtype=config.dtype)
        self.exp_counts = None


class GShardMOELayer(BaseMoELayer):
    def __init__(self, hidden_size: int, num_experts: int, ep_group, ep_size: int, top_k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 noisy_gate_policy: str = None, drop_tokens: bool = True, use_rts: bool = True,
                 device: torch.device | None = None, dtype: torch.device | None = None) -> None:
        assert noisy_gate_policy is None or noisy_gate_policy in ["None", "Jitter", "RSample"], (
            "unknown noisy_gate_policy: " + noisy_gate_policy
        )
        assert num_experts % ep_size == 0, f"{num_experts} experts do not split over {ep_size} ranks"
        super().__init__(
            TopKGate(hidden_size, num_experts, top_k, capacity_factor, eval_capacity_factor, min_capacity,
                     noisy_gate_policy, drop_tokens, use_rts),
            torch.nn.ModuleList(
                [
                    FeedForward(hidden_size, int(hidden_size * config.mlp_ratio), out_features=hidden_size,
                                process_group=None, bias=False, device=device, dtype=dtype)
                    for _ in range(num_experts // ep_size)
                ]
            ),
            ep_group,
            ep_size,
            num_experts // ep_size,
        )
        self.time_falltoall = 0.0
        self.time_salltoall = 0.0
        self.time_moe = 0.0
        self.wall_clock_breakdown = False

    def forward(self, *inputs: Tensor) -> Tensor:
        d_model = inputs[0].shape[-1]
        reshaped_inputs = inputs[0].reshape(-1, d_model)

        self.l_aux, combine_weights, dispatch_mask, self.exp_counts = self.gate(reshaped_inputs, inputs[1])
        dispatched_inputs = einsum("sec,sm->ecm", dispatch_mask.type_as(inputs[0]), reshaped_inputs)

        dispatched_inputs = dispatched_inputs.reshape(self.ep_size, self.num_local_experts, -1, d_model)
        expert_output = self.experts(dispatched_inputs)

        expert_output = expert_output.reshape(self.ep_size * self.num_local_experts, -1, d_model)
        combined_output = einsum("sec,ecm->sm", combine_weights.type_as(inputs[0]), expert_output)
        out = combined_output.reshape(inputs[0].shape)
        return out


MODEL_INITIALIZER = {"GShard": GShardMOELayer}


# ---- internlm/model/moe/moe.py ----

class MoE(torch.nn.Module):
    def __init__(self, hidden_size, num_experts=1, ep_group=None, ep_size=1, device=None, dtype=None):
        super().__init__()
        self.moe_layer = MODEL_INITIALIZER[config.moe_type](
            hidden_size=hidden_size, num_experts=num_experts, ep_group=ep_group, ep_size=ep_size, device=device,
            dtype=dtype, **config.moe,
        )
        self.use_residual = config.moe_use_residual
        if self.use_residual:
            self.residual_mlp = FeedForward(hidden_size, int(hidden_size * config.mlp_ratio),
                                            out_features=hidden_size, process_group=None, bias=False,
                                            device=device, dtype=dtype)
            self.coefficient = torch.nn.Linear(hidden_size, 2)

    def forward(self, hidden_states, used_token=None):
        output = self.moe_layer(hidden_states, used_token)
        if self.use_residual:
            output_mlp = self.residual_mlp(hidden_states)
            if isinstance(output_mlp, tuple):
                output_mlp = output_mlp[0]
            coef = self.coefficient(hidden_states)
            coef = torch.nn.functional.softmax(coef, dim=-1)
            output = output * coef[..., 0:1] + output_mlp * coef[..., 1:]
        return output, self.moe_layer.l_aux, self.moe_layer.exp_counts


def _layer():
    return MoE(HIDDEN, num_experts=EXPERTS)


def build():
    return tiny(_layer, HIDDEN)
