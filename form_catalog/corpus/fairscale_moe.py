"""fairscale's `MOELayer` + `Top2Gate` (GShard): capacity-bounded top-2 with a Gumbel-noised second choice, einsum dispatch.

Mirrors facebookresearch/fairscale `fairscale/nn/moe/moe_layer.py` at commit 146f160 (`_AllToAll`,
`MOELayer.__init__`, `MOELayer.forward`) with `fairscale/nn/moe/top2gate.py` at the same commit (`gumbel_map`,
`gumbel_rsample`, `one_hot`, `top2gating`, `Top2Gate`), and the MoE wiring of `benchmarks/models/transformer_lm.py`
(the repo's own user: `FeedForwardLayer` experts and the `is_moe` branch of `TransformerEncoderLayer.__init__` /
`_ff_block`).
`MOELayer.forward(*input)` asserts one 3-D input whose first dim divides by the local expert count, flattens it
to [S, M] tokens and calls the gate, storing the aux loss on the module (`self.l_aux, combine_weights,
dispatch_mask = self.gate(...)`). `Top2Gate` is a bias-free Linear `wg` and `top2gating(logits)`: a float32
softmax, capacity `2 * S // E` (asserting S % E == 0), the first expert by `argmax` one-hot (fairscale's own
`one_hot`: `zeros(...)` + `scatter_`), the second by `argmax` of the logits plus Gumbel noise (drawn in every
call, eval included, through `torch.distributions.Gumbel(0, 1).rsample` cached per device in the module-level dict
`gumbel_map`) with the first choice `masked_fill`ed to -inf; slot positions by `cumsum(mask) - 1`, the second's
offset by the first's per-expert totals; `l_aux = mean(me * ce)`; masks zeroed in place past capacity
(`mask *= torch.lt(locations, capacity)`), per-token slots `sum(locations * mask, dim=1)`, the two gate
probabilities gathered by `(gates * mask).sum(1)`, renormalised by their clamped sum (in-place `/=`), and
`combine_weights` [S, E, C] built as outer products of gates and one-hot slots; `dispatch_mask =
combine_weights.bool()`. The layer dispatches with `einsum("sec,sm->ecm", dispatch_mask.float(), x)`, passes
the [E, C, M] buffer through `_AllToAll.apply` (a `torch.autograd.Function`), reshapes to
[world_size, num_local_experts, C, M], `chunk`s it per local expert and runs
`for chunk, expert in zip(chunks, self.experts)` (every expert on its whole [W, 1, C, M] capacity buffer,
empty slots included), `torch.cat`s along dim 1, all-to-alls back, reshapes to [E, C, M] and combines with
`einsum("sec,ecm->sm", combine_weights, expert_output)`, reshaped back to the input's shape.
Single process: upstream uses `torch.distributed` (`dist.group.WORLD`, `dist.get_world_size`,
`dist.all_to_all_single`), which needs an initialised process group. Here `dist` is a local stand-in that does
what a world size of 1 does: `group.WORLD` is None, `get_world_size` returns 1, `is_initialized` returns False,
and `all_to_all_single(output, input)` copies `input` into `output` (the one rank sends its only split to
itself). `_AllToAll` is kept as the upstream autograd Function around it.
The benchmark's `TransformerEncoderLayer` (is_moe) builds `Top2Gate(d_model, num_local_experts * world_size)`,
a `ModuleList` of `FeedForwardLayer(d_model, dim_feedforward, nn.ReLU(), dropout)` experts
(`dropout2(linear2(dropout1(activation(linear1(x)))))`, Linears with bias) and `MOELayer(self.gate, experts)`, and
its `_ff_block` calls `self.moe_layer(x)`; `MoEFFBlock` mirrors that and takes the shell's [B, S, H] as the
layer's 3-D input (B divisible by the expert count: `build` uses batch 4 with 4 experts, so 28 tokens,
capacity 14).
Left out: multi-rank expert parallelism (the real all-to-all, process groups; see the stand-in above), the
`p.expert = True` tagging is kept but nothing reads it here; the benchmark's attention, LayerNorms and
residuals (the shell supplies a norm and the residual), DDP and the training loop. The `TYPE_CHECKING` base
alias is reduced to `nn.Module`.
Sizes: the benchmark's MOE config has d_model 1024, d_ff 4096, 2 local experts per GPU (E = 2 x world size),
top-2; here d_model 16, d_ff 32, 4 experts on one rank.
Constructs: a module attribute written in forward (`self.l_aux`), `*input` varargs with `assert`s on shapes,
Python-int capacity from the token count, a module-level dict cache of a `torch.distributions` bound method
(random Gumbel noise drawn in forward), `argmax`, a custom one-hot via `zeros` + `scatter_`, `masked_fill(-inf)`,
`cumsum` slot positions, in-place `*=` of int64 masks by bool `lt`, in-place `/=`, `clamp` by `finfo.eps`,
[S, E, C] dense combine/dispatch tensors, `einsum` dispatch and combine, a `torch.autograd.Function` (`.apply`)
for the all-to-all, reshape to [W, E_local, C, M], `chunk` + `zip` loop over experts with list `+=` and
`torch.cat`, no top-k op and no index-based gather/scatter of tokens.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn import Module, ModuleList

from ._shell import Source, tiny

SOURCE = Source("facebookresearch/fairscale", "fairscale/nn/moe/moe_layer.py",
                "146f160241651e1211c4247979f159a4ef43b54a", "MOELayer.forward")
HIDDEN, INTER, EXPERTS = 16, 32, 4


class _SingleProcessGroup:
    WORLD = None


class _SingleProcessDist:
    """What `torch.distributed` does for this layer with one rank, without a process group."""

    group = _SingleProcessGroup

    @staticmethod
    def is_initialized():
        return False

    @staticmethod
    def get_world_size(group=None):
        return 1

    @staticmethod
    def all_to_all_single(output, input, group=None):
        output.copy_(input)  # one rank: its only split goes to itself


dist = _SingleProcessDist


# ---- fairscale/nn/moe/top2gate.py ----

gumbel_map: dict[torch.device, Any] = {}


def gumbel_rsample(shape, device):
    gumbel = gumbel_map.get(device)
    if gumbel is None:
        one = torch.tensor(1.0, device=device)
        zero = torch.tensor(0.0, device=device)
        gumbel = torch.distributions.gumbel.Gumbel(zero, one).rsample
        gumbel_map[device] = gumbel
    return gumbel(shape)


def one_hot(tensor, num_classes):
    """Workaround for https://github.com/pytorch/pytorch/issues/55579"""
    assert num_classes > 0, "num_classes must be a positive integer"
    ret = torch.zeros(tensor.shape + (num_classes,), device=tensor.device, dtype=tensor.dtype)
    ret.scatter_(-1, tensor.unsqueeze(-1), 1)
    return ret


