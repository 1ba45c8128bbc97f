"""nomic-embed-text-v2-moe's remote-code `NomicMoELayer`: a DBRX/Megablocks-style router and a one-hot mask loop
over experts stored as two flat [E * F, H] parameters, with `.tolist()` gathers, `index_add_` and an output bias.

Stands in for the DBRX entry that was asked for: DBRX's original `modeling_dbrx.py` (the databricks/dbrx-instruct
hub remote code) is not in the stored GitHub code (databricks/dbrx holds only README, model cards and
`generate.py`; every stored `DbrxExperts` is transformers' port or a derivative of it). This layer is the closest
widely run relative: its router is DBRX's remote-code router line for line (`jitter`, `moe_normalize_expert_weights`,
`uniform_expert_assignment`) and its experts loop is the remote-code `DbrxExperts.forward` loop.

Mirrors `modeling_hf_nomic_bert.py` as stored in karthickselvaraj/test at commit 4fad009 (a verbatim copy of the
remote code that nomic-ai/nomic-embed-text-v2-moe loads with `trust_remote_code=True`; shawn1123/bug-free-doodle
holds a byte-identical copy): `NomicRouter.__init__` / `jitter` / `forward`, `NomicExpertMLP`, `NomicExperts`,
`NomicMoELayer`, and the activation choice of `NomicBertBlock.__init__`. nomic-ai/contrastors (the training code) runs this model through megablocks instead.
`NomicMoELayer.forward(x, attention_mask=None)` reads (batch, seq, hidden) and calls the router, then the experts.
The router multiplies the input by uniform jitter only `if self.training and self.moe_jitter_eps is not None`,
views the tokens [T, H], scores them with a bias-free Linear, takes a float32 softmax and `torch.topk(moe_top_k)`;
`if self.moe_normalize_expert_weights:` (None here: `NomicMoELayer` passes no value) the top-k weights would be
divided by their p-norm, `if self.uniform_expert_assignment:` (False) the choices would be replaced by a
round-robin; both weight tensors are cast back to the input dtype and (weights, top_weights, top_experts) return.
The experts view the input [T, H], allocate `torch.zeros_like`, one-hot the choices and permute to [E, k, T], and
loop `for expert_idx in range(0, self.moe_num_experts)`: `topk_idx, token_idx = torch.where(mask[expert_idx])`,
`if token_idx.shape[0] == 0: continue`, both index tensors read to Python lists with `.tolist()`,
`x[None, token_list].reshape(-1, H)`, the expert MLP (its [F, H] slices taken by `.view(E, F, H)[expert_idx]` of
w1 and w2, `x @ w1.t()`, the activation, `@ w2`, no bias, no gate) times `top_weights[token_list, topk_list, None]`,
and `out.index_add_(0, token_idx, expert_out)`. The result is reshaped to (B, S, H) and a learned bias is added;
the layer returns that tensor alone (the block adds the residual).
Left out: the megablocks `dmoe.dMoE` path (`NomicBertBlock` takes it only when Nomic's megablocks fork is
installed; otherwise it warns and builds `NomicMoELayer`), the attention half, dropouts and post-norms of the
block (the shell supplies a norm and the residual), the `attention_mask` argument's value (the layer ignores it),
`GPT2Config` as base (a plain local class), weight loading and init (the shell draws weights).
Sizes: the model has n_embd 768, n_inner 3072, 8 experts, top-2, GELU, MoE on every second layer; here hidden 16,
n_inner 32, 8 experts, top-2, GELU.
Constructs: config-valued `if` branches in the router (training jitter, p-norm normalisation, uniform assignment)
that are off, float32 softmax + `topk` with no renormalisation, dtype casts, one-hot `permute(2, 1, 0)` mask, a
`range(E)` loop with `torch.where`, `if n == 0: continue`, `.tolist()` host reads used as list indices for a
`[None, list]` gather and a two-list advanced index, per-expert weight slices by `.view(E, F, H)[i]` of flat
parameters and `matmul` with `.t()`, an activation chosen by a string config, in-place `index_add_` with the tensor
index, an output bias added after the loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("karthickselvaraj/test", "modeling_hf_nomic_bert.py",
                "4fad009e2217c623ebfdf707c1cbe118f14d6946", "NomicMoELayer.forward")
HIDDEN, INNER, EXPERTS, TOP_K = 16, 32, 8, 2


class NomicBertConfig:
    """The MoE fields the layer reads from nomic-embed-text-v2-moe's config (values as there, sizes tiny)."""

    def __init__(self, n_embd=HIDDEN, n_inner=INNER, num_experts=EXPERTS, moe_top_k=TOP_K,
                 activation_function="gelu"):
        self.n_embd = n_embd
        self.n_inner = n_inner
        self.num_experts = num_experts
        self.moe_top_k = moe_top_k
        self.activation_function = activation_function


