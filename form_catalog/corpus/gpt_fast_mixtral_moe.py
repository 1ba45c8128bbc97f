"""gpt-fast's Mixtral `MOEFeedForward`: softmax-then-top-k routing with in-place renormalisation, and a
"conditional" FFN that gathers each token's chosen expert weights and runs them through three einsums.

Mirrors pytorch-labs/gpt-fast `mixtral-moe/model.py` at commit 32971d3 (the repository's newest stored commit;
the file last changed in 48328fb, "transposed w2 to have reduction dim be innermost dim"): the MoE fields of
`ModelArgs` with its `transformer_configs` entries for Mixtral-8x7B-v0.1 and dbrx-base, `ConditionalFeedForward`
(`__init__` / `forward`) and `MOEFeedForward` (`__init__` / `forward`), and the MoE half of
`TransformerBlock.forward` (`h + self.block_sparse_moe(self.ffn_norm(h))`). This is gpt-fast's plain bf16 path,
not the `ConditionalFeedForwardBit8` its `quantize.py` swaps in, and not torchao's later
`MOEFeedForwardAOQuantizable` fork of the same file (the `torchao_mixtral_moe` entry).
`MOEFeedForward.forward` views the input as [T, D] with `x.view(-1, self.dim)`, scores every token with a
bias-free `nn.Linear` gate, takes `F.softmax` over all experts, `torch.topk` of the probabilities (k =
`num_activated_experts`) and divides the kept weights IN PLACE (`/=`) by their sum. `ConditionalFeedForward`
holds the experts as three stacked `nn.Parameter`s, `w1` / `w3` [E, I, D] and `w2` [E, D, I] (reduction dim
innermost), and for the [T, A] expert ids indexes them (`self.w1[expert_indices]`: a per-token, per-slot copy of
the chosen experts' weights, [T, A, I, D]), then `F.silu(einsum('ti,taoi -> tao'))` times
`einsum('ti, taoi -> tao')` and `einsum('tao, taio -> tai')` back to D. Every token computes exactly its k
experts; no token is dropped, nothing is read to the host, there is no loop. The layer returns
`einsum('tai,ta -> ti', expert_outs, expert_weights)`, a [T, D] tensor: `TransformerBlock` adds it to `h` of
shape [B, S, D] by broadcasting only because gpt-fast decodes with batch 1 (here too: the shell's batch is 1, and
its residual add broadcasts the [T, D] output the same way).
Left out: attention, rotary embedding, KV cache, the `ffn_norm` (`RMSNorm`, or a bias-free `LayerNorm` for dbrx;
the shell supplies the pre-MoE norm and adds the residual), weight loading (`convert_hf_checkpoint.py` stacks
the HF experts into w1/w2/w3; the shell draws the weights), tensor parallelism (`tp.py`). Nothing of the MoE
forward was left out.
Sizes: Mixtral-8x7B has dim 4096, intermediate 14336, 8 experts, top-2 (dbrx-base: 6144, 10752, 16, top-4);
here dim 16, intermediate 32, 8 experts, top-2, one layer.
Constructs: `view(-1, dim)` flattening, a bias-free Linear gate, full softmax then `topk`, in-place `/=`
renormalisation of the topk values, stacked 3-D expert parameters indexed by a [T, A] index tensor (advanced-index
weight gather), three einsums with a SiLU-gated product, an einsum weighted combine, a [T, D] return broadcast
against the [B, S, D] residual.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._shell import Source, tiny

SOURCE = Source("pytorch-labs/gpt-fast", "mixtral-moe/model.py", "32971d3129541c5bfb4f715abc33d1c5f408d204",
                "MOEFeedForward.forward")
HIDDEN, INTER, EXPERTS, TOP_K = 16, 32, 8, 2


@dataclass
class ModelArgs:
    """The fields of gpt-fast's `ModelArgs` that the MoE layer reads (Mixtral's expert counts, sizes tiny)."""

    dim: int = HIDDEN
    intermediate_size: int = INTER
    num_experts: int = EXPERTS
    num_activated_experts: int = TOP_K


class ConditionalFeedForward(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(config.num_experts, config.intermediate_size, config.dim))
        self.w2 = nn.Parameter(torch.empty(config.num_experts, config.dim, config.intermediate_size))
        self.w3 = nn.Parameter(torch.empty(config.num_experts, config.intermediate_size, config.dim))

    def forward(self, x: Tensor, expert_indices: Tensor) -> Tensor:
        # each token's chosen experts, copied out of the stacks: [T, A, I, D] and [T, A, D, I]
        w1_weights = self.w1[expert_indices]
        w3_weights = self.w3[expert_indices]
        w2_weights = self.w2[expert_indices]
        x1 = F.silu(torch.einsum('ti,taoi -> tao', x, w1_weights))
        x3 = torch.einsum('ti, taoi -> tao', x, w3_weights)
        expert_outs = torch.einsum('tao, taio -> tai', (x1 * x3), w2_weights)
        return expert_outs


class MOEFeedForward(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.gate = nn.Linear(config.dim, config.num_experts, bias=False)
        self.cond_ffn = ConditionalFeedForward(config)
        self.dim = config.dim
        self.num_activated_experts = config.num_activated_experts

    def forward(self, x: Tensor) -> Tensor:
        x = x.view(-1, self.dim)
        # T tokens, E experts, D hidden, A activated experts per token
        scores = self.gate(x)  # [T, E]
        expert_weights = F.softmax(scores, dim=-1)
        expert_weights, expert_indices = torch.topk(expert_weights, self.num_activated_experts, dim=-1)  # [T, A]
        expert_weights /= expert_weights.sum(dim=-1, keepdim=True)
        expert_outs = self.cond_ffn(x, expert_indices)
        return torch.einsum('tai,ta -> ti', expert_outs, expert_weights)


def build():
    return tiny(lambda: MOEFeedForward(ModelArgs()), HIDDEN)
