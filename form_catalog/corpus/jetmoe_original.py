"""JetMoE's original `MoE`: a TorchScript sort-based gating helper, `.tolist()` sizes and split-loop experts.

Mirrors myshell-ai/JetMoE `jetmoe/utils/moe.py` at commit 235392e (`MoE.forward`, `MoE.batch_forward`,
`MoE.single_forward`, `MoE.compute_gate`), with `jetmoe/utils/gate.py` (`top_k_gating`) and
`jetmoe/utils/parallel_experts.py` (`compute_gating`, `ParallelExperts`), as `modeling_jetmoe.py` builds
the MLP: GLU experts, SiLU, an output bias. The gate is a bias-free linear computed in float32; it takes
the top-k logits and softmaxes over them only; in training it also computes a switch + z aux loss into
`self.loss`, in eval it sets `self.loss = 0`. The layer's forward picks `single_forward` when the batch
holds one token (loops over the k choices, indexing the stacked weights with a 0-d index tensor) and
otherwise `batch_forward`: `compute_gating`, decorated `@torch.jit.script`, sorts the flattened choices,
derives each slot's token (`div(k, rounding_mode="trunc")`), its gate and the per-expert counts (from a
scattered one-hot); the counts are read on the host with `.tolist()` and kept, with the sorted gates and
indices, as attributes of the module. The tokens are gathered in expert order, `ParallelExperts` splits
them by those counts and loops `for i in range(E)` over `F.linear(chunk, weight[i])` (weights [E, out, in],
the input projection producing 2 * intermediate, chunked into activation and gate halves), the outputs are
scaled by their gates and `index_add`ed back per token, and the bias is added. Left out: nothing of the
forward (the `map`/`reduce` methods serve JetMoE's attention experts, not the MLP).
Constructs: `@torch.jit.script` helper, `.tolist()` expert sizes, `split` by host sizes with a Python loop
over all experts (empty chunks included), a token-count branch (`bsz * length == 1`), `if self.training`
in the gate, state stored on the module during forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("myshell-ai/JetMoE", "jetmoe/utils/moe.py", "235392e936df2fd70e6adcd019c58fe8a980fb04",
                "MoE.forward")
HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 8, 2


@torch.jit.script
def compute_gating(k: int, num_experts: int, top_k_gates: torch.Tensor, top_k_indices: torch.Tensor):
    onehot = torch.zeros([top_k_gates.size(0), num_experts], dtype=top_k_gates.dtype, device=top_k_gates.device)
    onehot = onehot.scatter(1, top_k_indices, 1)
    expert_size = onehot.long().sum(0)
    flat_gates = top_k_gates.flatten()
    _, order = top_k_indices.flatten().sort(0)
    batch_index = order.div(k, rounding_mode="trunc")
    return flat_gates[order], batch_index, expert_size, order


class ParallelExperts(nn.Module):
    def __init__(self, num_experts, input_size, output_size):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, output_size, input_size))
        self.num_experts, self.input_size, self.output_size = num_experts, input_size, output_size

    def forward(self, inputs, expert_size):
        chunks = inputs.split(expert_size, dim=0)
        outs = []
        for i in range(self.num_experts):
            outs.append(F.linear(chunks[i], self.weight[i]))
        return torch.cat(outs, dim=0)


class top_k_gating(nn.Module):  # noqa: N801 - the original's class name
    def __init__(self, input_size, num_experts, top_k):
        super().__init__()
        self.num_experts, self.input_size, self.top_k = num_experts, input_size, top_k
        self.layer = nn.Linear(input_size, num_experts, bias=False)

    def compute_aux_loss(self, probs, logits, gates):
        count = logits.size(0)
        prob_mass = probs.sum(0)
        freq = (gates > 0).float().sum(0)
        lse_sq = (torch.log(torch.exp(logits).sum(dim=-1)) ** 2).sum()
        switch = self.num_experts * (F.normalize(prob_mass, p=1, dim=0) * F.normalize(freq, p=1, dim=0)).sum()
        return switch + 0.1 * (lse_sq / count)

    def forward(self, x):
        logits = self.layer(x).float()
        best, chosen = logits.topk(self.top_k, dim=1)
        gates = torch.softmax(best, dim=1).type_as(x)
        if self.training:
            probs = torch.softmax(logits, dim=1)
            dense = torch.zeros_like(probs).to(gates.dtype).scatter(1, chosen, gates)
            self.loss = self.compute_aux_loss(probs, logits, dense)
        else:
            self.loss = 0
        return chosen, gates


class MoE(nn.Module):
    def __init__(self, input_size=HIDDEN, hidden_size=INTER, num_experts=EXPERTS, top_k=TOP_K, bias=True,
                 activation=None, glu=True):
        super().__init__()
        self.num_experts, self.input_size, self.hidden_size, self.glu = num_experts, input_size, hidden_size, glu
        self.bias = nn.Parameter(torch.zeros(input_size)) if bias else None
        self.input_linear = ParallelExperts(num_experts, input_size, hidden_size * 2 if glu else hidden_size)
        self.output_linear = ParallelExperts(num_experts, hidden_size, input_size)
        self.top_k = min(top_k, num_experts)
        self.activation = activation if activation is not None else nn.SiLU()
        self.router = top_k_gating(input_size=input_size, num_experts=num_experts, top_k=top_k)

    def compute_gate(self, x):
        chosen, self.top_k_gates = self.router(x)
        self.batch_gates, self.batch_index, sizes, self.index_sorted_experts = compute_gating(
            self.top_k, self.num_experts, self.top_k_gates, chosen)
        self.expert_size = sizes.tolist()
        return self.router.loss

    def batch_forward(self, x):
        bsz, length, emb = x.size()
        x = x.reshape(-1, emb)
        loss = self.compute_gate(x)
        h = self.input_linear(x[self.batch_index], self.expert_size)
        if self.glu:
            h, g = h.chunk(2, dim=-1)
            h = self.activation(h) * g
        else:
            h = self.activation(h)
        out = self.output_linear(h, self.expert_size) * self.batch_gates[:, None]
        y = torch.zeros((bsz * length, self.input_size), dtype=out.dtype, device=out.device)
        y = y.index_add(0, self.batch_index, out).view(bsz, length, self.input_size)
        if self.bias is not None:
            y = y + self.bias
        return y, loss

    def single_forward(self, x):
        bsz, length, _ = x.size()
        x = x.reshape(1, self.input_size)
        chosen, gates = self.router(x)
        loss = self.router.loss
        parts = []
        for i in range(self.top_k):
            e = chosen[0, i]
            h = F.linear(x, self.input_linear.weight[e])
            if self.glu:
                h, g = h.chunk(2, dim=-1)
                h = self.activation(h) * g
            else:
                h = self.activation(h)
            parts.append(F.linear(h, self.output_linear.weight[e]) * gates[0, i])
        y = sum(parts).view(bsz, length, self.input_size)
        if self.bias is not None:
            y = y + self.bias
        return y, loss

    def forward(self, x):
        bsz, length, _ = x.size()
        if bsz * length == 1:
            return self.single_forward(x)
        return self.batch_forward(x)


def build():
    return tiny(MoE, HIDDEN)