def top2gating(logits):
    """Implements Top2Gating on logits."""
    gates = F.softmax(logits, dim=1, dtype=torch.float)

    # gates has shape of SE
    num_tokens = gates.shape[0]
    num_experts = gates.shape[1]
    # capacity = 2S/E
    capacity = 2 * num_tokens // num_experts
    assert num_tokens % num_experts == 0

    # first expert per token
    indices1_s = torch.argmax(gates, dim=1)
    mask1 = one_hot(indices1_s, num_classes=num_experts)

    # second expert per token, Gumbel-max trick
    logits_w_noise = logits + gumbel_rsample(logits.shape, device=logits.device)
    logits_except1 = logits_w_noise.masked_fill(mask1.bool(), float("-inf"))
    indices2_s = torch.argmax(logits_except1, dim=1)
    mask2 = one_hot(indices2_s, num_classes=num_experts)

    # locations in the capacity buffer
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1
    locations2 += torch.sum(mask1, dim=0, keepdim=True)

    # l_aux
    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask1.float(), dim=0)
    l_aux = torch.mean(me * ce)

    # drop what is past capacity
    mask1 *= torch.lt(locations1, capacity)
    mask2 *= torch.lt(locations2, capacity)

    locations1_s = torch.sum(locations1 * mask1, dim=1)
    locations2_s = torch.sum(locations2 * mask2, dim=1)

    # normalise the two gate probabilities
    gates1_s = (gates * mask1).sum(dim=1)
    gates2_s = (gates * mask2).sum(dim=1)
    denom_s = gates1_s + gates2_s
    denom_s = torch.clamp(denom_s, min=torch.finfo(denom_s.dtype).eps)
    gates1_s /= denom_s
    gates2_s /= denom_s

    # combine_weights and dispatch_mask
    gates1 = gates1_s.unsqueeze(-1) * mask1
    gates2 = gates2_s.unsqueeze(-1) * mask2
    locations1_sc = one_hot(locations1_s, num_classes=capacity)
    locations2_sc = one_hot(locations2_s, num_classes=capacity)
    combine1_sec = gates1.unsqueeze(2) * locations1_sc.unsqueeze(1)
    combine2_sec = gates2.unsqueeze(2) * locations2_sc.unsqueeze(1)
    combine_weights = combine1_sec + combine2_sec
    dispatch_mask = combine_weights.bool()

    return l_aux.to(logits.dtype), combine_weights.to(logits.dtype), dispatch_mask


