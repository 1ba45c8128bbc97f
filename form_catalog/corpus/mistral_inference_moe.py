"""mistral-inference's `MoeLayer` (Mixtral): top-2 of the raw gate logits, a loop over every expert with `torch.where`.

Mirrors mistralai/mistral-inference `src/mistral_inference/moe.py` at commit 2557e12 (`MoeArgs`,
`MoeLayer.__init__`, `MoeLayer.forward`), with `FeedForward` and the MoE wiring of `TransformerBlock.__init__`
/ `TransformerBlock.forward` from `src/mistral_inference/transformer_layers.py` at the same commit.
The transformer block builds the layer from `MoeArgs` as a list of `num_experts` SwiGLU `FeedForward`
experts (w2(silu(w1(x)) * w3(x)), bias-free Linears since `lora` is None) and a bias-free gate Linear, and
calls it as `self.feed_forward.forward(self.ffn_norm(h))` (the bound `forward`, not `__call__`).
`MoeLayer.__init__` asserts the expert list is non-empty and wraps it in an `nn.ModuleList`. The forward
takes `torch.topk` of the raw gate logits (num_experts_per_tok of them), softmaxes the k values in float32
along dim 1 and casts them back to the input dtype, allocates `torch.zeros_like(inputs)`, and loops
`for i, expert in enumerate(self.experts)`: `batch_idx, nth_expert = torch.where(selected_experts == i)`,
then `results[batch_idx] += weights[batch_idx, nth_expert, None] * expert(inputs[batch_idx])` (an indexed
in-place add; no empty-expert skip, so experts nobody chose run on zero rows).
mistral-inference feeds its layers packed tokens [sum(seqlens), dim] (the `softmax(dim=1)` needs 2-D
logits); the outer `PackedTokens` module views the shell's [B, S, H] to that layout and back, and calls
the layer through `.forward` as `TransformerBlock` does.
Left out: nothing of the MoE path is distributed or kernel-backed here; the attention, RMSNorm, rotary and
KV-cache parts of `TransformerBlock` are outside the layer (the corpus shell supplies the residual and
norm), the `LoRALinear` experts (`maybe_lora` returns `nn.Linear` without LoRA args; here it raises
otherwise), and `simple_parsing`'s `Serializable` base of `MoeArgs` (a plain dataclass here: only the two fields are read).
Mixtral 8x7B / 8x22B have 8 experts, top-2 (kept).
Constructs: an `assert` in `__init__`, softmax over the top-k logits only, an `enumerate(self.experts)`
loop with no skip, two-way `torch.where(ids == i)`, integer-index gathers of rows and of (row, slot) weights,
an indexed in-place `+=` (getitem, add, index_put), an explicit `.forward` call on the submodule.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("mistralai/mistral-inference", "src/mistral_inference/moe.py",
                "2557e12d0e1878a1562ece30434820f80aa3e12a", "MoeLayer.forward")
HIDDEN, INTER, EXPERTS, TOP_K = 16, 32, 8, 2


@dataclasses.dataclass
class MoeArgs:
    num_experts: int
    num_experts_per_tok: int


def maybe_lora(lora_args):
    if lora_args is None:
        return nn.Linear
    else:
        raise NotImplementedError("LoRALinear experts")


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim, lora=None):
        super().__init__()
        MaybeLora = maybe_lora(lora)
        self.w1 = MaybeLora(dim, hidden_dim, bias=False)
        self.w2 = MaybeLora(hidden_dim, dim, bias=False)
        self.w3 = MaybeLora(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class MoeLayer(nn.Module):
    def __init__(self, experts, gate, moe_args):
        super().__init__()
        assert len(experts) > 0
        self.experts = nn.ModuleList(experts)
        self.gate = gate
        self.args = moe_args

    def forward(self, inputs):
        gate_logits = self.gate(inputs)
        weights, selected_experts = torch.topk(gate_logits, self.args.num_experts_per_tok)
        weights = F.softmax(weights, dim=1, dtype=torch.float).to(inputs.dtype)
        results = torch.zeros_like(inputs)
        for i, expert in enumerate(self.experts):
            batch_idx, nth_expert = torch.where(selected_experts == i)
            results[batch_idx] += weights[batch_idx, nth_expert, None] * expert(inputs[batch_idx])
        return results


class PackedTokens(nn.Module):
    """[B, S, H] -> mistral-inference's packed [sum(seqlens), H] tokens around the MoE feed-forward, and back."""

    def __init__(self, dim=HIDDEN, hidden_dim=INTER, lora=None, moe=None):
        super().__init__()
        moe = moe or MoeArgs(num_experts=EXPERTS, num_experts_per_tok=TOP_K)
        self.feed_forward: nn.Module
        if moe is not None:
            self.feed_forward = MoeLayer(
                experts=[FeedForward(dim=dim, hidden_dim=hidden_dim, lora=lora) for _ in range(moe.num_experts)],
                gate=nn.Linear(dim, moe.num_experts, bias=False),
                moe_args=moe,
            )
        else:
            self.feed_forward = FeedForward(dim=dim, hidden_dim=hidden_dim, lora=lora)

    def forward(self, x):
        r = self.feed_forward.forward(x.view(-1, x.shape[-1]))
        return r.view(x.shape)


def build():
    return tiny(PackedTokens, HIDDEN)
