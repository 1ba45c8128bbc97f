"""Zyphra BlackMamba's SwitchMLP: top-1 switch routing, per-expert `nonzero()` [n, 1] index gathers and stores.

Mirrors Zyphra/BlackMamba `switch_mlp.py` at commit 5c8cddd (`sinkhorn`, `SwitchMLP`), with the expert from
`mlp.py` (`MLP`) and the fields it reads from `mamba_config.py` (`MambaConfig`), the only file that ever held
the layer (one commit). In the model the layer is the mixer of every `MoEBlock` ("8" entries of
`mamba_moe_layers`, alternating with Mamba "r" layers); `MambaModel.from_pretrained` builds the config with
`gated_linear_unit` from the checkpoint's `swiglu` and `add_bias_linear` from its own field and leaves
`routing_mode` ("sinkhorn") and `activation_func` (`F.gelu`) at their defaults. The released checkpoints
have a gated first projection ([gate | up] rows) and no expert biases; the router is an nn.Linear with its
default bias. So here: `gated_linear_unit=True`, `add_bias_linear=False`, gelu. The layer reads its expert
count from the last character of its `mamba_moe_layers` entry (`layer_idx - 1`, 1-based). The forward applies
the biased router to the [B, S, H] input and views the logits as [T, E]; under "sinkhorn" it takes a sigmoid
(`router_activation`; the `sinkhorn` function is stored as `route_algo` but never called in the forward),
otherwise a softmax over the experts, and in both cases `torch.max` over dim 1 gives the top-1 probability
and expert. The probability is unsqueezed to [T, 1], tokens are flattened to [T, H], and a `zeros_like`
buffer is made. A Python loop over the experts maps each through `local_expert_indices` (the identity on
one process), builds `(indices == e).nonzero()` (shape [n, 1], no as_tuple), gathers `x[idx, :]` as
[n, 1, H], runs the expert on it with no empty-expert skip (empty experts run on [0, 1, H]) and stores the
result with `out[idx, :] = y`. The expert is fc1 (H -> 2F), a closure `glu` defined in `__init__` that
`torch.chunk`s the last axis in two and returns gelu(first) * second, then fc2 (F -> H). After the loop the
whole buffer is multiplied by the top-1 probability and viewed back to the input shape; the layer returns
that one tensor.
Left out: the unused imports (`pickle`, `os`), `MambaConfig`'s other fields and `__post_init__` (init-method
factories from `utils.py`; a plain local class carries the fields read); `device="cuda"` on the expert
Linears becomes "cpu"; the expert parallelism is already in its one-process form in the source
(`num_local_experts == num_moe_experts`, `gather_indices` returns its argument, kept). The routing only
does top-1 (no "top2" branch exists despite the comment naming it); real sizes 1472 / 3872, 8 experts.
Constructs: a string-valued `routing_mode` branch read in forward, `torch.max` top-1, a Python loop over
`enumerate(self.local_experts)` through a Python index list, `nonzero()` [n, 1] indices used for a 3-D gather
and an index store `out[idx, :] = y`, experts run on empty inputs, a closure activation stored on the module,
`torch.chunk`, the probability applied once after the loop, and a config string parsed with `int(...[-1])`.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("Zyphra/BlackMamba", "switch_mlp.py", "5c8cddddb07890f1b97994ff913452d9626a71a9",
                "SwitchMLP.forward")
HIDDEN, INTER, EXPERTS, LAYER = 16, 8, 8, 2


class MambaConfig:
    def __init__(self, hidden_size=HIDDEN, ffn_hidden_size=INTER, gated_linear_unit=True, add_bias_linear=False,
                 activation_func=F.gelu, mamba_moe_layers=("r", str(EXPERTS)), num_moe_experts=None,
                 routing_mode="sinkhorn", device="cpu"):
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.gated_linear_unit, self.add_bias_linear = gated_linear_unit, add_bias_linear
        self.activation_func, self.mamba_moe_layers = activation_func, list(mamba_moe_layers)
        self.num_moe_experts, self.routing_mode, self.device = num_moe_experts, routing_mode, device


def sinkhorn(cost, tol=0.0001):
    cost = torch.exp(2.0 * cost)
    d0 = torch.ones(cost.size(0), device=cost.device, dtype=cost.dtype)
    d1 = 1 / (cost.size(1) * torch.sum(cost, 0))
    eps = 0.00000001
    error = 1e9
    d1_old = d1
    while error > tol:
        d0 = (1 / d0.size(0)) * 1 / (torch.sum(d1 * cost, 1) + eps)
        d1 = (1 / d1.size(0)) * 1 / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(d1_old - d1))
        d1_old = d1
    return d1 * cost * d0.unsqueeze(1)


class MLP(nn.Module):
    def __init__(self, config: MambaConfig, is_expert: bool = False, layer_idx=None):
        super().__init__()
        self.config = config
        self.layer = layer_idx
        fc1_width = config.ffn_hidden_size
        fc2_width = config.ffn_hidden_size
        if config.gated_linear_unit:
            fc1_width *= 2
        self.linear_fc1 = nn.Linear(config.hidden_size, fc1_width, bias=config.add_bias_linear, device=config.device)
        self.linear_fc1.is_expert = is_expert

        if config.gated_linear_unit:

            def glu(x):
                x = torch.chunk(x, 2, dim=-1)
                return self.config.activation_func(x[0]) * x[1]

            self.activation_func = glu
        else:
            self.activation_func = config.activation_func

        self.linear_fc2 = nn.Linear(fc2_width, config.hidden_size, bias=config.add_bias_linear, device=config.device)

    def forward(self, hidden_states, inference_params=None):
        intermediate = self.linear_fc1(hidden_states)
        intermediate = self.activation_func(intermediate)
        return self.linear_fc2(intermediate)


class SwitchMLP(nn.Module):
    def __init__(self, config: MambaConfig | None = None, layer_idx=None):
        super().__init__()
        config = config or MambaConfig()
        self.layer = layer_idx
        self.config = config
        if config.mamba_moe_layers:
            self.num_moe_experts = int(config.mamba_moe_layers[layer_idx - 1][-1])
        else:
            self.num_moe_experts = self.config.num_moe_experts
        self.router = nn.Linear(self.config.hidden_size, self.num_moe_experts)
        self.add_bias = config.add_bias_linear
        self.routing = config.routing_mode
        self.route_algo = sinkhorn
        self.router_activation = torch.sigmoid

        self.num_local_experts = self.num_moe_experts
        self.local_expert_indices = [i for i in range(self.num_local_experts)]
        self.local_experts = nn.ModuleList()
        for _ in range(self.num_local_experts):
            self.local_experts.append(MLP(self.config, is_expert=True, layer_idx=layer_idx))

    def gather_indices(self, local_indices):
        return local_indices

    def forward(self, hidden_states, inference_params=None):
        hidden_shape = hidden_states.shape
        route = self.router(hidden_states)
        route = route.view(-1, self.num_moe_experts)

        if self.routing == "sinkhorn":
            route = self.router_activation(route)
            max_prob, max_ind = torch.max(route, dim=1)
        else:
            route = torch.softmax(route, dim=1)
            max_prob, max_ind = torch.max(route, dim=1)

        max_prob = torch.unsqueeze(max_prob, 1)
        hidden_states = hidden_states.view(-1, hidden_shape[-1])

        global_hidden_states = hidden_states
        global_indices = max_ind
        output_total = torch.zeros_like(global_hidden_states)

        for expert_num, expert in enumerate(self.local_experts):
            local_expert_index = self.local_expert_indices[expert_num]
            local_indices = (global_indices == local_expert_index).nonzero()
            hidden = global_hidden_states[local_indices, :]
            output = expert(hidden)
            output_total[local_indices, :] = output

        output_total = output_total * max_prob
        return output_total.view(hidden_shape)


def build():
    return tiny(partial(SwitchMLP, layer_idx=LAYER), HIDDEN)
