"""Tutel's `MOELayer`: capacity top-k routing with slot indices and a sparse fast-dispatch encode/decode.

Mirrors microsoft/tutel `tutel/impls/moe_layer.py` at commit 82af7aa (`MOELayer.forward`, `expert_local`),
with `tutel/impls/fast_dispatch.py` (`extract_critical`, `fast_encode`, `fast_decode`,
`TutelMoeFastDispatcher`, `GatingEncoder`, `GatingDecoder`), `tutel/gates/top.py` (`LinearTopKGate`),
`tutel/experts/ffn.py` (`FusedExpertsNetwork`), `tutel/impls/losses.py` (`gshard_loss`) and the CPU path of
`tutel/jit_kernels/gating.py` (`fast_cumsum_sub_one` = cumsum - 1) from the same commit. The layer flattens
the input to [S, M], casts it to the experts' dtype (first parameter, then `break`), and routes inside a
closure: linear gate logits, softmax, `extract_critical`, which takes the top-k ids, splits them into k
per-rank index vectors, one-hot encodes them, gathers each rank's gate, computes the GShard loss, gives each
token a slot from cumsum(mask) - 1 (later ranks offset by the counts of earlier ranks), renormalises the k
gates by their clamped sum, and sets the capacity to k * int(capacity_factor * ceil(S / E)) (a Python int
from shapes), rounded up to the alignment. `fast_encode` builds a fresh `TutelMoeFastDispatcher`, whose
`update` stores int32 indices and slots, picks the kernels from a class-level pool keyed by device and
keeps a class-level ones helper, then `GatingEncoder.apply` (a `torch.autograd.Function`) scatters every
token whose slot is under the capacity into a zeroed [E * C, M] buffer (post-score: unweighted). The
experts take [E, C, M] with stacked weights (fc1 [E, H, M] transposed in a batched matmul, bias, ReLU,
fc2 [E, H, M], bias). `fast_decode` runs `GatingDecoder.apply`, which for each rank gathers each token's
expert row, scales it by its gate and zeroes dropped tokens, and sums the ranks. The output is viewed back
to the input shape and the loss is set as `self.l_aux` and as an attribute of the output tensor.
Left out: the all-to-all exchanges (one process; Tutel's all_to_all returns its input for world size 1),
the megablocks sparse-bmm branch (`torch.ops.tutel_ops`, needs CUDA), the overlap and 2D-hierarchical
paths, the `logging.info` capacity report, and the CUDA JIT kernels: Tutel's CPU fallback is a C++ loop
(`invoke_cpu`: for each sample, if slot < capacity and index >= 0, add/copy the hidden row), written here
as the equivalent boolean-mask indexing with `slots[rows] += ...` (slots are unique) / masked assignment in
plain PyTorch.
Constructs: `int()` of a registered buffer (`num_global_experts` property) compared in forward, an
`is_autocast_enabled` branch, a parameter loop with `break`, a nested closure with lambdas, `x.is_cuda`
branch, `torch.autograd.Function` encode/decode taking a Python dispatcher object, class-level mutable
state (kernel pool, ones helper), Python loops over the top-k ranks (`for k in range(1, top_k)`,
`zip(gates, indices, locations)`), boolean-mask indexing of slot < capacity (data-dependent shapes),
`assert data.is_contiguous()`, and setting `.l_aux` on the output tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("microsoft/tutel", "tutel/impls/moe_layer.py", "82af7aad9fc3ec981395ba97e7242a480984a55e",
                "MOELayer.forward")
HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 8, 2


# ---- tutel/impls/losses.py and jit_kernels/gating.py (CPU path)

def _one_hot_with_dtype(data, num_classes, dtype, hot_value=1):
    out = torch.zeros([data.size(0), num_classes], device=data.device, dtype=dtype)
    out.scatter_(1, data.unsqueeze(-1), hot_value)
    return out


def gshard_loss(scores_w_noise, top_ids):
    samples, experts = int(scores_w_noise.size(0)), int(scores_w_noise.size(1))
    mask = _one_hot_with_dtype(top_ids[:, 0], experts, dtype=scores_w_noise.dtype, hot_value=experts / samples)
    return torch.sum(torch.sum(scores_w_noise, dim=0) * torch.sum(mask, dim=0)) / samples


def fast_cumsum_sub_one(data, dim=0):
    if data.dim() != 2 or dim != 0:
        raise Exception(f"Unimplemented fast_cumsum_sub_one() of data = {data.size()} and dim = {dim}")
    return torch.cumsum(data, dim=0) - 1


# ---- the CPU sparse kernels (C++ `invoke_cpu` in tutel), as plain PyTorch

def _cpu_kernel(kernel_type):
    def func(*inputs, extra=()):
        if inputs[0].dtype not in (torch.float32, torch.float64):
            raise Exception("CPU kernel only supports float32 and float64!")
        gates, indices, locations, tokens, slots = inputs
        samples, hidden, capacity = extra
        gates = gates.reshape(-1)[:samples]
        tokens, slots = tokens.view(-1, hidden), slots.view(-1, hidden)
        valid = (locations < capacity) & (indices >= 0)
        rows = (indices.long() * capacity + locations.long())[valid]
        if kernel_type == 0:
            slots[rows] += gates[valid].unsqueeze(-1) * tokens[valid]
        elif kernel_type == 1:
            tokens.zero_()
            tokens[valid] = gates[valid].unsqueeze(-1) * slots[rows]
        else:
            gates_out = inputs[0]
            gates_out.zero_()
            gates_out[valid] = (slots[rows] * tokens[valid]).sum(dim=-1)
    return func


# ---- tutel/impls/fast_dispatch.py

class GatingEncoder(torch.autograd.Function):
    @staticmethod
    def forward(ctx, config, reshaped_input, *gates_):
        ctx.reshaped_input = reshaped_input
        ctx.config = config
        if gates_:
            ctx.gates_h2 = [x.view(-1, 1).repeat(1, 2) if x.dtype == torch.float16 else x for x in gates_]
        else:
            ctx.gates_h2 = [config.ones_helper] * len(config.indices_)
        out = torch.zeros([config.num_global_experts * config.capacity, config.model_dim],
                          dtype=reshaped_input.dtype, device=reshaped_input.device)
        for g, i, loc in zip(ctx.gates_h2, config.indices_, config.locations_, strict=False):
            config.func_fwd(g, i, loc, reshaped_input, out,
                            extra=[config.indices_[0].size(0), config.aligned_dim, config.capacity])
        return out

    @staticmethod
    def backward(ctx, grad_slots):
        grad_slots = grad_slots.contiguous()
        config, total = ctx.config, None
        extra = [config.indices_[0].size(0), config.aligned_dim, config.capacity]
        for g, i, loc in zip(ctx.gates_h2, config.indices_, config.locations_, strict=False):
            part = torch.empty(ctx.reshaped_input.shape, dtype=grad_slots.dtype, device=grad_slots.device)
            config.func_bwd_data(g, i, loc, part, grad_slots, extra=extra)
            total = part if total is None else total + part
        grad_gates = []
        if id(ctx.gates_h2[0]) != id(config.ones_helper):
            for i, loc in zip(config.indices_, config.locations_, strict=False):
                grad_g = torch.empty([config.sample_size], dtype=grad_slots.dtype, device=grad_slots.device)
                config.func_bwd_gate(grad_g, i, loc, ctx.reshaped_input, grad_slots, extra=extra)
                grad_gates.append(grad_g)
        return (None, total, *grad_gates)


class GatingDecoder(torch.autograd.Function):
    @staticmethod
    def forward(ctx, config, expert_output, *gates_):
        ctx.expert_output = expert_output
        ctx.config = config
        if gates_:
            ctx.gates_h2 = [x.view(-1, 1).repeat(1, 2) if x.dtype == torch.float16 else x for x in gates_]
        else:
            ctx.gates_h2 = [config.ones_helper] * len(config.indices_)
        total = None
        for g, i, loc in zip(ctx.gates_h2, config.indices_, config.locations_, strict=False):
            part = torch.empty([config.sample_size, config.model_dim], dtype=expert_output.dtype,
                               device=expert_output.device)
            config.func_bwd_data(g, i, loc, part, expert_output,
                                 extra=[config.indices_[0].size(0), config.aligned_dim, config.capacity])
            total = part if total is None else total + part
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_out = grad_out.contiguous()
        config = ctx.config
        extra = [config.indices_[0].size(0), config.aligned_dim, config.capacity]
        grad_expert = torch.zeros(ctx.expert_output.shape, dtype=grad_out.dtype, device=grad_out.device)
        for g, i, loc in zip(ctx.gates_h2, config.indices_, config.locations_, strict=False):
            config.func_fwd(g, i, loc, grad_out, grad_expert, extra=extra)
        grad_gates = []
        if id(ctx.gates_h2[0]) != id(config.ones_helper):
            for i, loc in zip(config.indices_, config.locations_, strict=False):
                grad_g = torch.empty([config.sample_size], dtype=grad_out.dtype, device=grad_out.device)
                config.func_bwd_gate(grad_g, i, loc, grad_out, ctx.expert_output, extra=extra)
                grad_gates.append(grad_g)
        return (None, grad_expert, *grad_gates)


class TutelMoeFastDispatcher:
    kernel_pool = dict()
    ones_helper = None

    def __init__(self, num_global_experts, capacity, model_dim, dispatch_dtype):
        self.num_global_experts = int(num_global_experts)
        self.capacity = int(capacity)
        self.model_dim = int(model_dim)
        self.dtype = dispatch_dtype if dispatch_dtype == torch.float16 else torch.float32
        self.original_dtype = dispatch_dtype
        self.aligned_dim = model_dim // (2 if self.dtype == torch.float16 else 1)
        self.is_cuda = None

    def update(self, indices_, locations_, gates_, capacity=None, is_postscore=True):
        self.indices_ = [x.to(torch.int32).view(-1) for x in indices_]
        self.locations_ = [x.to(torch.int32) for x in locations_]
        self.gates_ = [x.to(self.dtype) for x in gates_]
        self.is_postscore = is_postscore
        self.sample_size, self.capacity = int(self.indices_[0].size(0)), int(capacity) or self.capacity

        if self.is_cuda != indices_[0].is_cuda:
            self.is_cuda = indices_[0].is_cuda
            if self.is_cuda not in TutelMoeFastDispatcher.kernel_pool:
                self.func_fwd, self.func_bwd_data, self.func_bwd_gate = (_cpu_kernel(t) for t in range(3))
                TutelMoeFastDispatcher.kernel_pool[self.is_cuda] = (self.func_fwd, self.func_bwd_data,
                                                                    self.func_bwd_gate)
            else:
                self.func_fwd, self.func_bwd_data, self.func_bwd_gate = (
                    TutelMoeFastDispatcher.kernel_pool[self.is_cuda])

        helper = TutelMoeFastDispatcher.ones_helper
        if helper is None or helper.size(0) < self.sample_size:
            TutelMoeFastDispatcher.ones_helper = torch.ones([self.sample_size, 2], dtype=self.dtype,
                                                            device=self.indices_[0].device)
        if TutelMoeFastDispatcher.ones_helper.is_cuda != self.indices_[0].is_cuda:
            TutelMoeFastDispatcher.ones_helper = torch.ones([TutelMoeFastDispatcher.ones_helper.size(0), 2],
                                                            dtype=self.dtype, device=self.indices_[0].device)
        self.ones_helper = TutelMoeFastDispatcher.ones_helper

    def encode(self, data):
        if self.is_postscore:
            return GatingEncoder.apply(self, data.to(self.dtype)).to(self.original_dtype)
        return GatingEncoder.apply(self, data.to(self.dtype), *self.gates_).to(self.original_dtype)

    def decode(self, data):
        if self.is_postscore:
            return GatingDecoder.apply(self, data.to(self.dtype), *self.gates_).to(self.original_dtype)
        return GatingDecoder.apply(self, data.to(self.dtype)).to(self.original_dtype)


def extract_critical(scores, top_k, loss_fn=gshard_loss, capacity_factor=1.0, batch_prioritized_routing=False,
                     normalize_gate=True, alignment=1):
    num_global_experts = int(scores.size(1))
    top_k = min(top_k, num_global_experts)
    topk_indices = torch.topk(scores, top_k, dim=1).indices
    indices_s = [x.view(-1) for x in topk_indices.chunk(top_k, dim=1)]
    masks_se = [_one_hot_with_dtype(x, num_classes=num_global_experts, dtype=x.dtype) for x in indices_s]
    gates_s = [(scores * x).sum(dim=1) for x in masks_se]
    l_loss = loss_fn(scores, topk_indices) if loss_fn is not None else None

    if batch_prioritized_routing:
        importance = -1 * scores.max(dim=1)[0]

        def compute_location(x):
            order = importance.argsort(dim=0)
            return (fast_cumsum_sub_one(x[order]) * x[order])[order.argsort(dim=0)]
    else:
        compute_location = fast_cumsum_sub_one

    locations1 = compute_location(masks_se[0])
    locations_s = [torch.sum(locations1 * masks_se[0], dim=1).to(torch.int32)]
    if top_k > 1:
        acc_base = None
        for k in range(1, top_k):
            counts = torch.sum(masks_se[k - 1], dim=0, keepdim=True)
            acc_base = counts if acc_base is None else acc_base + counts
            locations2 = compute_location(masks_se[k])
            locations2 += acc_base
            locations_s.append(torch.sum(locations2 * masks_se[k], dim=1).to(torch.int32))
        if normalize_gate:
            denom_s = torch.clamp(sum(gates_s), min=torch.finfo(gates_s[0].dtype).eps)
            gates_s = [x / denom_s for x in gates_s]
    else:
        locations2 = locations1
    locations2 = locations2[-1] + 1

    indices_s = [x.to(torch.int32) for x in indices_s]
    num_samples = int(scores.size(0))
    samples_per_expert = (num_samples + num_global_experts - 1) // num_global_experts
    if capacity_factor > 0:
        capacity = top_k * int(capacity_factor * samples_per_expert)
    else:
        capacity = int(locations2.max())
        if capacity_factor < 0:
            capacity = min(capacity, top_k * int(-capacity_factor * samples_per_expert))
    remainder = capacity % alignment
    if remainder > 0:
        capacity = capacity + alignment - remainder
    return (num_global_experts, indices_s, locations_s, gates_s, capacity, locations2), l_loss


def get_dispatch_count(critial_data):
    return critial_data[-1]


def fast_encode(data, critial_data, is_postscore=True):
    assert data.is_contiguous(), "Input tensor for encode/decode should be in contiguous memory format."
    experts = critial_data[0]
    dispatcher = TutelMoeFastDispatcher(experts, 0, data.size(-1), data.dtype)
    dispatcher.update(*critial_data[1:-1], is_postscore=is_postscore)
    return dispatcher.encode(data).view(experts, -1, data.size(-1))


def fast_decode(data, critial_data, is_postscore=True):
    assert data.is_contiguous(), "Input tensor for encode/decode should be in contiguous memory format."
    experts = critial_data[0]
    dispatcher = TutelMoeFastDispatcher(experts, 0, data.size(-1), data.dtype)
    dispatcher.update(*critial_data[1:-1], is_postscore=is_postscore)
    return dispatcher.decode(data).view(-1, data.size(-1))


# ---- tutel/gates/top.py and tutel/experts/ffn.py

class LinearTopKGate(nn.Module):
    def __init__(self, model_dim, num_global_experts, k=1, fp32_gate=False):
        super().__init__()
        self.wg = nn.Linear(model_dim, num_global_experts, bias=False,
                            dtype=torch.float32 if fp32_gate else None)
        self.top_k = min(num_global_experts, int(k))
        self.fp32_gate = fp32_gate

    def forward(self, x):
        wg = self.wg.float() if self.fp32_gate else self.wg
        return wg(x.to(dtype=wg.weight.dtype))


class FusedExpertsNetwork(nn.Module):
    def __init__(self, model_dim, hidden_size_per_expert, local_experts, sharded_count=1, activation_fn=None):
        super().__init__()
        self.model_dim = model_dim
        self.local_experts = local_experts
        self.sharded_count = sharded_count
        self.hidden_size = hidden_size_per_expert // sharded_count
        self.output_dim = model_dim
        self.activation_fn = activation_fn if activation_fn is not None else F.relu
        self.batched_fc1_w = nn.Parameter(torch.empty(local_experts, self.hidden_size, model_dim))
        self.batched_fc2_w = nn.Parameter(torch.empty(local_experts, self.hidden_size, self.output_dim))
        self.batched_fc1_bias = nn.Parameter(torch.empty(local_experts, self.hidden_size))
        self.batched_fc2_bias = nn.Parameter(torch.empty(local_experts, self.output_dim))
        with torch.no_grad():
            for i in range(local_experts):
                fc1, fc2 = nn.Linear(model_dim, self.hidden_size), nn.Linear(self.hidden_size, self.output_dim)
                self.batched_fc1_w[i], self.batched_fc1_bias[i] = fc1.weight, fc1.bias
                self.batched_fc2_w[i], self.batched_fc2_bias[i] = fc2.weight.t(), fc2.bias

    def forward(self, x, ctx):
        fc1_w, fc2_w = self.batched_fc1_w, self.batched_fc2_w
        fc1_b = self.batched_fc1_bias.unsqueeze(1)
        fc2_b = self.batched_fc2_bias.unsqueeze(1)
        if fc2_b.size(-1) != self.output_dim:
            fc2_b = fc2_b[:, :, : self.output_dim]
        y = torch.add(torch.matmul(x, fc1_w.permute(0, 2, 1)), fc1_b)
        y = self.activation_fn(y)
        return torch.add(torch.matmul(y, fc2_w), fc2_b)


# ---- tutel/impls/moe_layer.py

class MOELayer(nn.Module):
    def __init__(self, model_dim=HIDDEN, count_per_node=EXPERTS, hidden_size_per_expert=INTER, k=TOP_K,
                 capacity_factor=1.0, is_postscore=True, batch_prioritized_routing=False, normalize_gate=True):
        super().__init__()
        self.num_local_experts = count_per_node
        self.register_buffer("_num_global_experts", torch.tensor(count_per_node))
        self.world_size = 1
        self.sharded_count = 1
        self.auto_parallel, self.adaptive_degree, self.use_model_parallel = False, 1, True
        self.model_dim = model_dim
        self.is_postscore = is_postscore
        self.batch_prioritized_routing = batch_prioritized_routing
        self.normalize_gate = normalize_gate
        self.a2a_ffn_overlap_degree = 1
        self.experts = FusedExpertsNetwork(model_dim, hidden_size_per_expert, self.num_local_experts)
        gate = LinearTopKGate(model_dim, self.num_global_experts, k=k)
        gate.gate_noise = 0.0
        gate.capacity_factor = capacity_factor
        self.gates = nn.ModuleList([gate])

    @property
    def num_global_experts(self):
        return int(self._num_global_experts)

    def expert_local(self, x, reserve_shape):
        y = self.experts(x.view(x.size(0), x.size(1), *reserve_shape), self)
        self.protected_shape = y.shape
        return y.reshape(y.size(0), y.size(1), -1)

    def forward(self, input, gate_index=0, capacity_factor=None, top_k=None, reserve_dims=1):
        original_shape, original_dtype = input.shape, input.dtype
        assert len(original_shape) >= 2, "Input data must be at least 2D tensor: (s)amples, .., (m)odel_dim"
        x = input.reshape(-1, original_shape[-reserve_dims:].numel())
        if torch.is_autocast_enabled():
            x = x.to(torch.get_autocast_dtype(x.device.type))
        else:
            for p in self.experts.parameters():
                x = x.to(p.dtype)
                break
        gctx = self.gates[gate_index]
        a2a_ffn_overlap_degree = self.a2a_ffn_overlap_degree
        top_k = top_k or gctx.top_k
        megablocks_size = 0

        def routing():
            logits = gctx(x)
            if self.training and gctx.gate_noise > 0:
                noisy = logits + gctx.gate_noise * torch.randn_like(logits) / self.num_global_experts
            else:
                noisy = logits
            scores = F.softmax(noisy, dim=1)

            def loss_fn(gates, topk_ids):
                return gshard_loss(gates, topk_ids)

            mega_up = max(megablocks_size, 1)
            alignment = (self.sharded_count * a2a_ffn_overlap_degree + mega_up - 1) // mega_up * mega_up
            if alignment > 256:
                alignment = (alignment + 127) // 128 * 128
            return logits.dtype, extract_critical(
                scores, top_k=top_k, loss_fn=loss_fn, capacity_factor=capacity_factor or gctx.capacity_factor,
                batch_prioritized_routing=self.batch_prioritized_routing, normalize_gate=self.normalize_gate,
                alignment=alignment)

        if x.is_cuda:
            with torch.autocast("cuda", enabled=False):
                logits_dtype, (crit, l_aux) = routing()
        else:
            logits_dtype, (crit, l_aux) = routing()

        self.megablocks_size = megablocks_size
        self.dispatch_count = get_dispatch_count(crit)
        y = fast_encode(x.to(logits_dtype), crit, self.is_postscore).to(x.dtype)

        if self.adaptive_degree == 0:
            y = self.expert_local(y, original_shape[-reserve_dims:])
        else:
            if self.num_global_experts < self.world_size:
                y = y.view(self.world_size, -1, y.size(2))
            y = self.expert_local(y, original_shape[-reserve_dims:])
            if self.num_global_experts < self.world_size:
                y = y.view(self.num_global_experts, -1, y.size(2))

        y = fast_decode(y.to(logits_dtype), crit, self.is_postscore)
        y = y.view(list(original_shape[:-reserve_dims]) + list(self.protected_shape[-reserve_dims:]))
        y = y.to(original_dtype)
        self.l_aux = y.l_aux = l_aux
        return y


def build():
    return tiny(MOELayer, HIDDEN)
