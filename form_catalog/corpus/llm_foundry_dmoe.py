"""LLM Foundry's `torch_dmoe`, DBRX's pure-PyTorch MoE: stacked GLU weights sliced per expert, L1 top-4.

Mirrors mosaicml/llm-foundry `llmfoundry/models/layers/dmoe.py` at commit 8c8dd48 (`dMoE.forward`,
`LearnedRouter` (`jitter`, `_top_k`, `forward`), `_UniformExpertAssignment`, `GLU.forward`, `MLP.forward`,
`DroplessMLP.forward`), with `llmfoundry/models/layers/ffn.py` (`build_torch_dmoe`, `resolve_ffn_act_fn`,
`apply_ffn` in `blocks.py` for the call) and the DBRX settings of `scripts/eval/yamls/dbrx-gauntlet/
dbrx-9b.yaml` (`ffn_type: torch_dmoe`, `mlp_type: glu`, 16 experts, `moe_top_k: 4`, `ffn_act_fn: silu`,
`moe_jitter_eps: 0`, `uniform_expert_assignment: false`, `moe_normalize_expert_weights: 1`). DBRX's
Hugging Face code (`DbrxRouter`, `DbrxExperts`, `DbrxExpertGLU`, as later taken into transformers) follows
this code closely (the same w1/v1/w2 [E * F, H] stacks and expert loop); the hub remote-code file itself is
not among the stored copies (only transformers' `models/dbrx`, which the corpus treats as taken), so the
LLM Foundry original, which DBRX's own yamls select as `torch_dmoe`, stands in for it.
The router: in training with a jitter eps it multiplies x by uniform noise in [1 - eps, 1 + eps]; a
bias-free Linear on x viewed [T, H], softmax over experts (in x's dtype), `_top_k` (`scores.max` with
unsqueezed results when top_k == 1, else `torch.topk`); `if self.moe_normalize_expert_weights:` the k
weights are divided by their p-norm (`torch.norm(w, p=1, dim=-1, keepdim=True)`: L1, i.e. renormalised to
sum 1 since softmax weights are positive); optional uniform round-robin reassignment through a custom
autograd Function (off); scores and weights cast to x's dtype; returns (scores, weights, top_experts).
The experts: `w1`, `v1`, `w2` are each ONE [E * F, H] parameter; `GLU.forward(x, expert_idx)` views each
as [E, F, H] and indexes the expert, then `act(x @ w1_e.t()) * (x @ v1_e.t())` and `@ w2_e` (w2 stored
[F, H] per expert, used untransposed); w1 gate, v1 up, w2 down, act = `partial(F.silu)` resolved from the
`{"name": "silu"}` config. `DroplessMLP.forward`: x viewed [T, H], `out = zeros_like(x)`,
`one_hot(top_experts, E).permute(2, 1, 0)`, then for every expert `topk_idx, token_idx = torch.where(...)`,
`if token_idx.shape[0] == 0: continue`, both index tensors read to Python lists with `.tolist()`
("faster to index using lists"), `x[None, token_list].reshape(-1, H)`, the GLU on those rows, weighted by
`expert_weights[token_list, topk_list, None]`, device moves that are no-ops on one device (the weights
rebound to themselves, `out` rebound by `.to`), and `out.index_add_(0, token_idx, ...)`; `out.view(in_shape)`.
Tiny sizes: 8 experts, top-4 (DBRX's k), hidden 16, F 8 (the gauntlet yamls: 16 experts, top-4,
expansion_ratio 1.75, d_model 2048 to 5120; the released 132B DBRX has d_model 6144, so F = 10752).
Left out: nothing of the forward; the `device` arguments and `torch.rand` initialisation (the corpus shell
draws the weights); the MegaBlocks `mb_dmoe` path (CUDA kernels) is a different layer.
Constructs: `if self.training and eps is not None` jitter, a `top_k == 1` branch, p-norm weight
normalisation under a truthiness check, a custom autograd Function behind a flag, one-hot `permute` mask,
loop over `range(E)` with `torch.where`, `if n == 0: continue`, `.tolist()` list indexing, per-expert
`.view(E, F, H)[expert_idx]` slices of stacked weights inside the loop, `matmul` with `.t()`, `.to(device)`
rebinding inside the loop, `index_add_`.
"""

from __future__ import annotations

from copy import deepcopy
from functools import partial

import torch
import torch.nn.functional as F

from ._shell import Source, tiny

