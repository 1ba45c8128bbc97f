"""DBRX's reference / hub remote-code `DbrxFFN`: float32 softmax router with p-norm renormalisation, and a
per-expert loop over one fused `DbrxExpertGLU` whose flat weights are viewed and indexed by a Python expert id.

Mirrors databricks/dbrx `model/modeling_dbrx.py` at commit a320039 (a3200393e678387a6f30f3e903108c650625eb21,
the repository's main branch; the file is unchanged since the initial commit 7cbcf4e and is the
`trust_remote_code` modeling file Databricks shipped with databricks/dbrx-base and dbrx-instruct before
transformers' own port): `resolve_ffn_act_fn`, `DbrxRouter` (`__init__` / `jitter` / `forward`), `DbrxExpertGLU`
(`__init__` / `forward`), `DbrxExperts` (`__init__` / `forward`), `DbrxFFN` (`__init__` / `forward`) and the
"Fully Connected" half of `DbrxBlock.forward`; the FFN fields and defaults of `DbrxFFNConfig` come from
`model/configuration_dbrx.py` at the same commit (`ffn_act_fn` {'name': 'silu'}, `moe_normalize_expert_weights`
1, `uniform_expert_assignment` False), `moe_jitter_eps` 0 from `model/config.json`.
`DbrxRouter.forward` multiplies the input by uniform jitter `if self.training and self.moe_jitter_eps is not
None`, scores `x.view(-1, H)` with a bias-free Linear, takes `softmax(dim=-1, dtype=torch.float32)`, `torch.topk`
of it, and `if self.moe_normalize_expert_weights:` divides the kept weights by their `torch.norm(p=...)` (p=1
here, so a sum renormalisation done through `torch.norm`); `if self.uniform_expert_assignment:` it overwrites the
expert ids under `torch.no_grad()` with `arange(numel) % E` (off here, as in DBRX); both weight tensors are cast
back to the input dtype. `DbrxExperts.forward` flattens to [T, H], `zeros_like` output, one-hot encodes the
[T, k] ids and permutes to [E, k, T], then `for expert_idx in range(0, E)`: `topk_idx, token_idx =
torch.where(expert_mask[expert_idx])`, `if token_idx.shape[0] == 0: continue`, reads both index tensors to
Python lists with `.tolist()`, gathers `x[None, token_list].reshape(-1, H)`, runs the shared `DbrxExpertGLU` with
the Python int `expert_idx` (which views each flat [E*F, H] parameter as [E, F, H] and indexes it:
`x.matmul(w1.t())`, `x.matmul(v1.t())`, activation, product, `matmul(w2)` with no transpose), scales by
`top_weights[token_list, topk_list, None]`, and `index_add_`s into the output with the tensor `token_idx`.
`DbrxFFN` returns `(out, weights)` (the full router probabilities); the block applies residual dropout
(`p=resid_pdrop`, 0.0, `training=self.training`) before its residual add.
Left out: attention (`DbrxNormAttentionNorm`, its bias-free LayerNorms; the shell supplies the pre-FFN norm, a
LayerNorm with bias, and adds the residual), rotary embedding, KV cache, the `PretrainedConfig` base classes
(plain local config class with the hub defaults), the load-balancing loss (computed in the model from the
returned router weights), weight init (the shell draws the weights). Nothing of the FFN forward was left out.
Sizes: DBRX has d_model 6144, ffn_hidden_size 10752, 16 experts, top-4, 40 layers; here d_model 16,
ffn_hidden_size 8, 8 experts, top-2, one layer.
Constructs: `if self.training` input jitter, float32 `softmax` then `topk`, `torch.norm(p=1)` renormalisation
behind a config-valued `if`, a `torch.no_grad()` uniform-assignment branch, dtype casts, `one_hot(...).permute(2,
1, 0)`, a loop over `range(E)` with `torch.where`, `if token_idx.shape[0] == 0: continue`, `.tolist()` index lists
used for both a `x[None, list]` gather and a two-list advanced index, one fused expert module called with a
Python int that selects a slice of `.view(E, F, H)` flat parameters, `matmul` with `.t()`, `index_add_`, a
`functools.partial` activation resolved from `nn.functional` by name, a tuple return, a residual dropout.
"""

