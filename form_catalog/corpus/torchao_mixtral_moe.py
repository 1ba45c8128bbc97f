"""torchao's Mixtral MoE feed-forward: stable argsort grouping, bincount/histc offsets, a dynamo-disabled slicer.

Mirrors pytorch/ao `torchao/_models/mixtral-moe/model.py` at commit 709e1da (`ModelArgs` MoE fields,
`MOEFeedForwardAOQuantizable.forward`, `ConditionalFeedForwardAOQuantizable.forward`), the last commit that
changed the file before c4ca58d deleted the whole `_models/mixtral-moe` example (the file's plain
`MOEFeedForward` / `ConditionalFeedForward` there are commented out; the AOQuantizable pair is what its
`TransformerBlock` builds). Taken instead of Skywork-MoE: SkyworkAI/Skywork-MoE holds only READMEs, PDFs
and images in its whole history, no modeling code. The layer flattens [B, S, D] to tokens, scores a
bias-free nn.Linear gate, softmaxes, takes the top-k and renormalises in place (`/=` by the sum cast to the
input dtype), then hands tokens, ids and weights to the conditional FFN, whose experts are stacked
[E, I, D] / [E, D, I] / [E, I, D] parameters (w1, w2, w3). With a single token (and weights that are not
the quantised `FakeExtraDimTensor` wrapper) it gathers the chosen experts' weights and loops over the k
slots running `silu(x w1^T) * (x w3^T)` then w2, and combines by concatenating, weighting, summing and
`unsqueeze(-1)`. Otherwise it builds a Python list of expert ids, stable-argsorts the flat ids, turns the
sorted positions into token rows by float division by k, `floor()` and a cast to int64, counts tokens per
expert with `bincount(ids + 1, minlength=E + 1)` on CPU or `histc(bins=E + 1, min=-1, max=E)` on CUDA
(a leading zero bin), takes the int64 `cumsum`, and inside a nested `@torch._dynamo.disable()` function
slices the sorted token rows per expert by those tensor offsets (a list comprehension); it then gathers
each group's rows, runs every expert (empty groups included: no skip), concatenates the outputs in
expert order, weights them by the flat weights picked through the sorted order and `scatter_add`s
(out-of-place) into a zero buffer on an expanded index. The layer reshapes to [B, -1, D].
Left out: the rest of the file (attention, KV cache, RMSNorm, rope, the Transformer); `ModelArgs`'
non-MoE fields and its intermediate-size rounding (a plain local config class carries the four MoE
fields); `FakeExtraDimTensor` comes from torchao's moe_quant utils and only wraps quantised expert
weights, so a local empty `torch.Tensor` subclass stands in for the `isinstance` test (never true here).
No tensor-parallel pieces exist in this file.
Constructs: a `x.shape[0] == 1` branch with an `isinstance` test on a parameter, a Python loop over the k
slots, an `is_cuda` branch choosing `bincount` or `histc`, a nested function under
`@torch._dynamo.disable()` slicing with tensor-valued bounds in a comprehension, a list comprehension of
gathers and a loop over every expert (no empty-expert skip), in-place `/=` on the top-k weights,
`argsort(stable=True)`, `div().floor().to(int64)` token rows, out-of-place `scatter_add`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._shell import Source, tiny

SOURCE = Source(
    "pytorch/ao",
    "torchao/_models/mixtral-moe/model.py",
    "709e1da30c1347de2c8218195aa2b76b409ac52e",
    "MOEFeedForwardAOQuantizable.forward",
)
HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 8, 2


class ModelArgs:
    def __init__(self, dim=HIDDEN, intermediate_size=INTER, num_experts=EXPERTS, num_activated_experts=TOP_K):
        self.dim, self.intermediate_size = dim, intermediate_size
        self.num_experts, self.num_activated_experts = num_experts, num_activated_experts


class FakeExtraDimTensor(torch.Tensor):
    """Local stand-in for torchao's quantised-weight wrapper: only its type is tested."""