SOURCE = Source("mosaicml/llm-foundry", "llmfoundry/models/layers/dmoe.py",
                "8c8dd48f72168c5d51e2f7b151595892a8fba43d", "DroplessMLP.forward")
HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 8, 4
FFN_ACT_FN = {"name": "silu"}
JITTER_EPS, NORMALIZE_P, UNIFORM_ASSIGNMENT = 0, 1, False
DEFAULT_ACTIVATION_FN = partial(F.gelu, approximate="tanh")  # dMoE's default; DBRX passes silu


def resolve_ffn_act_fn(config: dict):
    """`ffn.py`'s resolver: a torch.nn.functional activation by name, other keys bound with `partial`."""
    config = deepcopy(config)
    name = config.pop("name")
    if not hasattr(torch.nn.functional, name):
        raise ValueError(f"Unrecognized activation function name ({name}).")
    return partial(getattr(torch.nn.functional, name), **config)


class _UniformExpertAssignment(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, num_experts):
        out = torch.arange(x.numel(), dtype=x.dtype, device=x.device)
        out = torch.remainder(out, num_experts)
        return out.view(x.shape)


class LearnedRouter(torch.nn.Module):
    def __init__(self, hidden_size, moe_num_experts, moe_top_k, moe_jitter_eps, moe_normalize_expert_weights,
                 uniform_expert_assignment):
        super().__init__()
        self.hidden_size = hidden_size
        self.moe_num_experts = moe_num_experts
        self.moe_top_k = moe_top_k
        self.moe_jitter_eps = moe_jitter_eps
        self.moe_normalize_expert_weights = moe_normalize_expert_weights
        self.uniform_expert_assignment = uniform_expert_assignment
        self.layer = torch.nn.Linear(hidden_size, moe_num_experts, bias=False)

    def jitter(self, x):
        assert self.moe_jitter_eps is not None
        low, high = 1.0 - self.moe_jitter_eps, 1.0 + self.moe_jitter_eps
        noise = torch.rand(x.size(), dtype=x.dtype, device=x.device)
        return low + noise * (high - low)

    def _top_k(self, scores):
        if self.moe_top_k == 1:
            values, indices = scores.max(dim=-1)
            return values.unsqueeze(-1), indices.unsqueeze(-1)
        return torch.topk(scores, self.moe_top_k, dim=-1)

    def forward(self, x):
        if self.training and self.moe_jitter_eps is not None:
            x = x * self.jitter(x)

        scores = self.layer(x.view(-1, x.shape[-1])).softmax(dim=-1)
        expert_weights, top_experts = self._top_k(scores)
        if self.moe_normalize_expert_weights:
            expert_weights = expert_weights / torch.norm(expert_weights, p=self.moe_normalize_expert_weights,
                                                         dim=-1, keepdim=True)

        top_experts = (
            _UniformExpertAssignment.apply(top_experts, self.moe_num_experts)
            if self.uniform_expert_assignment else top_experts
        )
        scores = scores.to(x.dtype)
        expert_weights = expert_weights.to(x.dtype)
        return scores, expert_weights, top_experts


class MLP(torch.nn.Module):
    """`mlp_type == "mlp"` experts (not DBRX's; kept for the dispatch in `DroplessMLP.__init__`)."""

    def __init__(self, hidden_size, ffn_hidden_size, moe_num_experts, activation_fn):
        super().__init__()
        self.moe_num_experts, self.ffn_hidden_size = moe_num_experts, ffn_hidden_size
        self.hidden_size = hidden_size
        self.w1 = torch.nn.Parameter(torch.empty(moe_num_experts * ffn_hidden_size, hidden_size))
        self.w2 = torch.nn.Parameter(torch.empty(moe_num_experts * ffn_hidden_size, hidden_size))
        self.activation_fn = activation_fn

    def forward(self, x, expert_idx):
        w1_e = self.w1.view(self.moe_num_experts, self.ffn_hidden_size, self.hidden_size)[expert_idx]
        w2_e = self.w2.view(self.moe_num_experts, self.ffn_hidden_size, self.hidden_size)[expert_idx]
        return self.activation_fn(x @ w1_e.t()) @ w2_e