from __future__ import annotations

from copy import deepcopy
from functools import partial

import torch
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("databricks/dbrx", "model/modeling_dbrx.py", "a3200393e678387a6f30f3e903108c650625eb21",
                "DbrxFFN.forward")
D_MODEL, FFN_HIDDEN, EXPERTS, TOP_K = 16, 8, 8, 2


class DbrxFFNConfig:
    """The fields of the hub's `DbrxFFNConfig` (defaults as there, `moe_jitter_eps` from config.json, sizes tiny)."""

    def __init__(self, ffn_act_fn=None, ffn_hidden_size=FFN_HIDDEN, moe_num_experts=EXPERTS, moe_top_k=TOP_K,
                 moe_jitter_eps=0, moe_loss_weight=0.05, moe_normalize_expert_weights=1,
                 uniform_expert_assignment=False):
        if ffn_act_fn is None:
            ffn_act_fn = {'name': 'silu'}
        self.ffn_act_fn = ffn_act_fn
        self.ffn_hidden_size = ffn_hidden_size
        self.moe_num_experts = moe_num_experts
        self.moe_top_k = moe_top_k
        self.moe_jitter_eps = moe_jitter_eps
        self.moe_loss_weight = moe_loss_weight
        self.moe_normalize_expert_weights = moe_normalize_expert_weights
        self.uniform_expert_assignment = uniform_expert_assignment


def resolve_ffn_act_fn(ffn_act_fn: dict):
    """`nn.functional.<name>` with the dict's other keys bound as a partial."""
    config = deepcopy(ffn_act_fn)
    name = config.pop('name')
    if not hasattr(nn.functional, name):
        raise ValueError(f'Unrecognised activation function name ({name}).')
    act = getattr(nn.functional, name)
    return partial(act, **config)


class DbrxRouter(nn.Module):

    def __init__(self, hidden_size, moe_num_experts, moe_top_k, moe_jitter_eps, moe_normalize_expert_weights,
                 uniform_expert_assignment):
        super().__init__()
        self.hidden_size = hidden_size
        self.moe_num_experts = moe_num_experts
        self.moe_top_k = moe_top_k
        self.moe_jitter_eps = moe_jitter_eps
        self.moe_normalize_expert_weights = moe_normalize_expert_weights
        self.uniform_expert_assignment = uniform_expert_assignment

        self.layer = nn.Linear(self.hidden_size, self.moe_num_experts, bias=False)

    def jitter(self, x):
        if self.moe_jitter_eps is None:
            raise RuntimeError('The router does not have moe_jitter_eps set.')
        low = 1.0 - self.moe_jitter_eps
        high = 1.0 + self.moe_jitter_eps
        noise = torch.rand(x.size(), dtype=x.dtype, device=x.device)
        return low + noise * (high - low)

    def forward(self, x):
        if self.training and self.moe_jitter_eps is not None:
            x = x * self.jitter(x)

        weights = self.layer(x.view(-1, x.shape[-1])).softmax(dim=-1, dtype=torch.float32)
        top_weights, top_experts = torch.topk(weights, self.moe_top_k, dim=-1)

        if self.moe_normalize_expert_weights:
            top_weights = top_weights / torch.norm(top_weights, p=self.moe_normalize_expert_weights, dim=-1,
                                                   keepdim=True)

        if self.uniform_expert_assignment:
            with torch.no_grad():
                uniform_tensor = torch.arange(0, top_experts.numel(), device=top_experts.device,
                                              dtype=top_experts.dtype) % self.moe_num_experts
                top_experts = uniform_tensor.reshape(top_experts.shape)
                # weights and top_weights are not changed

        weights = weights.to(x.dtype)
        top_weights = top_weights.to(x.dtype)
        return weights, top_weights, top_experts


