"""gpt-oss's PyTorch reference `MLPBlock`: gathered per-token expert weights, biases, clamped swiglu, einsums.

Mirrors openai/gpt-oss `gpt_oss/torch/model.py` at commit 7b58334 (`MLPBlock.__init__`/`forward`, `swiglu`,
`RMSNorm`; `TransformerBlock` and `Transformer.forward` for how it is called). The block owns its
pre-norm and its residual: t = RMSNorm(x) (float32 compute, learned `scale`); the gate is a biased
nn.Linear(hidden, E); `torch.topk(g, k, dim=-1, sorted=True)` on the logits, softmax over the k values
(dim 1). The stacked `mlp1_weight` [E, 2I, H], `mlp1_bias` [E, 2I], `mlp2_weight` [E, H, I] and
`mlp2_bias` [E, H] are indexed by the [T, k] ids (one weight copy per token and slot), then
    t = einsum("beck,bk->bec", w1[ids], t) + b1[ids]
    t = swiglu(t): glu = t[..., ::2].clamp(max=limit), lin = t[..., 1::2].clamp(-limit, limit),
        glu * sigmoid(1.702 * glu) * (lin + 1)       (gate in even, up in odd columns; limit 7.0)
    t = einsum("beck,bek->bec", w2[ids], t);  t += b2[ids]   (in place)
    t = einsum("bec,be->bc", t, weights)
and it returns x + t. The model feeds it [T, H] (token ids are 1-D, no batch axis), so a wrapper
flattens [B, S, H] and restores it; the corpus shell's own residual is then added around the block's.
World size is kept at 1 (no process group): the intermediate width is not divided over ranks and the
`if self.world_size > 1: dist.all_reduce(t)` branch is not taken (it is kept, with world_size = 1).
Left out: the bfloat16 parameter dtype (float32 here); MXFP4 checkpoint loading and per-rank slicing.
Real sizes: 128 experts (32 for gpt-oss-20b), top-4, hidden = intermediate = 2880.
Constructs: advanced indexing of weight and bias stacks by the routed ids, gathered-weight einsums,
strided even/odd column split with asymmetric clamps, in-place `+=` bias, a world-size branch, the
block's own norm and residual inside the MoE module.
"""

from __future__ import annotations

import torch
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("openai/gpt-oss", "gpt_oss/torch/model.py", "7b583341fe16729127f6d5b94a7b09ccae97e1a1",
                "MLPBlock.forward")
HIDDEN, INTER, EXPERTS, TOP_K, SWIGLU_LIMIT = 16, 8, 8, 2, 7.0


class RMSNorm(nn.Module):
    def __init__(self, num_features: int, eps: float = 1e-05):
        super().__init__()
        self.num_features = num_features
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(num_features, dtype=torch.float32))

    def forward(self, x):
        assert x.shape[-1] == self.num_features
        t, dtype = x.float(), x.dtype
        t = t * torch.rsqrt(torch.mean(t**2, dim=-1, keepdim=True) + self.eps)
        return (t * self.scale).to(dtype)


def swiglu(x, alpha: float = 1.702, limit: float = 7.0):
    glu, lin = x[..., ::2], x[..., 1::2]
    glu = glu.clamp(min=None, max=limit)
    lin = lin.clamp(min=-limit, max=limit)
    gated = glu * torch.sigmoid(alpha * glu)
    return gated * (lin + 1)


class MLPBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts = EXPERTS
        self.experts_per_token = TOP_K
        self.swiglu_limit = SWIGLU_LIMIT
        self.world_size = 1
        self.norm = RMSNorm(HIDDEN)
        self.gate = nn.Linear(HIDDEN, EXPERTS)
        assert INTER % self.world_size == 0
        self.mlp1_weight = nn.Parameter(torch.empty(EXPERTS, INTER * 2 // self.world_size, HIDDEN))
        self.mlp1_bias = nn.Parameter(torch.empty(EXPERTS, INTER * 2 // self.world_size))
        self.mlp2_weight = nn.Parameter(torch.empty(EXPERTS, HIDDEN, INTER // self.world_size))
        self.mlp2_bias = nn.Parameter(torch.empty(EXPERTS, HIDDEN))

    def forward(self, x):
        t = self.norm(x)
        g = self.gate(t)
        picked = torch.topk(g, k=self.experts_per_token, dim=-1, sorted=True)
        expert_weights = torch.nn.functional.softmax(picked.values, dim=1)
        expert_indices = picked.indices

        w1 = self.mlp1_weight[expert_indices, ...]
        b1 = self.mlp1_bias[expert_indices, ...]
        t = torch.einsum("beck,bk->bec", w1, t) + b1
        t = swiglu(t, limit=self.swiglu_limit)

        w2 = self.mlp2_weight[expert_indices, ...]
        b2 = self.mlp2_bias[expert_indices, ...]
        t = torch.einsum("beck,bek->bec", w2, t)
        if self.world_size > 1:
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
        t += b2

        t = torch.einsum("bec,be->bc", t, expert_weights)
        return x + t


class FlatCaller(nn.Module):
    """Feeds the block [T, H] rows as `Transformer.forward` does and restores [B, S, H]."""

    def __init__(self):
        super().__init__()
        self.mlp = MLPBlock()

    def forward(self, x):
        return self.mlp(x.reshape(-1, x.size(-1))).view(x.shape)


def build():
    return tiny(FlatCaller, HIDDEN)
