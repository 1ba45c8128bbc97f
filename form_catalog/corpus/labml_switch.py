"""labml.ai's annotated `SwitchFeedForward`: top-1 switch routing, per-expert `nonzero` index lists, index stores.

Mirrors labmlai/annotated_deep_learning_paper_implementations `labml_nn/transformers/switch/__init__.py` at
commit e6b3c8a (`SwitchFeedForward.forward`), with the expert from `labml_nn/transformers/feed_forward.py`
(`FeedForward`) in the repository's SwiGLU variant (`labml_nn/transformers/configs.py`: `is_gated=True`, SiLU,
no biases) and the experiment's settings (`switch/experiment.py`: 4 experts, capacity factor 1.0,
`drop_tokens=False`, `is_scale_prob=True`). The experts are `copy.deepcopy` clones of one FeedForward in an
nn.ModuleList (`clone_module_list`). The layer flattens its [seq, batch, d_model] input, softmaxes a biased
linear router, takes `torch.max` over the experts (the max probability and the route), and builds one index
list per expert with a Python list comprehension of `torch.eq(routes, i).nonzero(as_tuple=True)[0]`. It
zero-initialises the output with `x.new_zeros`, computes a capacity int(capacity_factor * len(x) / n_experts)
and the per-expert counts with `x.new_tensor([len(...) ...])` (host reads of every list's length). Only when
`drop_tokens` is set does it loop over the experts, skip those within capacity (`len(...) <= capacity`), shuffle
the others with `randperm` and cut them to the capacity, collecting the overflow; that branch is kept and not
taken here. It runs every expert on `x[indexes, :]` (a list comprehension over `range(n_experts)`, empty
experts included), stores each result with `final_output[indexes, :] = expert_output` in a second loop, copies
dropped tokens through unchanged (`if dropped:`, not taken), multiplies the output by the max probability
(`is_scale_prob`; otherwise by p / p.detach()), reshapes back and returns the output with the counts, the
summed route probabilities, the dropped count and the max probabilities. Left out: nothing of the forward
(the FFN's dropout is 0.0 in the experiment and the identity in eval); the load-balancing loss sits in the
training loop; 128 / 256 widths become 16 / 8.
Constructs: `nonzero(as_tuple=True)` index lists built by list comprehensions, `len()` of data-dependent
tensors into `new_tensor` and a capacity comparison, a `drop_tokens` branch (off) with `randperm`, index
stores `final_output[idx, :] = y` in a Python loop, an `if dropped:` test on a Python list, the router's max
probability applied after the stores, and a tuple output.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("labmlai/annotated_deep_learning_paper_implementations", "labml_nn/transformers/switch/__init__.py",
                "e6b3c8a6a2cdae4071bcde1abeaaf9a2bc37bd53", "SwitchFeedForward.forward")
HIDDEN, INTER, EXPERTS, CAPACITY_FACTOR, DROPOUT = 16, 8, 4, 1.0, 0.0


class FeedForward(nn.Module):
    """layer2(dropout(f(layer1(x)) * linear_v(x))) when gated, layer2(dropout(f(layer1(x)))) otherwise."""

    def __init__(self, d_model, d_ff, dropout=0.1, activation=None, is_gated=False, bias1=True, bias2=True,
                 bias_gate=True):
        super().__init__()
        self.layer1 = nn.Linear(d_model, d_ff, bias=bias1)
        self.layer2 = nn.Linear(d_ff, d_model, bias=bias2)
        self.dropout = nn.Dropout(dropout)
        self.activation = activation if activation is not None else nn.ReLU()
        self.is_gated = is_gated
        if is_gated:
            self.linear_v = nn.Linear(d_model, d_ff, bias=bias_gate)

    def forward(self, x):
        g = self.activation(self.layer1(x))
        h = g * self.linear_v(x) if self.is_gated else g
        return self.layer2(self.dropout(h))


def clone_module_list(module, n):
    return nn.ModuleList([copy.deepcopy(module) for _ in range(n)])


class SwitchFeedForward(nn.Module):
    def __init__(self, *, capacity_factor, drop_tokens, is_scale_prob, n_experts, expert, d_model):
        super().__init__()
        self.capacity_factor = capacity_factor
        self.is_scale_prob = is_scale_prob
        self.n_experts = n_experts
        self.drop_tokens = drop_tokens
        self.experts = clone_module_list(expert, n_experts)
        self.switch = nn.Linear(d_model, n_experts)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x):
        seq_len, batch_size, d_model = x.shape
        x = x.view(-1, d_model)
        route_prob = self.softmax(self.switch(x))
        route_prob_max, routes = torch.max(route_prob, dim=-1)

        indexes_list = [torch.eq(routes, i).nonzero(as_tuple=True)[0] for i in range(self.n_experts)]
        final_output = x.new_zeros(x.shape)
        capacity = int(self.capacity_factor * len(x) / self.n_experts)
        counts = x.new_tensor([len(indexes_list[i]) for i in range(self.n_experts)])

        dropped = []
        if self.drop_tokens:
            for i in range(self.n_experts):
                if len(indexes_list[i]) <= capacity:
                    continue
                indexes_list[i] = indexes_list[i][torch.randperm(len(indexes_list[i]))]
                dropped.append(indexes_list[i][capacity:])
                indexes_list[i] = indexes_list[i][:capacity]

        expert_output = [self.experts[i](x[indexes_list[i], :]) for i in range(self.n_experts)]
        for i in range(self.n_experts):
            final_output[indexes_list[i], :] = expert_output[i]

        if dropped:
            dropped = torch.cat(dropped)
            final_output[dropped, :] = x[dropped, :]

        if self.is_scale_prob:
            final_output = final_output * route_prob_max.view(-1, 1)
        else:
            final_output = final_output * (route_prob_max / route_prob_max.detach()).view(-1, 1)

        final_output = final_output.view(seq_len, batch_size, d_model)
        return final_output, counts, route_prob.sum(0), len(dropped), route_prob_max


def make_layer():
    expert = FeedForward(HIDDEN, INTER, DROPOUT, activation=nn.SiLU(), is_gated=True, bias1=False, bias2=False,
                         bias_gate=False)
    return SwitchFeedForward(capacity_factor=CAPACITY_FACTOR, drop_tokens=False, is_scale_prob=True,
                             n_experts=EXPERTS, expert=expert, d_model=HIDDEN)


def build():
    return tiny(make_layer, HIDDEN)