class MOEFeedForwardAOQuantizable(nn.Module):
    def __init__(self, config: ModelArgs | None = None) -> None:
        super().__init__()
        config = config or ModelArgs()
        self.gate = nn.Linear(config.dim, config.num_experts, bias=False)
        self.cond_ffn = ConditionalFeedForwardAOQuantizable(config)
        self.dim = config.dim
        self.num_activated_experts = config.num_activated_experts

    def forward(self, x: Tensor) -> Tensor:
        batch_size = x.shape[0]
        x = x.view(-1, self.dim)
        scores = self.gate(x)
        expert_weights = F.softmax(scores, dim=-1)
        expert_weights, expert_indices = torch.topk(expert_weights, self.num_activated_experts, dim=-1)
        expert_weights /= expert_weights.sum(dim=-1, keepdim=True).to(x.dtype)
        out = self.cond_ffn(x, expert_indices, expert_weights, self.num_activated_experts)
        return out.reshape(batch_size, -1, self.dim)


class ConditionalFeedForwardAOQuantizable(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.config = config
        self.w1 = nn.Parameter(torch.empty(config.num_experts, config.intermediate_size, config.dim))
        self.w2 = nn.Parameter(torch.empty(config.num_experts, config.dim, config.intermediate_size))
        self.w3 = nn.Parameter(torch.empty(config.num_experts, config.intermediate_size, config.dim))
        self.num_experts = config.num_experts

    def forward(self, x: Tensor, expert_indices: Tensor, expert_weights: Tensor, num_activated_experts: int):
        num_tokens, dim = x.shape
        num_token_activations = num_tokens * num_activated_experts
        if x.shape[0] == 1 and not isinstance(self.w1, FakeExtraDimTensor):
            outs = []
            expert_indices = expert_indices.view(num_activated_experts)
            w1 = self.w1[expert_indices]
            w2 = self.w2[expert_indices]
            w3 = self.w3[expert_indices]
            for index in range(num_activated_experts):
                y1 = F.silu(F.linear(x, w1[index]))
                y3 = F.linear(x, w3[index])
                y2 = w2[index]
                outs.append(F.linear(y1 * y3, y2))
            final_out = (torch.cat(outs, dim=0) * expert_weights.view(-1, 1)).sum(dim=0).unsqueeze(-1)
            return final_out
        else:
            expert_list = [e for e in range(self.num_experts)]

            ordered_token_activations = expert_indices.view(-1).argsort(stable=True)
            ordered_token_indices = ordered_token_activations.div(num_activated_experts).floor().to(torch.int64)

            if not expert_indices.is_cuda:
                num_tokens_per_expert = torch.bincount(expert_indices.view(-1) + 1, minlength=self.num_experts + 1)
            else:
                num_tokens_per_expert = torch.histc(
                    expert_indices, bins=self.num_experts + 1, min=-1, max=self.num_experts
                )
            cum_tokens_per_expert = num_tokens_per_expert.cumsum(0).to(torch.int64)

            @torch._dynamo.disable()
            def group_tokens_by_expert(ordered_token_indices, cum_tokens_per_expert, expert_list):
                return [
                    ordered_token_indices[cum_tokens_per_expert[expert] : cum_tokens_per_expert[expert + 1]]
                    for expert in expert_list
                ]

            token_indices_per_expert = group_tokens_by_expert(
                ordered_token_indices, cum_tokens_per_expert, expert_list
            )
            tokens_grouped_by_expert = [x[indices] for indices in token_indices_per_expert]

            outs = []
            for cur_x, expert in zip(tokens_grouped_by_expert, expert_list):  # noqa: B905 - as the original
                w1 = self.w1[expert]
                w2 = self.w2[expert]
                w3 = self.w3[expert]
                outs.append(F.linear(F.silu(F.linear(cur_x, w1)) * F.linear(cur_x, w3), w2))

            ordered_outs = torch.cat(outs, dim=0)
            ordered_token_activation_weights = expert_weights.view(-1, 1)[ordered_token_activations].view(-1, 1)
            weighted_ordered_outs = ordered_outs * ordered_token_activation_weights

            final_out = torch.zeros_like(x)
            final_out = final_out.scatter_add(
                dim=0,
                index=ordered_token_indices.unsqueeze(-1).expand(num_token_activations, dim).to(torch.int64),
                src=weighted_ordered_outs,
            )
        return final_out


def build():
    return tiny(MOEFeedForwardAOQuantizable, HIDDEN)
