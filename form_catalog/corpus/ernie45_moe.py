"""ERNIE-4.5-21B-A3B's `Ernie4_5_MoeSparseMoeBlock` as transformers ships it: a float32 router under
`autocast(enabled=False)`, a correction bias applied through a parameter-only module, a
`nonzero()`-row loop that indexes a ModuleList with a tensor, and shared experts computed first.

Mirrors huggingface/transformers `src/transformers/models/ernie4_5_moe/modeling_ernie4_5_moe.py` at commit
01187e2 (`Ernie4_5_MoeMLP`, `Ernie4_5_MoeStatics`, `Ernie4_5_MoeSparseMoeBlock`), the newest stored version,
which is what `AutoModelForCausalLM` runs for baidu/ERNIE-4.5-21B-A3B-PT without remote code. Baidu's own
hub remote code (`modeling_ernie4_5_moe.py` in the -PT repository: a capacity-bounded `moe_gate_dispatch`
with a per-token, per-route Python loop of `.item()` reads) was seen only in copies whose repository and
commit could not be told apart in the stored index, so it is not mirrored here; the PaddlePaddle/ERNIE
GitHub repository is Paddle code, not PyTorch.
The block views the tokens [T, H] and, when `shared_experts` is not None (two shared experts here, as in
the checkpoint), runs them first. It picks the device type (a Python conditional on the device's type
string), and inside `torch.autocast(device_type, enabled=False)` scores the float32 tokens with a bias-free
float32 `nn.Linear` gate, softmaxes in float32, takes the top-k of `moe_statics(probs)` (the
parameter-only module's forward adds its [1, E] `e_score_correction_bias` Parameter, squeezed), gathers
the unbiased probabilities, divides them by their sum clamped at `moe_norm_min` (1e-12) and casts them to
the token dtype. It starts a zero [T, H] buffer, builds `one_hot(ids, E).permute(2, 1, 0)`, takes
`expert_hit = greater(mask.sum((-1, -2)), 0).nonzero()` and loops over its rows: `self.experts[expert_idx]`
indexes the ModuleList with the one-element tensor row, `torch.where(mask[expert_idx].squeeze(0))` gives
(slot, token) ids, the tokens are gathered as `hidden[None, top_x].reshape(-1, H)`, run through the SwiGLU
expert, multiplied by `routing_weights[top_x, idx, None]` and `index_add_`-ed into the buffer with a dtype
cast. The shared output is added, the buffer reshaped to [B, S, H], and the block returns
(output, router_logits). Tiny sizes: 8 experts, top-2, width 8 (the checkpoint: 64 experts, top-6, width
1536, two shared experts, kept); "silu" and no biases (`use_bias` False) kept. The correction bias is a
Parameter (requires_grad False), so the tiny model's weight draw fills it like any other.
Left out: the config's attention / rope fields and the `PretrainedConfig` base (a plain local class carries
the fields the layer reads), the decoder layer's `moe_layer_start_index` / `interval` choice of MoE versus
dense MLP (this layer is an MoE one) and the `OutputRecorder` that collects the router logits; nothing in the
layer is distributed.
Constructs: shared experts under `if ... is not None` before routing, a device-type string conditional,
`with torch.autocast(..., enabled=False)`, a module whose forward adds a frozen Parameter, top-k on biased
probabilities with an unbiased `gather`, `torch.clamp(min=...)` normalisation, a loop over the rows of a
`nonzero()` tensor, a ModuleList indexed by a tensor, `torch.where(mask)`, `index_add_`, a tuple return.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source(
    "huggingface/transformers",
    "src/transformers/models/ernie4_5_moe/modeling_ernie4_5_moe.py",
    "01187e21cda13b3f08fdb45b7e32b78d173d702a",
    "Ernie4_5_MoeSparseMoeBlock.forward",
)
HIDDEN, MOE_INTER, EXPERTS, TOP_K, SHARED = 16, 8, 8, 2, 2


class Ernie4_5_MoeConfig:  # noqa: N801 - the original's name
    """The fields the MoE layer reads (ERNIE-4.5-21B-A3B-PT's values where the tiny sizes allow)."""

    def __init__(self):
        self.hidden_size = HIDDEN
        self.intermediate_size = 4 * HIDDEN
        self.moe_intermediate_size = MOE_INTER
        self.moe_num_experts = EXPERTS
        self.moe_k = TOP_K
        self.moe_num_shared_experts = SHARED
        self.moe_norm_min = 1e-12
        self.use_bias = False
        self.hidden_act = "silu"


class Ernie4_5_MoeMLP(nn.Module):  # noqa: N801 - the original's name
    def __init__(self, config, intermediate_size=None):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = (
            intermediate_size if intermediate_size is not None else config.intermediate_size
        )
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=config.use_bias)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=config.use_bias)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=config.use_bias)
        self.act_fn = nn.SiLU()  # ACT2FN["silu"]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Ernie4_5_MoeStatics(nn.Module):  # noqa: N801 - the original's name
    """Holds the gating correction bias ("statics" sic); its forward adds it (a tensor-parallel workaround)."""

    def __init__(self, num_experts_groups, num_experts):
        super().__init__()
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(num_experts_groups, num_experts, dtype=torch.float32), requires_grad=False
        )

    def forward(self, hidden_states):
        return hidden_states + self.e_score_correction_bias.squeeze()


class Ernie4_5_MoeSparseMoeBlock(nn.Module):  # noqa: N801 - the original's name
    def __init__(self, config=None, num_experts=EXPERTS, intermediate_size=MOE_INTER):
        super().__init__()
        config = config or Ernie4_5_MoeConfig()
        self.num_experts = num_experts
        self.top_k = config.moe_k
        self.moe_statics = Ernie4_5_MoeStatics(num_experts_groups=1, num_experts=self.num_experts)
        self.gate = nn.Linear(config.hidden_size, self.num_experts, bias=False, dtype=torch.float32)
        self.experts = nn.ModuleList(
            [Ernie4_5_MoeMLP(config, intermediate_size) for _ in range(self.num_experts)]
        )
        self.norm_min = config.moe_norm_min
        self.shared_experts = None
        if config.moe_num_shared_experts > 0:
            self.shared_experts = Ernie4_5_MoeMLP(config, intermediate_size * config.moe_num_shared_experts)

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        if self.shared_experts is not None:
            shared_output = self.shared_experts(hidden_states)

        device_type = (
            hidden_states.device.type
            if isinstance(hidden_states.device.type, str) and hidden_states.device.type != "mps"
            else "cpu"
        )
        with torch.autocast(device_type=device_type, enabled=False):
            router_logits = self.gate(hidden_states.float())
            routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
            _, selected_experts = torch.topk(self.moe_statics(routing_weights), self.top_k, dim=-1)
            routing_weights = torch.gather(routing_weights, dim=-1, index=selected_experts)
            routing_weights = routing_weights / torch.clamp(
                routing_weights.sum(dim=-1, keepdim=True), min=self.norm_min
            )
            routing_weights = routing_weights.to(hidden_states.dtype)

        final = torch.zeros(
            (batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype, device=hidden_states.device
        )
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current = expert_layer(current_state) * routing_weights[top_x, idx, None]
            final.index_add_(0, top_x, current.to(hidden_states.dtype))

        if self.shared_experts is not None:
            final = final + shared_output
        return final.reshape(batch_size, sequence_length, hidden_dim), router_logits


def build():
    return tiny(Ernie4_5_MoeSparseMoeBlock, HIDDEN)
