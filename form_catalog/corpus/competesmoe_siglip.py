"""CompeteSMoE's `CompeteSMoE` layer in a SigLIP encoder block: a softmax top-k router, a dict of per-expert
`torch.where` triples, and an advanced-index `results[b, t] += w * expert(x[b, t])` loop.

Mirrors Fsoft-AIC/CompeteSMoE at commit 0be1cb7: `moe_model/model/moe/competesmoe.py` (`CompeteSMoE.__init__`,
`router_policy`, `forward`), `moe_model/model/moe/moe.py` (`MoeLayer.__init__`, `init_gate_weights`, `topk_expert`,
`compute_moe`), `moe_model/model/moe/register.py` (`register_moe`, `get_moe`) and
`moe_model/model/multimodal_encoder/siglip_smoe.py` (`SiglipMLP`, the MoE half of
`SiglipEncoderMoELayer.__init__` / `forward`), with the settings of `scripts/train/phi35mini/siglip/sft.sh`
(`--moe_name competesmoe` as $TYPE_MOE, 4 experts, top-2, `--sparse_upcycling true`) and train.py's defaults
(`rate_flip` 0.05, `warm_up` 0.05, `init_weight` False). The class is registered by a decorator whose inner
`decorate` returns nothing, so the module-level name `CompeteSMoE` is bound to None and the layer is built through
the registry (`get_moe(config.moe_name)(...)`), as the encoder does. With sparse upcycling the encoder passes one
`SiglipMLP` and `MoeLayer` deep-copies it once per expert; the gate is a bias-free Linear.
`forward(x, return_id_experts, is_vision=True)` starts from a zero [B, N, out] buffer, runs `router_policy`: gate
logits, `topk_expert` (a float32 softmax, top-k of the probabilities), weights divided by their sum cast to the
input dtype. It makes zero aux/balance loss scalars and an empty info dict, then tests `x.requires_grad and
self.current_steps >= self.step_warm and self.prob_flips[...].item() == 1`: in inference the input needs no grad,
so the `and` short-circuits (`step_warm` is still None, set only by the trainer's `set_total_steps`) and the
competition branch (every expert on every token, affinity top-k, router/diversity/balance losses) is not taken.
The layer is meant to be called without grad (as tools/corpus.py calls it, under `torch.no_grad`): with a
grad-requiring input the source, before the trainer's `set_total_steps`, reaches `current_steps >= None` and
raises TypeError, and so does this mirror.
The else branch calls `compute_moe(weights, selected_experts, output, x)`: a first loop over `range(len(experts))`
stores `torch.where(selected_experts == i)` (three index tensors: batch, token, slot) in a dict keyed by expert;
a second loop over `enumerate(self.experts)` reads them back, runs the expert on the gathered rows `x[b, t]`
(`expert_outputs` is None) and adds `weights[b, t, slot].unsqueeze(0).T * out` into `results[b, t]` in place
(advanced-index read-add-write; within one expert a (b, t) pair occurs once). The losses branch needs
`x.requires_grad or return_id_experts` and is skipped; the layer returns (output, aux, None, info). The block
adds the first element to its residual. An expert is `SiglipMLP`: biased fc1, `ACT2FN["gelu_pytorch_tanh"]`
(SigLIP's activation; `nn.GELU(approximate="tanh")` here), biased fc2.
Left out: the attention half and layer norms of `SiglipEncoderMoELayer` (the shell's norm and residual stand in);
`set_total_steps` (trainer-time: distributed broadcast of the flip schedule); the competition branch's helpers
(`competition_policy`, `experts_diversity_loss`, `router_loss`) and `combine_loss` / `balanceloss` / `zloss`,
which only run with a grad-requiring input or `return_id_experts` (reaching them raises here); the `einops`
import (used only by those losses).
Sizes: SigLIP-so400m is 1152 wide with a 4304 MLP; here hidden 16, intermediate 8, 4 experts, top-2, and the
flip-schedule buffer keeps its real 15801 entries.
Constructs: a registering class decorator that returns None, a module-level registry lookup, `copy.deepcopy`
experts, a short-circuit `and` guarding a `.item()` read, a dict of `torch.where` triples filled in one loop and
read in another, 2-D advanced-index gathers `x[b, t]` and an in-place advanced-index `+=` with a `.unsqueeze(0).T`
weight column, a 4-tuple return with an info dict, and init-time prints.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._shell import Source, tiny

SOURCE = Source(
    "Fsoft-AIC/CompeteSMoE",
    "moe_model/model/moe/competesmoe.py",
    "0be1cb775951b4697aa646dbbe48999c8b41bdfa",
    "CompeteSMoE.forward",
)
HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 4, 2

# --- register.py -------------------------------------------------------------------------------------------

MOE_REGISTRY = {}


def register_moe(*names):
    def decorate(cls):
        for name in names:
            if name in MOE_REGISTRY:
                if MOE_REGISTRY[name] != cls:
                    assert name not in MOE_REGISTRY, f"MoE named '{name}' is already registered"
            MOE_REGISTRY[name] = cls

    return decorate  # `decorate` returns None: the decorated class name is bound to None


def get_moe(model_name):
    try:
        return MOE_REGISTRY[model_name]
    except KeyError as error:
        raise ValueError(f"no MoE registered as '{model_name}'; known: {', '.join(MOE_REGISTRY)}") from error


# --- moe.py ---------------------------------------------------------------------------------------------------


class MoeLayer(nn.Module):
    def __init__(
        self, in_embed_dim=768, out_embed_dim=768, num_of_experts=4, num_selected=2, expert=None, args=None
    ):
        super().__init__()
        self.in_embed_dim = in_embed_dim
        self.out_embed_dim = out_embed_dim
        self.num_of_experts = num_of_experts
        self.num_selected = num_selected
        self.aux_loss = {"zloss": self.zloss, "balanceloss": self.balanceloss}
        if expert is None:
            self.experts = nn.ModuleList(
                [
                    nn.Sequential(
                        nn.Linear(in_embed_dim, out_embed_dim),
                        nn.GELU(),
                        nn.Linear(out_embed_dim, out_embed_dim),
                    )
                    for _ in range(num_of_experts)
                ]
            )
        elif isinstance(expert, nn.ModuleList):
            print("Training from scratch ...")
            self.experts = expert
        else:
            self.experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(self.num_of_experts)])
        self.gate = nn.Linear(in_embed_dim, num_of_experts, bias=False)
        self.args = args
        self.is_vision = False
        self.log_metrics = {}

    def init_gate_weights(self, std=0.02):
        if getattr(self.args, "init_weight", True) is False:
            print("Not init weight")
            return
        device = (
            self.gate.weight.device
            if self.gate.weight.device != torch.device("meta")
            else torch.device("cpu")
        )
        generator = torch.Generator(device=device)
        generator.manual_seed(42)
        nn.init.normal_(self.gate.weight, mean=0.0, std=std, generator=generator)
        if self.gate.bias is not None:
            nn.init.constant_(self.gate.bias, 0.0)
        print(f"Initialized the gate's weights on {device}")

    def zloss(self, gate_logits, gate_softmax=None):
        raise NotImplementedError("training-only loss, not mirrored")

    def balanceloss(self, selected_experts, gate_softmax):
        raise NotImplementedError("training-only loss, not mirrored")

    def combine_loss(self, selected_experts, gate_softmax, gate_logits, acitve_zloss=True):
        raise NotImplementedError("training-only loss, not mirrored")

    def topk_expert(self, gate_logits):
        gate_softmax = F.softmax(gate_logits, dim=-1, dtype=torch.float32)
        weights, selected_experts = torch.topk(gate_softmax, self.num_selected)
        return weights, selected_experts, gate_softmax

    def compute_moe(
        self, selected_experts, weights, results, x, expert_outputs=None, return_topk_outputs=False
    ):
        infor_experts = {}
        B, N, D = x.shape

        # where does each expert appear: (batch, token, slot) index triples
        for i in range(len(self.experts)):
            batch_idx, token_idx, topk_idx = torch.where(selected_experts == i)
            infor_experts[i] = [batch_idx, token_idx, topk_idx]
        if return_topk_outputs:
            raise NotImplementedError("the diversity-loss path is training-only, not mirrored")

        is_expert = expert_outputs is not None
        for i, expert in enumerate(self.experts):
            batch_idx, token_idx, topk_idx = infor_experts[i]
            if is_expert:
                out_exp = expert_outputs[i][batch_idx, token_idx]
            else:
                out_exp = expert(x[batch_idx, token_idx])
            results[batch_idx, token_idx] += weights[batch_idx, token_idx, topk_idx].unsqueeze(0).T * out_exp
        return results


# --- competesmoe.py -------------------------------------------------------------------------------------------


@register_moe("competesmoe")
class CompeteSMoE(MoeLayer):
    def __init__(
        self, in_embed_dim=768, out_embed_dim=768, num_of_experts=4, num_selected=2, expert=None, args=None
    ):
        super().__init__(in_embed_dim, out_embed_dim, num_of_experts, num_selected, expert, args)
        if args is None or not hasattr(args, "rate_flip"):
            raise ValueError("The 'args' parameter must have the attribute 'rate_flip'.")
        if not hasattr(args, "warm_up"):
            raise ValueError("The 'args' parameter must include 'warm_up'.")
        self.warm_up = args.warm_up
        self.rate_flip = args.rate_flip
        self.total_steps = None
        self.current_steps = 0
        self.step_warm = None
        self.is_prob_flips = True
        for flag, what in (("is_cosine", "Consine"), ("hybrid", "Hybrid"), ("is_norm_weight", "Norm Weight")):
            if getattr(self.args, flag, False):
                print(f"Active {what} Method")
        if getattr(self.args, "norm_softmax", False):
            print("Active Norm Softmax Method")
        self.register_buffer("prob_flips", torch.zeros(15801))
        self.init_gate_weights()

    def router_policy(self, x):
        gate_logits = self.gate(x)
        weights, selected_experts, gate_softmax = self.topk_expert(gate_logits=gate_logits)
        weights = weights / torch.sum(weights, dim=-1, keepdim=True).to(x.dtype)
        return weights, selected_experts, gate_softmax, gate_logits

    def competition_policy(self, x):
        raise NotImplementedError("the competition branch runs only in training, not mirrored")

    def forward(self, x, return_id_experts=False, is_vision=False):
        output = torch.zeros(x.shape[0], x.shape[1], self.out_embed_dim, device=x.device, dtype=x.dtype)
        gate_weights, gate_selected_experts, gate_softmax, gate_logits = self.router_policy(x)
        auxiliary_loss = torch.tensor(0.0, device=x.device, dtype=x.dtype)
        balance_loss = torch.tensor(0.0, device=x.device, dtype=x.dtype)
        infor_aux = {}

        if (
            x.requires_grad
            and self.current_steps >= self.step_warm
            and self.prob_flips[self.current_steps - self.step_warm].item() == 1
        ):
            # competition: every expert scores every token (training only)
            self.competition_policy(x)
        else:
            output = self.compute_moe(
                weights=gate_weights, selected_experts=gate_selected_experts, results=output, x=x
            )
            if x.requires_grad or return_id_experts:
                auxiliary_loss, balance_loss, router_z_loss = self.combine_loss(
                    selected_experts=gate_selected_experts, gate_softmax=gate_softmax, gate_logits=gate_logits
                )
                infor_aux = {
                    "balance_loss": balance_loss.clone().detach(),
                    "router_z_loss": router_z_loss.clone().detach(),
                }
        return output, auxiliary_loss, None, infor_aux


# --- siglip_smoe.py -------------------------------------------------------------------------------------------


class SiglipMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.activation_fn = nn.GELU(approximate="tanh")  # ACT2FN["gelu_pytorch_tanh"]
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, hidden_states):
        hidden_states = self.fc1(hidden_states)
        hidden_states = self.activation_fn(hidden_states)
        hidden_states = self.fc2(hidden_states)
        return hidden_states


class SiglipEncoderMoEHalf(nn.Module):
    """The MoE half of `SiglipEncoderMoELayer`: after `layer_norm2`, the MoE layer; the shell adds the residual."""

    def __init__(self, config, args):
        super().__init__()
        self.embed_dim = config.hidden_size
        if args.sparse_upcycling:
            expert = SiglipMLP(config)
        else:
            expert = nn.ModuleList([SiglipMLP(config) for _ in range(config.num_experts)])
        self.moelayer = get_moe(config.moe_name)(
            in_embed_dim=self.embed_dim,
            out_embed_dim=self.embed_dim,
            num_of_experts=config.num_experts,
            num_selected=config.num_selected,
            expert=expert,
            args=args,
        )

    def forward(self, hidden_states, return_id_experts=False):
        results, auxiliary_loss, id_experts, infor_aux = self.moelayer(
            hidden_states, return_id_experts, is_vision=True
        )
        return results


ARGS = SimpleNamespace(
    moe_name="competesmoe",
    num_experts=EXPERTS,
    num_selected=TOP_K,
    sparse_upcycling=True,
    rate_flip=0.05,
    warm_up=0.05,
    init_weight=False,
    balance_loss_coef=0.01,
    router_z_loss_coef=0.001,
)
CONFIG = SimpleNamespace(
    hidden_size=HIDDEN,
    intermediate_size=INTER,
    hidden_act="gelu_pytorch_tanh",
    moe_name=ARGS.moe_name,
    num_experts=ARGS.num_experts,
    num_selected=ARGS.num_selected,
)


def build():
    return tiny(lambda: SiglipEncoderMoEHalf(CONFIG, ARGS), HIDDEN)