class DbrxExpertGLU(nn.Module):

    def __init__(self, hidden_size, ffn_hidden_size, moe_num_experts, ffn_act_fn):
        super().__init__()
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.moe_num_experts = moe_num_experts

        self.w1 = nn.Parameter(torch.empty(moe_num_experts * ffn_hidden_size, hidden_size))
        self.v1 = nn.Parameter(torch.empty(moe_num_experts * ffn_hidden_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(moe_num_experts * ffn_hidden_size, hidden_size))
        self.activation_fn = resolve_ffn_act_fn(ffn_act_fn)

    def forward(self, x, expert_idx: int):
        expert_w1 = self.w1.view(self.moe_num_experts, self.ffn_hidden_size, self.hidden_size)[expert_idx]
        expert_v1 = self.v1.view(self.moe_num_experts, self.ffn_hidden_size, self.hidden_size)[expert_idx]
        expert_w2 = self.w2.view(self.moe_num_experts, self.ffn_hidden_size, self.hidden_size)[expert_idx]

        x1 = x.matmul(expert_w1.t())
        x2 = x.matmul(expert_v1.t())
        x1 = self.activation_fn(x1)
        x1 = x1 * x2
        x1 = x1.matmul(expert_w2)
        return x1


class DbrxExperts(nn.Module):

    def __init__(self, hidden_size, ffn_hidden_size, moe_num_experts, ffn_act_fn):
        super().__init__()
        self.moe_num_experts = moe_num_experts
        self.mlp = DbrxExpertGLU(hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size,
                                 moe_num_experts=moe_num_experts, ffn_act_fn=ffn_act_fn)

    def forward(self, x, weights, top_weights, top_experts):
        bsz, q_len, hidden_size = x.shape
        x = x.view(-1, hidden_size)
        out = torch.zeros_like(x)

        expert_mask = nn.functional.one_hot(top_experts, num_classes=self.moe_num_experts).permute(2, 1, 0)
        for expert_idx in range(0, self.moe_num_experts):
            topk_idx, token_idx = torch.where(expert_mask[expert_idx])
            if token_idx.shape[0] == 0:
                continue

            token_list = token_idx.tolist()
            topk_list = topk_idx.tolist()

            expert_tokens = x[None, token_list].reshape(-1, hidden_size)
            expert_out = self.mlp(expert_tokens, expert_idx) * top_weights[token_list, topk_list, None]

            out.index_add_(0, token_idx, expert_out)

        out = out.reshape(bsz, q_len, hidden_size)
        return out


class DbrxFFN(nn.Module):

    def __init__(self, hidden_size, ffn_config):
        super().__init__()

        self.router = DbrxRouter(
            hidden_size,
            moe_num_experts=ffn_config.moe_num_experts,
            moe_top_k=ffn_config.moe_top_k,
            moe_jitter_eps=ffn_config.moe_jitter_eps,
            moe_normalize_expert_weights=ffn_config.moe_normalize_expert_weights,
            uniform_expert_assignment=ffn_config.uniform_expert_assignment,
        )

        self.experts = DbrxExperts(
            hidden_size=hidden_size,
            ffn_hidden_size=ffn_config.ffn_hidden_size,
            moe_num_experts=ffn_config.moe_num_experts,
            ffn_act_fn=ffn_config.ffn_act_fn,
        )

    def forward(self, x):
        weights, top_weights, top_experts = self.router(x)
        out = self.experts(x, weights, top_weights, top_experts)
        return out, weights


class DbrxBlockFFN(nn.Module):
    """The "Fully Connected" half of `DbrxBlock.forward` after `norm_2`: the FFN and the residual dropout (the
    shell supplies the norm and adds the residual)."""

    def __init__(self, d_model=D_MODEL, resid_pdrop=0.0):
        super().__init__()
        self.resid_pdrop = resid_pdrop
        self.ffn = DbrxFFN(hidden_size=d_model, ffn_config=DbrxFFNConfig())

    def forward(self, hidden_states):
        hidden_states, router_logits = self.ffn(hidden_states)
        hidden_states = nn.functional.dropout(hidden_states, p=self.resid_pdrop, training=self.training)
        return hidden_states


def build():
    return tiny(DbrxBlockFFN, D_MODEL)
