"""OLMo-core's `DroplessMoE`: histogram router, sort-based permutation, and a host-looped grouped GEMM fallback.

Mirrors allenai/OLMo-core `src/olmo_core/nn/moe/moe.py` at commit fa6c501 (`MoEBase.forward`,
`DroplessMoE`), with `nn/moe/router.py` (`MoERouter.forward`, `get_top_k`, `jitter`,
`MoELinearRouter.get_expert_logits`), `nn/moe/parallel_mlp.py` (`ParallelMLPBase.forward`,
`indices_and_bins`, `ParallelDroplessMLP.forward_once`, `permute_and_compute`), `nn/moe/mlp.py`
(`DroplessMoEMLP.forward` and its `gmm` fallback) and `ops/moe.py` (`batched_histc`, `gather`, `scatter`).

The router (a flat [E*D] weight viewed as [E, D]) computes float32 logits of the [B, S, D] input, a
softmax, and the top-k (plain `topk`: no score bias, no uniform assignment, no weight normalisation, as
in OLMoE); under `torch.no_grad()` it histograms the chosen ids per token with `scatter_add_` of ones
(`batched_histc`) and sums over sequence and batch into per-expert counts; aux losses and metric
accumulation live in an `if self.training and torch.is_grad_enabled():` branch. The dropless parallel
MLP flattens tokens, weights and ids, and under `torch.no_grad()` sorts the flat ids (`torch.sort` of
int32 ids) to get the permutation and bin ids, and writes the cumulative counts into an int32 `bins`
tensor with `torch.cumsum(..., out=bins)`. It gathers the rows `x[indices // top_k]` in expert order,
runs the experts, then scatters each result back to slot `indices[i]` scaled by its router weight and sums
the top-k slots of each token. The experts (`w1`, `w2`, `w3` each [E*hidden, D], viewed [E, hidden, D])
compute w2ᵀ(silu(x w1ᵀ) * x w3ᵀ) through `gmm`, which is `@torch._dynamo.disable()`d and, without the
`grouped_gemm` package, loops `for i, size in enumerate(batch_sizes.cpu().numpy())` slicing
`x[start : start + size]` (no empty skip) and `torch.cat`s the products.
Left out: the Triton `gather`/`scatter` kernels (replaced by the plain indexing they compute), the
`grouped_gemm` CUDA kernel (the original's own fallback is kept), expert/tensor/context parallelism and
`get_local_tensor`, the load-balancing / z-loss computation and `attach_auxiliary_loss` (training only;
the branch keeps only the per-expert count accumulation), jitter noise (training only, kept as a branch).
Constructs: `@torch._dynamo.disable()` on the grouped GEMM, a `.cpu().numpy()` host read of the counts and
a loop over `enumerate` of it with Python-int slicing, `torch.no_grad()` blocks, `scatter_add_` histogram,
`torch.sort` permutation, `cumsum(out=)`, `if self.training` branches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("allenai/OLMo-core", "src/olmo_core/nn/moe/moe.py", "fa6c5014c9f6e9ee789da2d9c20d5126fee8df0d",
                "MoEBase.forward")
HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 8, 2


def batched_histc(ids, num_classes):
    counts = torch.zeros((*ids.shape[:-1], num_classes), dtype=ids.dtype, device=ids.device)
    counts.scatter_add_(-1, ids, torch.ones_like(ids))
    return counts


def gather(x, indices, bin_ids, bins, top_k):
    return x[indices.long() // top_k]


def scatter(x, indices, bin_ids, weights, bins, top_k):
    tokens = indices.shape[0] // top_k
    slots = x.new_zeros((tokens * top_k, x.shape[1]))
    rows = indices.long()
    slots[rows] = x * weights[rows].unsqueeze(1)
    slots = slots.view(tokens, top_k, x.shape[1])
    return slots.sum(dim=1) if top_k > 1 else slots.view(tokens, x.shape[1])


class MoELinearRouter(nn.Module):
    def __init__(self, *, d_model, num_experts, top_k=1, jitter_eps=None, normalize_expert_weights=None,
                 uniform_expert_assignment=False):
        super().__init__()
        self.d_model = d_model
        self.num_experts = num_experts
        self.top_k = top_k
        self.jitter_eps = jitter_eps
        self.normalize_expert_weights = normalize_expert_weights
        self.uniform_expert_assignment = uniform_expert_assignment
        self.weight = nn.Parameter(torch.empty(num_experts * d_model))
        self.batch_size_per_expert = torch.zeros(num_experts)

    def jitter(self, x):
        if self.jitter_eps is None or not self.training:
            return x
        noise = torch.rand_like(x)
        return x * ((1.0 - self.jitter_eps) + noise * (2.0 * self.jitter_eps))

    def get_top_k(self, scores):
        if self.top_k == 1:
            weights, ids = scores.max(dim=-1, keepdim=True)
        else:
            weights, ids = torch.topk(scores, self.top_k, dim=-1)
        if self.uniform_expert_assignment:
            ids = torch.remainder(torch.arange(ids.numel(), dtype=ids.dtype), self.num_experts).view(ids.shape)
            weights = scores.gather(-1, ids)
        return weights, ids

    def get_expert_logits(self, x):
        return F.linear(x.float(), self.weight.view(self.num_experts, self.d_model).float())

    def forward(self, x):
        x = self.jitter(x)
        logits = self.get_expert_logits(x).float()
        scores = logits.softmax(dim=-1)
        weights, ids = self.get_top_k(scores)
        if self.normalize_expert_weights is not None:
            weights = weights.div(torch.norm(weights, p=self.normalize_expert_weights, dim=-1, keepdim=True))
        with torch.no_grad():
            per_token = batched_histc(ids, self.num_experts)
            per_batch = per_token.sum(dim=1)
            per_expert = per_batch.sum(dim=0)
        aux = None
        if self.training and torch.is_grad_enabled():
            self.batch_size_per_expert += per_expert
        return weights, ids, per_expert, aux


class DroplessMoEMLP(nn.Module):
    def __init__(self, *, d_model, hidden_size, num_experts):
        super().__init__()
        self.d_model = d_model
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts * hidden_size, d_model))
        self.w2 = nn.Parameter(torch.empty(num_experts * hidden_size, d_model))
        self.w3 = nn.Parameter(torch.empty(num_experts * hidden_size, d_model))
        self._gmm = None

    @torch._dynamo.disable()
    def gmm(self, x, w, batch_sizes, trans_b=False):
        parts = []
        begin = 0
        for i, n in enumerate(batch_sizes.cpu().numpy()):
            mat = w[i, :, :].t() if trans_b else w[i, :, :]
            parts.append(x[begin : begin + n, :] @ mat)
            begin += n
        return torch.cat(parts)

    def forward(self, x, batch_size_per_expert):
        shape = (self.num_experts, self.hidden_size, self.d_model)
        w1, w2, w3 = self.w1.view(shape), self.w2.view(shape), self.w3.view(shape)
        gate = self.gmm(x, w1, batch_size_per_expert, trans_b=True)
        up = self.gmm(x, w3, batch_size_per_expert, trans_b=True)
        return self.gmm(F.silu(gate) * up, w2, batch_size_per_expert)


class ParallelDroplessMLP(nn.Module):
    def __init__(self, *, mlp, top_k):
        super().__init__()
        self.mlp = mlp
        self.top_k = top_k

    def indices_and_bins(self, expert_indices, batch_size_per_expert):
        expert_indices = expert_indices.int()
        bin_ids, order = torch.sort(expert_indices)
        bins = torch.empty_like(batch_size_per_expert, dtype=torch.int32)
        torch.cumsum(batch_size_per_expert, 0, out=bins)
        return order.int(), bin_ids, bins

    def forward(self, x, expert_weights, expert_indices, batch_size_per_expert):
        in_shape = x.size()
        x = x.view(-1, x.shape[-1])
        expert_weights = expert_weights.flatten()
        expert_indices = expert_indices.flatten()
        with torch.no_grad():
            indices, bin_ids, bins = self.indices_and_bins(expert_indices, batch_size_per_expert)
        x = self.forward_once(x, expert_weights=expert_weights, expert_indices=expert_indices, indices=indices,
                              bin_ids=bin_ids, bins=bins, batch_size_per_expert=batch_size_per_expert)
        return x.view(in_shape)

    def forward_once(self, x, *, expert_weights, expert_indices, indices, bin_ids, bins, batch_size_per_expert):
        del expert_indices
        return self.permute_and_compute(x, batch_size_per_expert=batch_size_per_expert, indices=indices,
                                        bin_ids=bin_ids, expert_weights=expert_weights, bins=bins, top_k=self.top_k)

    def permute_and_compute(self, x, *, batch_size_per_expert, indices, bin_ids, expert_weights, bins, top_k):
        x = x.view(-1, x.shape[-1])
        x = gather(x, indices, bin_ids, bins, top_k)
        x = self.mlp(x, batch_size_per_expert)
        return scatter(x, indices, bin_ids, expert_weights, bins, top_k)


class DroplessMoE(nn.Module):
    def __init__(self, *, d_model, num_experts, hidden_size, top_k, shared_mlp=None):
        super().__init__()
        self.router = MoELinearRouter(d_model=d_model, num_experts=num_experts, top_k=top_k)
        self.experts = ParallelDroplessMLP(
            mlp=DroplessMoEMLP(d_model=d_model, hidden_size=hidden_size, num_experts=num_experts), top_k=top_k)
        self.shared_mlp = shared_mlp

    @property
    def top_k(self):
        return self.router.top_k

    def forward(self, x):
        expert_weights, expert_indices, batch_size_per_expert, _aux = self.router(x)
        shared_out = None
        if self.shared_mlp is not None:
            shared_out = self.shared_mlp(x)
        out = self.experts(x, expert_weights, expert_indices, batch_size_per_expert)
        if shared_out is not None:
            shared_out = shared_out / (self.top_k + 1)
            out = shared_out.add(out, alpha=self.top_k / (self.top_k + 1))
        return out


def build():
    return tiny(lambda: DroplessMoE(d_model=HIDDEN, num_experts=EXPERTS, hidden_size=INTER, top_k=TOP_K), HIDDEN)
