"""Llama 4's reference `MoE`: dense sigmoid-scored dispatch of every token to every expert, batched bmm.

Mirrors meta-llama/llama-models `models/llama4/moe.py` at commit a9c89c4 (`MoE.__init__`/`forward`,
`Experts.forward`/`batched_swiglu`), with the shared expert from `models/llama4/ffn.py` (`FeedForward`,
built with `do_reduce=False`) and the defaults of `MoEArgs` in `models/llama4/args.py` (top_k 1,
capacity_factor 1.0, auto_scale_F True); `models/llama4/model.py` builds it with hidden_dim =
int(ffn_exp * dim). The hidden width is computed as in `MoE.__init__` (2/3, ffn_dim_multiplier, divided
by capacity_factor + 1 under auto_scale_F, rounded up to multiple_of); the arguments here give INTER 8.

Forward: x [b, s, D] is viewed as [a, D]; router scores = x @ router_DE ([D, E] parameter), transposed to
[E, a]; the top-k per token is taken on the raw scores and scattered into a tensor full of -inf
(`full_like(...).scatter_(1, ids, vals)`), so each expert row keeps only the tokens that chose it; the
token index for every (expert, token) pair is `arange(a)` expanded to [E, a]; the scores go through a
sigmoid (unchosen ones become exactly 0). ALL a tokens are `torch.gather`ed once per expert ([E*a, D]) and
multiplied by their sigmoid score BEFORE the experts. The shared SwiGLU expert runs on x; the routed
input is `.detach()`ed and fed to `Experts`, which views it as [E, a, D] and computes
bmm(silu(bmm(x, w1)) * bmm(x, w3), w2) with stacked w1/w3 [E, D, F] and w2 [E, F, D] (w1 gate, w3 up,
w2 down, no transposes); the [E*a, D] outputs are `scatter_add_`ed in place into the shared expert's
output by token index, and the result is viewed back to [b, s, D]. No capacity limit, no loop.
World size 1: the model-parallel world size that divides F is 1, fairscale's Column/RowParallelLinear of
the shared expert are plain bias-free weights used through F.linear, and
`reduce_from_model_parallel_region` is the identity at world size 1 (written as such).
Left out: state-dict load hooks (checkpoint key renames), the int4-weight shared-expert variant.
Constructs: scatter into a -inf tensor, `arange().expand` index, sigmoid routing scores, `torch.gather`
of all tokens per expert, input scaled before the experts, `.detach()` on the routed input, batched
`torch.bmm` experts, in-place `scatter_add_` onto the shared expert output; no data-dependent Python.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.nn import functional as F

from ._shell import Source, tiny

SOURCE = Source("meta-llama/llama-models", "models/llama4/moe.py", "a9c89c471f793423afd4cc3ca8671d6e56fe64cb",
                "MoE.forward")
HIDDEN, EXPERTS, TOP_K = 16, 8, 1
# int(2 * 24 / 3) = 16 -> * 1.0 -> / (capacity_factor + 1) = 8 -> multiple of 8: INTER = 8.
FFN_HIDDEN, FFN_DIM_MULTIPLIER, MULTIPLE_OF = 24, 1.0, 8
MODEL_PARALLEL_WORLD_SIZE = 1


@dataclasses.dataclass
class MoEArgs:
    num_experts: int = -1
    capacity_factor: float = 1.0
    auto_scale_F: bool = True
    top_k: int = 1
    interleave_moe_layer_step: int = 1


def divide_exact(numerator: int, denominator: int) -> int:
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator


def reduce_from_model_parallel_region(x):
    """fairscale's all-reduce over the model-parallel group: the identity at world size 1."""
    return x


class FeedForward(nn.Module):
    """The shared expert: Column/RowParallelLinear at world size 1 are plain bias-free weights."""

    def __init__(self, dim: int, hidden_dim: int, do_reduce: bool = True):
        super().__init__()
        self.do_reduce = do_reduce
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        x = F.silu(F.linear(x, self.w1.weight)) * F.linear(x, self.w3.weight)
        out = F.linear(x, self.w2.weight)
        if self.do_reduce:
            return reduce_from_model_parallel_region(out)
        return out


class Experts(nn.Module):
    def __init__(self, num_local_experts: int, dim: int, hidden_dim: int):
        super().__init__()
        self.num_local_experts = num_local_experts
        self.dim = dim
        divide_factor = MODEL_PARALLEL_WORLD_SIZE
        width = divide_exact(hidden_dim, divide_factor)
        self.w1 = nn.Parameter(torch.empty(num_local_experts, dim, width))
        self.w2 = nn.Parameter(torch.empty(num_local_experts, width, dim))
        self.w3 = nn.Parameter(torch.empty(num_local_experts, dim, width))

    def forward(self, routed_in_egD):
        e, D = self.num_local_experts, self.dim
        x_egD = routed_in_egD.view(e, -1, D)
        out_egD = self.batched_swiglu(x_egD, self.w1, self.w3, self.w2)
        return out_egD.view(-1, D)

    def batched_swiglu(self, x, w1, w3, w2):
        middle = F.silu(torch.bmm(x, w1)) * torch.bmm(x, w3)
        return torch.bmm(middle, w2)


class MoE(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, ffn_dim_multiplier: float, multiple_of: int,
                 moe_args: MoEArgs):
        super().__init__()
        self.moe_args = moe_args
        denom: float = 1
        if moe_args.auto_scale_F:
            denom = moe_args.capacity_factor + 1
        hidden_dim = int(2 * hidden_dim / 3)
        hidden_dim = int(ffn_dim_multiplier * hidden_dim)
        if moe_args.auto_scale_F:
            hidden_dim = int(hidden_dim / denom)
        hidden_dim += -hidden_dim % multiple_of

        self.experts = Experts(moe_args.num_experts, dim, hidden_dim)
        self.router_DE = nn.Parameter(torch.empty(dim, moe_args.num_experts))
        self.shared_expert = FeedForward(dim, hidden_dim, do_reduce=False)

    def forward(self, x_bsD):
        _, slen, D = x_bsD.shape
        x_aD = x_bsD.view(-1, D)
        a = x_aD.shape[0]

        scores = torch.matmul(x_aD, self.router_DE).transpose(0, 1)  # [E, a]
        top_vals, top_ids = torch.topk(scores.transpose(0, 1), self.moe_args.top_k, dim=1)
        scores = (
            torch.full_like(scores.transpose(0, 1), float("-inf"))
            .scatter_(1, top_ids, top_vals)
            .transpose(0, 1)
        )
        token_ids = torch.arange(a, device=x_aD.device).view(1, -1).expand(scores.size(0), -1)
        scores = torch.sigmoid(scores)

        routed_in = torch.gather(x_aD, dim=0, index=token_ids.reshape(-1, 1).expand(-1, D))
        routed_in = routed_in * scores.reshape(-1, 1)

        out_aD = self.shared_expert(x_aD)
        routed_out = self.experts(routed_in.detach())

        scatter_index = token_ids.reshape(-1, 1).expand(-1, D)
        out_aD.scatter_add_(dim=0, index=scatter_index, src=routed_out.view(-1, D))
        out_aD = reduce_from_model_parallel_region(out_aD)
        return out_aD.view(-1, slen, D)


def _make():
    return MoE(HIDDEN, FFN_HIDDEN, FFN_DIM_MULTIPLIER, MULTIPLE_OF, MoEArgs(num_experts=EXPERTS, top_k=TOP_K))


def build():
    return tiny(_make, HIDDEN)
