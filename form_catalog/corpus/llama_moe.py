"""LLaMA-MoE's `LinearGLUMoELayer`: noisy top-k MLP gate, softmax over the top-k only, re-batched expert loop.

Mirrors pjlab-sys4nlp/llama-moe `smoe/modules/moe/moe_layers.py` at commit b17aff4 (`BaseMoELayer.forward`,
`LinearGLUMoELayer`), with `smoe/modules/moe/moe_gates.py` (`get_gate_network`,
`TopKBalancedNoisyGate.forward`, `cv_squared`), `smoe/modules/moe/moe_calculators.py`
(`UniversalCalculator.forward`) and `smoe/modules/moe/moe_experts.py` (`LinearGLUExperts.forward`), in the
configuration `smoe/models/llama_moe` builds by default (gate "TopKBalancedNoisyGate" with an "mlp" gate
network, softmax, balance loss and noise on; calculator "UniversalCalculator"; bias-free SiLU GLU experts
that split the dense intermediate size evenly).

The layer flattens tokens to [T, D]. The gate network is Linear(D, E) -> Tanh -> Linear(E, E); in training
it adds softplus-controlled Gaussian noise to the logits (skipped in eval). It takes the top (k+1) logits,
keeps the first k, and applies the softmax to those k logits only (float32), so the weights sum to one
without a separate renormalisation. It scatters the top-k scores into a zero [T, E] matrix to get the
per-expert importance and, in eval, the load `(scores_filtered > 0).sum(0)` (the training branch computes
a differentiable load from the noise CDF), and adds the squared coefficients of variation (each guarded by
`if x.shape[0] == 1`) as the balance loss. The gate returns a dict that is splatted into the calculator,
which flattens ids and scores, builds the token id of every (token, slot) with
`arange(T).repeat_interleave(k)`, sorts the flat ids, reorders scores and token ids by that order, reads
the per-expert counts with `bincount(minlength=E).tolist()`, `index_select`s the tokens in expert order,
`torch.split`s them by the counts and calls the experts in a list comprehension over `range(E)` filtered by
`if split_x[i].shape[0] > 0`; it concatenates the outputs, multiplies by score * score_scale_factor, and
`index_add`s them into zeros. Each expert i is silu(x Wg_i^T) * (x Wu_i^T) @ Wd_i^T with per-expert weights
held in `nn.ParameterList`s.
Left out: the other gates/calculators (uniform, random, Switch with its eval-time Gumbel noise and token
dropping), the optional weight norm, and `transformers`' `ModelOutput` containers (replaced by NamedTuples
with the same fields; the layer's first field is the hidden states).
Constructs: a dict of gate outputs splatted with `**`, `.tolist()` counts fed to `torch.split`, a list
comprehension over `range(E)` skipping empty splits by `.shape[0] > 0`, `if self.training` branches in the
gate, shape-guarded `cv_squared`, sort-based dispatch with `index_select` / `index_add`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("pjlab-sys4nlp/llama-moe", "smoe/modules/moe/moe_layers.py",
                "b17aff436cce58e2fcd7327789c7fadafe15d19e", "BaseMoELayer.forward")
HIDDEN, INTER, EXPERTS, TOP_K = 16, 64, 8, 2  # INTER is the dense size, split into EXPERTS experts of 8


class CalculatorOutput(NamedTuple):
    hidden_states: torch.Tensor | None = None
    num_dropped_tokens: torch.Tensor | None = None


class MoEMlpOutput(NamedTuple):
    hidden_states: torch.Tensor | None = None
    balance_loss: torch.Tensor | None = None
    num_dropped_tokens: torch.Tensor | None = None
    gate_load: torch.Tensor | None = None
    gate_importance: torch.Tensor | None = None


def get_gate_network(gate_type, input_size, num_experts):
    if gate_type.lower() == "linear":
        net = nn.Linear(input_size, num_experts, bias=False)
        nn.init.zeros_(net.weight)
        return net
    return nn.Sequential(nn.Linear(input_size, num_experts, bias=False), nn.Tanh(),
                         nn.Linear(num_experts, num_experts, bias=False))


class TopKBalancedNoisyGate(nn.Module):
    def __init__(self, input_size, num_experts, num_selects, gate_network="mlp", use_softmax=True,
                 use_balance=True, balance_loss_weight=1e-2, add_noise=True, noise_epsilon=1e-2):
        super().__init__()
        self.input_size = input_size
        self.num_experts = num_experts
        self.num_selects = num_selects
        self.gate_network = get_gate_network(gate_network, input_size, num_experts)
        self.use_softmax = use_softmax
        self.softmax = nn.Softmax(1)
        self.use_balance = use_balance
        self.balance_loss_weight = balance_loss_weight
        self.add_noise = add_noise
        self.noise_epsilon = noise_epsilon
        if self.add_noise:
            self.weight_noise = nn.Linear(input_size, num_experts, bias=False)
            nn.init.zeros_(self.weight_noise.weight)
            self.normal = torch.distributions.normal.Normal(0.0, 1.0)
            self.softplus = nn.Softplus()

    def cv_squared(self, x, eps=1e-10):
        if x.shape[0] == 1:
            return torch.tensor(0.0, device=x.device)
        return x.float().var() / (x.float().mean() ** 2 + eps)

    def forward(self, x):
        clean = self.gate_network(x)
        if self.training and self.add_noise:
            noise_scale = self.softplus(self.weight_noise(x)) + self.noise_epsilon
            noise = torch.randn_like(clean) * noise_scale
            logits = clean + noise
        else:
            logits = clean

        top_logits, top_ids = logits.topk(min(self.num_selects + 1, self.num_experts), dim=1)
        k_logits = top_logits[:, : self.num_selects]
        k_ids = top_ids[:, : self.num_selects]
        k_scores = self.softmax(k_logits.to(torch.float32)) if self.use_softmax else k_logits
        k_scores = k_scores.to(logits.dtype)

        blank = torch.zeros_like(logits, requires_grad=True, device=logits.device)
        filtered = blank.scatter(dim=1, index=k_ids, src=k_scores)
        importance = filtered.sum(0)

        if self.training:
            if self.add_noise and self.num_selects != self.num_experts:
                rows, width = top_logits.size(0), top_logits.size(1)
                flat = top_logits.flatten()
                pos_in = torch.arange(rows, device=x.device) * width + self.num_selects
                thr_in = torch.unsqueeze(torch.gather(flat, 0, pos_in), 1)
                is_in = torch.gt(noise, thr_in)
                thr_out = torch.unsqueeze(torch.gather(flat, 0, pos_in - 1), 1)
                p_in = self.normal.cdf((clean - thr_in) / noise_scale)
                p_out = self.normal.cdf((clean - thr_out) / noise_scale)
                load = torch.where(is_in, p_in, p_out).sum(0)
            else:
                load = (filtered > 0).sum(0)
        else:
            load = (filtered > 0).sum(0)

        if self.use_balance:
            balance_loss = self.cv_squared(importance) + self.cv_squared(load)
            balance_loss *= self.balance_loss_weight
        else:
            balance_loss = torch.tensor(-100.0, device=x.device)

        return {"topK_indices": k_ids, "topK_scores": k_scores, "balance_loss": balance_loss, "load": load,
                "importance": importance}


class LinearGLUExperts(nn.Module):
    def __init__(self, in_features, hidden_features, out_features, num_experts, bias=False):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.num_experts = num_experts
        each = hidden_features // num_experts
        self.act_fn = nn.SiLU()
        self.weight_gate = nn.ParameterList(nn.Parameter(torch.empty(each, in_features)) for _ in range(num_experts))
        self.weight_up = nn.ParameterList(nn.Parameter(torch.empty(each, in_features)) for _ in range(num_experts))
        self.weight_down = nn.ParameterList(nn.Parameter(torch.empty(out_features, each))
                                            for _ in range(num_experts))
        self.register_parameter("bias_gate", None)
        self.register_parameter("bias_up", None)
        self.register_parameter("bias_down", None)
        for i in range(num_experts):
            for w in (self.weight_gate[i], self.weight_up[i], self.weight_down[i]):
                nn.init.kaiming_uniform_(w, a=math.sqrt(5))

    def forward(self, input, i):
        g = self.act_fn(F.linear(input, self.weight_gate[i], self.bias_gate[i] if self.bias_gate is not None else None))
        u = F.linear(input, self.weight_up[i], self.bias_up[i] if self.bias_up is not None else None)
        return F.linear(g * u, self.weight_down[i], self.bias_down[i] if self.bias_down is not None else None)


class UniversalCalculator(nn.Module):
    def __init__(self, experts, multiply_gate_scores=True, score_scale_factor=1.0):
        super().__init__()
        self.experts = experts
        self.multiply_gate_scores = multiply_gate_scores
        self.score_scale_factor = score_scale_factor
        self.num_experts = experts.num_experts
        self.mlp_norm = None

    def forward(self, x, topK_indices, topK_scores, expert_batch_size=None, **kwargs):
        tokens = topK_indices.size(0)
        k = topK_indices.size(1)
        flat_ids = topK_indices.flatten()
        flat_scores = topK_scores.flatten()
        owner = torch.arange(tokens, device=flat_scores.device).repeat_interleave(k)

        _, order = flat_ids.sort(0)
        sorted_scores = flat_scores.index_select(0, order)
        sorted_owner = owner.index_select(0, order)

        if expert_batch_size is None:
            expert_batch_size = flat_ids.bincount(minlength=self.num_experts).tolist()

        sorted_x = x.index_select(0, sorted_owner)
        split_x = torch.split(sorted_x, expert_batch_size, dim=0)
        outs = [self.experts(split_x[i], i) for i in range(self.num_experts) if split_x[i].shape[0] > 0]

        joined = torch.cat(outs, 0)
        width = joined.size(1)
        if self.multiply_gate_scores:
            if self.mlp_norm is None:
                joined = torch.mul(joined, sorted_scores.reshape(-1, 1) * self.score_scale_factor)
            else:
                joined = self.mlp_norm(torch.mul(joined, sorted_scores.reshape(-1, 1)))

        base = torch.zeros((tokens, width), device=joined.device, dtype=joined.dtype)
        y = base.index_add(0, sorted_owner, joined)
        return CalculatorOutput(hidden_states=y, num_dropped_tokens=torch.tensor(-1.0))


class LinearGLUMoELayer(nn.Module):
    def __init__(self, input_size, hidden_size, output_size, num_experts, num_selects):
        super().__init__()
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.output_size = output_size
        self.num_experts = num_experts
        self.num_selects = num_selects
        experts = LinearGLUExperts(input_size, hidden_size, output_size, num_experts, bias=False)
        self.gate = TopKBalancedNoisyGate(input_size, num_experts, num_selects)
        self.calculator = UniversalCalculator(experts)

    def forward(self, x):
        lead = x.shape[:-1]
        x = x.reshape(-1, self.input_size)
        gate_outputs = self.gate(x)
        calc = self.calculator(x, **gate_outputs)
        y = calc.hidden_states.reshape(lead + (self.output_size,))
        return MoEMlpOutput(hidden_states=y, balance_loss=gate_outputs.get("balance_loss"),
                            num_dropped_tokens=calc.num_dropped_tokens,
                            gate_load=gate_outputs.get("load", torch.tensor(-1)),
                            gate_importance=gate_outputs.get("importance", torch.tensor(-1)))


def build():
    return tiny(lambda: LinearGLUMoELayer(HIDDEN, INTER, HIDDEN, EXPERTS, TOP_K), HIDDEN)