class NomicRouter(nn.Module):
    def __init__(self, hidden_size: int, moe_num_experts: int, moe_top_k: int,
                 moe_jitter_eps: float | None = None,
                 moe_normalize_expert_weights: float | None = None,
                 uniform_expert_assignment: bool = False):
        super().__init__()
        self.hidden_size = hidden_size
        self.moe_num_experts = moe_num_experts
        self.moe_top_k = moe_top_k
        self.moe_jitter_eps = moe_jitter_eps
        self.moe_normalize_expert_weights = moe_normalize_expert_weights
        self.uniform_expert_assignment = uniform_expert_assignment

        self.layer = nn.Linear(self.hidden_size, self.moe_num_experts, bias=False)

    def jitter(self, x: torch.Tensor) -> torch.Tensor:
        if self.moe_jitter_eps is None:
            raise RuntimeError("The router does not have moe_jitter_eps set.")
        low = 1.0 - self.moe_jitter_eps
        high = 1.0 + self.moe_jitter_eps
        noise = torch.rand(x.size(), dtype=x.dtype, device=x.device)
        return low + noise * (high - low)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.LongTensor]:
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


class NomicExpertMLP(nn.Module):
    def __init__(self, hidden_size: int, ffn_hidden_size: int, moe_num_experts: int, ffn_act_fn):
        super().__init__()
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.moe_num_experts = moe_num_experts

        self.w1 = nn.Parameter(torch.empty(moe_num_experts * ffn_hidden_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(moe_num_experts * ffn_hidden_size, hidden_size))
        self.activation_fn = ffn_act_fn

    def forward(self, x: torch.Tensor, expert_idx: int) -> torch.Tensor:
        expert_w1 = self.w1.view(self.moe_num_experts, self.ffn_hidden_size, self.hidden_size)[expert_idx]
        expert_w2 = self.w2.view(self.moe_num_experts, self.ffn_hidden_size, self.hidden_size)[expert_idx]

        x1 = x.matmul(expert_w1.t())
        act_out = self.activation_fn(x1)
        x2 = act_out.matmul(expert_w2)
        return x2


class NomicExperts(nn.Module):
    def __init__(self, config, hidden_size: int, ffn_hidden_size: int, moe_num_experts: int):
        super().__init__()
        self.moe_num_experts = moe_num_experts
        activation = (
            F.sigmoid
            if config.activation_function == "glu"
            else (F.silu if config.activation_function == "swiglu" else F.gelu)
        )
        self.mlp = NomicExpertMLP(
            hidden_size=config.n_embd,
            ffn_hidden_size=config.n_inner,
            moe_num_experts=moe_num_experts,
            ffn_act_fn=activation,
        )
        self.bias = nn.Parameter(torch.zeros(config.n_embd))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, top_weights: torch.Tensor,
                top_experts: torch.LongTensor) -> torch.Tensor:
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
        return out + self.bias


class NomicMoELayer(nn.Module):
    def __init__(self, config: NomicBertConfig):
        super().__init__()

        self.router = NomicRouter(
            config.n_embd,
            moe_num_experts=config.num_experts,
            moe_top_k=config.moe_top_k,
        )

        self.experts = NomicExperts(
            config,
            hidden_size=config.n_embd,
            ffn_hidden_size=config.n_inner,
            moe_num_experts=config.num_experts,
        )

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None):
        batch_size, seq_len, hidden_dim = x.shape

        weights, top_weights, top_experts = self.router(x)
        out = self.experts(x, weights, top_weights, top_experts)

        return out


def build():
    return tiny(lambda: NomicMoELayer(NomicBertConfig()), HIDDEN)