class Top2Gate(torch.nn.Module):
    wg: torch.nn.Linear

    def __init__(self, model_dim: int, num_experts: int) -> None:
        super().__init__()
        self.wg = torch.nn.Linear(model_dim, num_experts, bias=False)

    def forward(self, input):
        logits = self.wg(input)
        return top2gating(logits)


# ---- fairscale/nn/moe/moe_layer.py ----

class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, input):
        ctx.group = group
        input = input.contiguous()
        output = torch.empty_like(input)
        dist.all_to_all_single(output, input, group=group)
        return output

    @staticmethod
    def backward(ctx, *grad_output):
        return (None, _AllToAll.apply(ctx.group, *grad_output))


class MOELayer(Module):
    def __init__(self, gate: Module, experts: Module | ModuleList, group: Any = None) -> None:
        super().__init__()
        self.gate = gate
        if type(experts) == ModuleList:  # noqa: E721 - as upstream
            self.experts = cast(ModuleList, experts)
        else:
            self.experts = ModuleList([experts])
        self.group = group if group is not None else dist.group.WORLD
        for _expert in self.experts:
            for p in experts.parameters():
                p.expert = True
        self.world_size = dist.get_world_size(self.group)
        self.num_local_experts = len(self.experts)

    def forward(self, *input: Tensor, **kwargs: Any) -> Tensor:
        assert len(input) == 1, "only single input Tensor supported"
        assert len(input[0].shape) == 3, "input Tensor must have dimensions: (s)equence, (t)oken, (m)odel"
        assert input[0].shape[0] % len(self.experts) == 0, "num tokens must be order of number of local experts"

        # Algorithm 2 of the GShard paper
        d_model = input[0].shape[2]
        reshaped_input = input[0].reshape(-1, d_model)
        self.l_aux, combine_weights, dispatch_mask = self.gate(reshaped_input)
        dispatched_input = torch.einsum("sec,sm->ecm", dispatch_mask.float(), reshaped_input)
        dispatched_input = _AllToAll.apply(self.group, dispatched_input)
        # ecm -> gecm
        dispatched_input = dispatched_input.reshape(self.world_size, self.num_local_experts, -1, d_model)
        chunks = dispatched_input.chunk(self.num_local_experts, dim=1)
        expert_outputs = []
        for chunk, expert in zip(chunks, self.experts, strict=False):
            expert_outputs += [expert(chunk)]
        expert_output = torch.cat(expert_outputs, dim=1)
        expert_output = _AllToAll.apply(self.group, expert_output)
        # gecm -> ecm
        expert_output = expert_output.reshape(self.world_size * self.num_local_experts, -1, d_model)
        combined_output = torch.einsum("sec,ecm->sm", combine_weights, expert_output)
        return combined_output.reshape(input[0].shape)


# ---- benchmarks/models/transformer_lm.py ----

class FeedForwardLayer(nn.Module):
    def __init__(self, d_model, dim_feedforward, activation, dropout) -> None:
        super().__init__()
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.activation = activation
        self.dropout1 = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.dropout2 = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout2(self.linear2(self.dropout1(self.activation(self.linear1(x)))))


class MoEFFBlock(nn.Module):
    """The `is_moe` feed-forward of the benchmark's `TransformerEncoderLayer` (`__init__` branch and `_ff_block`);
    the shell supplies the norm and the residual."""

    def __init__(self, d_model=HIDDEN, dim_feedforward=INTER, dropout=0.0, activation=None,
                 num_local_experts=EXPERTS):
        super().__init__()
        activation = activation if activation is not None else nn.ReLU()
        self.is_moe = True
        world_size = 1 if not dist.is_initialized() else dist.get_world_size()
        num_global_experts = num_local_experts * world_size
        self.gate = Top2Gate(d_model, num_global_experts)
        experts = nn.ModuleList(
            [FeedForwardLayer(d_model, dim_feedforward, activation, dropout) for _ in range(num_local_experts)]
        )
        self.moe_layer = MOELayer(self.gate, experts)

    def forward(self, x):
        return self._ff_block(x)

    def _ff_block(self, x):
        return self.moe_layer(x)


def build():
    # MOELayer asserts input.shape[0] % num_local_experts == 0 and top2gating asserts tokens % experts == 0
    return tiny(MoEFFBlock, HIDDEN, batch=EXPERTS)
