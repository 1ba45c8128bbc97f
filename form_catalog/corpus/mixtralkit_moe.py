"""MixtralKit's `MoETorchFFN`: top-2 of the gate logits, tokens repeated k times, boolean-mask gather/scatter per expert.

Mirrors open-compass/MixtralKit `mixtralkit/layers/moe.py` at commit d4da9e0 (HEAD; the file last changed at
62c7ffd, "Update fairscale(draft)") (`MoETorchFFN.__init__`, `MoETorchFFN.forward`, and the MoE wiring of
`MoETorchTransformerBlock.__init__`), with `TorchFFN` from `mixtralkit/layers/ffn.py`, `MixtralModelArgs` from
`mixtralkit/layers/utils.py` and `TorchTransformerBlock.forward` from `mixtralkit/layers/transformer.py` at the
same commit. This is MixtralKit's torch backend, the one `Mixtral.build` (mixtralkit/mixtral/generation.py)
instantiates (`MoETorchTransformer`); it spreads the experts over GPUs for inference.
The block builds `MoETorchFFN(dim=args.dim, hidden_dim=args.hidden_dim, num_shards=num_experts // num_gpus,
**args.moe)`: `num_experts` SwiGLU `TorchFFN` experts (bias-free w1/w2/w3, `w2(silu(w1(x)) * w3(x))`) and a
bias-free gate Linear; `gate_softmax` defaults to False (Mixtral's params.json gives only `num_experts` and
`num_experts_per_tok`), and `__init__` prints it. The block calls the layer as
`self.feed_forward.forward(self.ffn_norm(h))` on [bsz, seqlen, dim] activations. The forward keeps the input
shape, views the tokens [T, dim], takes the gate logits (softmaxed first only `if self.gate_softmax`),
`torch.topk` of them (k = num_experts_per_tok), softmaxes the k values, flattens the ids to [T*k], repeats every
token k times with `x.repeat_interleave(k, dim=0)`, allocates `y = torch.empty_like(x)`, and loops
`for i, expert in enumerate(self.experts)`: `y[flat_expert_indices == i] = expert(x[flat_expert_indices == i])`
(a boolean-mask gather and boolean-mask index_put, the mask computed twice; no empty-expert skip). It combines
with `(y.view(*expert_weights.shape, -1) * expert_weights.unsqueeze(-1)).sum(dim=1)` and views back to the input
shape. Each `TorchFFN.forward` moves its input to its weight's device and the result back
(`x.to(self.w1.weight.device)`, `.to(device)`: no-ops here, all on the CPU).
The outer `FeedForwardCall` module calls the layer through `.forward` as `TorchTransformerBlock.forward` does.
Left out: the per-expert device placement in `__init__` (`TorchFFN(...).to(f"cuda:{i // num_shards}")`; here
every expert stays on the CPU, so num_gpus plays no part), the attention, RMSNorm, rotary and KV-cache parts of
the block (the corpus shell supplies the residual and norm), `@torch.inference_mode()` on
`TorchTransformer.forward` (outside the layer), the half-precision default tensor type set by `Mixtral.build`,
and the FairScale backend (`MoEFairScaleFFN`, marked "TODO: Stay Tuned", with the same forward over
model-parallel linears).
Mixtral 8x7B: dim 4096, hidden_dim 14336, 8 experts, top-2 (kept at the tiny size: hidden 16, expert width 32).
Constructs: a config flag branch (`gate_softmax`), softmax over the top-k logits only, `repeat_interleave` of
the tokens by k, `torch.empty_like` output, an `enumerate(self.experts)` loop with no skip, boolean-mask
gather `x[ids == i]` and boolean-mask index_put `y[ids == i] = ...`, `view(*tensor.shape, -1)` with a starred
shape, weighted sum over the k slots, `.to(device)` round trips in the expert, an explicit `.forward` call on
the submodule, a `print` in `__init__`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("open-compass/MixtralKit", "mixtralkit/layers/moe.py",
                "d4da9e0515cc44b1bdb847a75786f0f6720d198a", "MoETorchFFN.forward")
HIDDEN, INTER, EXPERTS, TOP_K = 16, 32, 8, 2


@dataclass
class MixtralModelArgs:
    dim: int = HIDDEN
    hidden_dim: int = INTER
    n_layers: int = 1
    norm_eps: float = 1e-5
    moe: dict = field(default_factory=lambda: {"num_experts": EXPERTS, "num_experts_per_tok": TOP_K})
    num_gpus: int = 1


class TorchFFN(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()

        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        device = x.device
        x = x.to(self.w1.weight.device)
        return self.w2(F.silu(self.w1(x)) * self.w3(x)).to(device)


class MoETorchFFN(nn.Module):
    def __init__(self, num_experts: int, num_experts_per_tok: int, num_shards: int, gate_softmax: bool = False,
                 **kwargs):
        super().__init__()
        # upstream: TorchFFN(**kwargs).to(f"cuda:{i//num_shards}"); every expert stays on the CPU here
        self.experts = nn.ModuleList([TorchFFN(**kwargs) for i in range(num_experts)])
        self.gate = nn.Linear(kwargs["dim"], num_experts, bias=False)

        self.num_experts_per_tok = num_experts_per_tok
        self.gate_softmax = gate_softmax
        print(f"Softmax for Gate:{str(gate_softmax)}")

    def forward(self, x):
        orig_shape = x.shape
        x = x.view(-1, x.shape[-1])

        if self.gate_softmax:
            scores = self.gate(x).softmax(dim=-1)
        else:
            scores = self.gate(x)

        expert_weights, expert_indices = torch.topk(scores, self.num_experts_per_tok, dim=-1)
        expert_weights = expert_weights.softmax(dim=-1)
        flat_expert_indices = expert_indices.view(-1)

        x = x.repeat_interleave(self.num_experts_per_tok, dim=0)
        y = torch.empty_like(x)
        for i, expert in enumerate(self.experts):
            y[flat_expert_indices == i] = expert(x[flat_expert_indices == i])
        y = (y.view(*expert_weights.shape, -1) * expert_weights.unsqueeze(-1)).sum(dim=1)
        return y.view(*orig_shape)


class FeedForwardCall(nn.Module):
    """The feed-forward half of `MoETorchTransformerBlock`: builds the layer as its `__init__` does and calls
    it through `.forward` as `TorchTransformerBlock.forward` does (the shell adds the norm and residual)."""

    def __init__(self, args: MixtralModelArgs | None = None):
        super().__init__()
        args = args or MixtralModelArgs()
        assert args.moe["num_experts"] % args.num_gpus == 0, "num_experts must be divisible by num_gpus"
        self.feed_forward = MoETorchFFN(
            dim=args.dim,
            hidden_dim=args.hidden_dim,
            num_shards=args.moe["num_experts"] // args.num_gpus,
            **args.moe,
        )

    def forward(self, h):
        return self.feed_forward.forward(h)


def build():
    return tiny(FeedForwardCall, HIDDEN)