class GLU(torch.nn.Module):
    def __init__(self, hidden_size, ffn_hidden_size, moe_num_experts, activation_fn):
        super().__init__()
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.moe_num_experts = moe_num_experts
        self.w1 = torch.nn.Parameter(torch.empty(moe_num_experts * ffn_hidden_size, hidden_size))
        self.v1 = torch.nn.Parameter(torch.empty(moe_num_experts * ffn_hidden_size, hidden_size))
        self.w2 = torch.nn.Parameter(torch.empty(moe_num_experts * ffn_hidden_size, hidden_size))
        self.activation_fn = activation_fn

    def forward(self, x, expert_idx):
        w1_e = self.w1.view(self.moe_num_experts, self.ffn_hidden_size, self.hidden_size)[expert_idx]
        v1_e = self.v1.view(self.moe_num_experts, self.ffn_hidden_size, self.hidden_size)[expert_idx]
        w2_e = self.w2.view(self.moe_num_experts, self.ffn_hidden_size, self.hidden_size)[expert_idx]

        gate = x.matmul(w1_e.t())
        up = x.matmul(v1_e.t())
        gate = self.activation_fn(gate)
        gate = gate * up
        return gate.matmul(w2_e)


class DroplessMLP(torch.nn.Module):
    def __init__(self, hidden_size, ffn_hidden_size, mlp_type, moe_num_experts, activation_fn, bias):
        super().__init__()
        self.moe_num_experts = moe_num_experts
        if mlp_type == "mlp":
            self.mlp = MLP(hidden_size, ffn_hidden_size, moe_num_experts, activation_fn)
        elif mlp_type == "glu":
            self.mlp = GLU(hidden_size, ffn_hidden_size, moe_num_experts, activation_fn)
        else:
            raise ValueError(f"Received unknown {mlp_type=}")

    def forward(self, x, scores, expert_weights, top_experts):
        in_shape = x.shape
        hidden_size = in_shape[-1]

        x = x.view(-1, hidden_size)
        out = torch.zeros_like(x)

        expert_mask = torch.nn.functional.one_hot(
            top_experts, num_classes=self.moe_num_experts).permute(2, 1, 0)
        for expert_idx in range(0, self.moe_num_experts):
            topk_idx, token_idx = torch.where(expert_mask[expert_idx])
            if token_idx.shape[0] == 0:
                continue
            # Python lists index faster than tensors (the original's comment, paraphrased).
            token_list = token_idx.tolist()
            topk_list = topk_idx.tolist()

            expert_tokens = x[None, token_list].reshape(-1, hidden_size)
            mlp_output = self.mlp(expert_tokens, expert_idx)
            # Device moves for pipeline-parallel generation; no-ops on one device.
            expert_weights = expert_weights.to(mlp_output.device)
            expert_out = mlp_output * expert_weights[token_list, topk_list, None]
            out = out.to(mlp_output.device)
            token_idx = token_idx.to(mlp_output.device)
            out.index_add_(0, token_idx, expert_out)

        return out.view(in_shape)


class dMoE(torch.nn.Module):  # noqa: N801 - the original's name
    def __init__(self, hidden_size=1024, ffn_hidden_size=4096, moe_num_experts=1, moe_top_k=1,
                 mlp_type="mlp", activation_fn=DEFAULT_ACTIVATION_FN, moe_jitter_eps=None,
                 moe_normalize_expert_weights=None, uniform_expert_assignment=False, bias=True):
        super().__init__()
        self.router = LearnedRouter(hidden_size, moe_num_experts=moe_num_experts, moe_top_k=moe_top_k,
                                    moe_jitter_eps=moe_jitter_eps,
                                    moe_normalize_expert_weights=moe_normalize_expert_weights,
                                    uniform_expert_assignment=uniform_expert_assignment)
        self.experts = DroplessMLP(hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size,
                                   mlp_type=mlp_type, moe_num_experts=moe_num_experts,
                                   activation_fn=activation_fn, bias=bias)

    def forward(self, x):
        scores, expert_weights, top_experts = self.router(x)
        return self.experts(x, scores, expert_weights, top_experts)


def build_torch_dmoe():
    """`ffn.py`'s `build_torch_dmoe` with the DBRX yaml's `ffn_config` (tiny sizes; `no_bias: true`)."""
    return dMoE(hidden_size=HIDDEN, ffn_hidden_size=INTER, moe_num_experts=EXPERTS, moe_top_k=TOP_K,
                mlp_type="glu", bias=False, moe_jitter_eps=JITTER_EPS,
                activation_fn=resolve_ffn_act_fn(FFN_ACT_FN),
                moe_normalize_expert_weights=NORMALIZE_P, uniform_expert_assignment=UNIFORM_ASSIGNMENT)


def build():
    return tiny(build_torch_dmoe, HIDDEN)
