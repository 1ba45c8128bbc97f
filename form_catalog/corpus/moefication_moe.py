"""THUNLP MoEfication's MLP-routed T5 FFN: a dense `T5DenseActDense` whose neurons were split into experts by
balanced parameter clustering, with its `forward` swapped at run time (`types.MethodType`) for one that routes each
token with a small learned MLP and zeroes the non-selected experts' neurons through a boolean-mask assignment.

Mirrors thunlp/MoEfication `examples/t5-sst2-mlp.py` at commit 48971265506cbad00d6bbed8e643034a9acbaeae:
`change_forward` with its inner `_forward(ffn_self, hidden_states)` and `modify_ffn(ffn, path)`. The dense module
it patches is transformers' `T5DenseActDense` (`wi` / `act` ReLU / `dropout` / `wo`, all bias-free), and the router
`ffn.mlp` that `modify_ffn` `torch.load`s is the one `MLPCenter.cal_center` trains in `moefication/utils.py` at
commit 5a5997af172343de4ad861ffcc0de4b4eaa4aa8a: `nn.Sequential(Linear(d_model, E, bias=False), Tanh(),
Linear(E, E, bias=False))`. The expert structure (`labels`) comes from `ParamSplit.split` (balanced k-means over the
normalised `wi` rows, `KMeansConstrained` with size_min == size_max) in the same file.
`_forward` unpacks `bsz, seq_len, hidden_size`, makes a detached `clone()` of the input viewed as [T, H], divides it
by its L2 norm (`torch.norm(dim=-1).unsqueeze(-1)`), scores it with the router MLP, takes `torch.topk(score, k)[1]`
viewed as [B, S, k], and builds the neuron mask as `F.embedding(labels, ffn_self.patterns).sum(-2)`: `patterns` is
a plain (unregistered) float [E, d_ff] tensor attribute, one 0/1 row per expert, used as an embedding table. The
dense path then runs `wi`, ReLU, an IN-PLACE boolean-mask assignment `hidden_states[cur_mask == False] = 0`
(float-vs-`False` comparison), dropout and `wo`: every neuron is still computed densely; routing only zeroes
activations. `modify_ffn` builds `patterns` from the label list (`cluster_num = max(labels)+1`, one
`np.array(labels) == i` row per cluster), stores `ffn.k`, `ffn.mlp`, `ffn.forward_old` and rebinds
`ffn.forward`; `k` inside `_forward` is the closure variable of `change_forward`, not `ffn_self.k`.
Left out: the T5 model around the FFN (attention, T5 RMS-style LayerNorm; the shell supplies a pre-FFN LayerNorm
and the residual add, which T5's `T5LayerFF` does after its own dropout), `torch.load` of the labels and router
(the labels here are a fixed balanced random permutation drawn from a seeded generator, standing in for the
clustering; the shell draws all weights), `.cuda()`, the SST-2 evaluation loop. `torch.Tensor(patterns)` is
given `np.array(patterns)` rather than the list of arrays (same values, no slow-path warning).
Sizes: t5-base has d_model 768, d_ff 3072, 96 experts of 32 neurons, k=20; here d_model 16, d_ff 32, 4 experts
of 8 neurons, k=2, one layer, 7 tokens.
Constructs: instance-level `forward` override through `types.MethodType` with a closure-captured k,
`clone().detach()`, L2 normalisation by `torch.norm`, a Linear-Tanh-Linear router, `topk(...)[1]` indices viewed
to [B, S, k], `F.embedding` of expert ids into a plain-tensor pattern table then `sum(-2)` into a neuron mask,
in-place boolean-mask index_put of 0 with a `== False` mask, dense `wi`/`wo` with eval-mode dropout.
"""

from __future__ import annotations

import types

import numpy as np
import torch
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("thunlp/MoEfication", "examples/t5-sst2-mlp.py", "48971265506cbad00d6bbed8e643034a9acbaeae",
                "change_forward._forward")
D_MODEL, D_FF, EXPERTS, K = 16, 32, 4, 2


class T5DenseActDense(nn.Module):
    """transformers' T5 FFN (t5-base: ReLU, bias-free, dropout_rate 0.1)."""

    def __init__(self, d_model: int, d_ff: int, dropout_rate: float = 0.1):
        super().__init__()
        self.wi = nn.Linear(d_model, d_ff, bias=False)
        self.wo = nn.Linear(d_ff, d_model, bias=False)
        self.dropout = nn.Dropout(dropout_rate)
        self.act = nn.ReLU()

    def forward(self, hidden_states):
        hidden_states = self.wi(hidden_states)
        hidden_states = self.act(hidden_states)
        hidden_states = self.dropout(hidden_states)
        hidden_states = self.wo(hidden_states)
        return hidden_states


def param_split_labels(d_ff: int, split_num: int) -> list[int]:
    """Stand-in for `ParamSplit.split`: a balanced assignment of d_ff neurons to split_num experts."""
    split_size = d_ff // split_num
    perm = torch.randperm(d_ff, generator=torch.Generator().manual_seed(0)).tolist()
    return [perm[i] // split_size for i in range(d_ff)]


def mlp_router(hidden: int, num_blocks: int) -> nn.Module:
    """The router `MLPCenter.cal_center` trains and saves as `<labels>_input_compl`."""
    return nn.Sequential(nn.Linear(hidden, num_blocks, bias=False), nn.Tanh(),
                         nn.Linear(num_blocks, num_blocks, bias=False))


def change_forward(ffns, labels, k=20):

    def _forward(ffn_self, hidden_states):

        bsz, seq_len, hidden_size = hidden_states.shape
        hidden_states_mlp = hidden_states.clone().detach()
        hidden_states_mlp = hidden_states_mlp.view(-1, hidden_size)

        hidden_states_mlp = hidden_states_mlp / torch.norm(hidden_states_mlp, dim=-1).unsqueeze(-1)
        score = ffn_self.mlp(hidden_states_mlp)

        labels = torch.topk(score, k=k, dim=-1)[1].view(bsz, seq_len, k)
        cur_mask = torch.nn.functional.embedding(labels, ffn_self.patterns).sum(-2)

        hidden_states = ffn_self.wi(hidden_states)
        hidden_states = ffn_self.act(hidden_states)
        hidden_states[cur_mask == False] = 0  # noqa: E712

        hidden_states = ffn_self.dropout(hidden_states)
        hidden_states = ffn_self.wo(hidden_states)
        return hidden_states

    def modify_ffn(ffn, labels):
        assert type(ffn) == T5DenseActDense  # noqa: E721
        cluster_num = max(labels) + 1
        patterns = []
        for i in range(cluster_num):
            patterns.append(np.array(labels) == i)
        ffn.patterns = torch.Tensor(np.array(patterns))
        ffn.k = k
        ffn.mlp = mlp_router(ffn.wi.in_features, cluster_num)
        ffn.forward_old = ffn.forward
        ffn.forward = types.MethodType(_forward, ffn)

    for ffn in ffns:
        modify_ffn(ffn, labels)


def make_moe() -> nn.Module:
    ffn = T5DenseActDense(D_MODEL, D_FF)
    change_forward([ffn], param_split_labels(D_FF, EXPERTS), K)
    return ffn


def build():
    return tiny(make_moe, D_MODEL)
