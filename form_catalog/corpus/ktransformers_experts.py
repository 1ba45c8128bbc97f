"""ktransformers' KDeepseekV2MoE with the pure-PyTorch `KExpertsTorch` experts: a one-hot `torch.where` loop.

Mirrors kvcache-ai/ktransformers `ktransformers/operators/experts.py` at commit 582738a (`KExpertsBase`,
`KExpertsTorch`, `KTransformersExperts`, `KDeepseekV2MoE.forward`, `KDeepseekV2MoE.moe_kexperts`), the last
commit with the file at that path (the 57d14d2 restructure moved it unchanged to `archive/`, where it still is
at the newest snapshot read, 95009ea), with the gate and MLP it inherits from
`ktransformers/models/modeling_deepseek.py` (`MoEGate`, `DeepseekV2MLP`; the DeepSeek-V2 rules leave the gate
un-injected). This is the path where the torch experts really run: with layer-wise prefill,
`KDeepseekV2Model.load_layer_to(layer, InferenceState.PREFILL)` calls `experts.set_inference_mode(PREFILL)`,
and the DeepSeek-V2 rules name `KExpertsTorch` as the prefill op (here on "cpu" rather than "cuda").
The gate flattens [B, S, H] to tokens, scores a float32 `F.linear` (input and weight upcast with `.type`),
softmaxes in float32 and ("group_limited_greedy", DeepSeek-V2-Chat's method) takes each group's max score,
keeps the best `topk_group` groups through a zeroed [n, n_group] mask filled by `scatter_`, expanded to
[n, E] and used to zero the other experts' scores (`masked_fill(~mask.bool(), 0.0)`), then the unsorted
top-k; with `norm_topk_prob` off (V2-Chat) the weights are multiplied by `routed_scaling_factor` (the
renormalising branch is kept); a training-only aux loss branch is kept and eval returns `aux_loss=None`.
The block keeps the input for the shared experts, flattens the tokens, tests the CUDA-graph decode guard
(`sequence_length == 1 and hasattr(generate_experts, "submit_for_one_decode") and ...`, false here: 7
tokens, and the torch experts have no such method), runs the shared experts (an MLP `n_shared_experts`
times the width) and `.squeeze(0)`s them, dispatches on `isinstance(self.experts, KExpertsBase)` to
`moe_kexperts` (under `@torch.no_grad()`), views the result to the input's shape, `.to(device=...)` and
adds the shared output in place (`y += y_`). The experts wrapper (an nn.Module) dispatches on its
`InferenceState` mode to its prefill op, a `KExpertsTorch`: a plain Python object (not an nn.Module)
holding the experts' gate/up/down weights as three stacked [E, out, in] tensors (not parameters), built at
load time by slicing each expert out of the loader's flat buffer and `torch.stack`-ing them. Its forward
moves inputs `.to(self.device)`, allocates a zero [T, H] buffer in the weights' dtype, casts the tokens and
weights to it, builds the [E, k, T] mask `one_hot(ids, num_classes=E).permute(2, 1, 0)`, and for every
expert (no empty-expert skip) takes `torch.where(mask[e])`, gathers `x[None, top_x].reshape(-1, H)`, runs
`act(x @ gate[e, ...].T) * (x @ up[e, ...].T) @ down[e, ...].T` times `w[top_x, idx, None]` and
`index_add_`s it into the buffer, which goes back `.to(dtype=org_dtype, device=org_device)`.
Left out: GGUF reading and dequantisation (a tiny in-memory loader, `TinyGGUFLoader`, holds each expert
tensor as one flat float32 buffer drawn at construction, scaled like the corpus weights from the seed tiny
sets, and returns expert i's slice viewed to [out, in] as the F32 path of `load_expert_tensor` does;
tiny's parameter init cannot reach the stacked weights, as they are not parameters); the `tqdm` progress bar
of `load`; `BaseInjectedModule`'s attribute forwarding to the wrapped `orig_module` (attributes live on the
modules directly) and the injection rules that build the block (its constructor builds the injected form
and calls `set_inference_mode(PREFILL)`, standing for `load_layer_to`); the un-injected ModuleList of
`DeepseekV2MLP` experts that `KTransformersExperts` wraps (only its length, `n_routed_experts`, is used);
`KExpertsCPU` (cpuinfer C++ extension) and `KExpertsMarlin` (CUDA), so the generate op is also
`KExpertsTorch`; the `elif`/`else` branches of the dispatch (`moe_infer`, `moe_infer_simple`, reached only
when the experts are not injected); the expert-parallel (`ep_size > 1`) attributes, one process here; the
shared experts' `KTransformersLinear` wrappers (their torch prefill op is a plain matmul; `nn.Linear` here).
The real DeepSeek-V2 has 160 experts in 8 groups (3 kept), top-6, 2 shared, scaling 16.
Constructs: an ABC base with `isinstance` dispatch, an Enum mode checked in forward with `assert`s, weights
as plain (non-parameter) tensors on a non-Module object, `.to(self.device)` moves and dtype casts, a
short-circuit `hasattr` / `torch.cuda` guard, `@torch.no_grad()` on a method, a loop over every expert with
`torch.where(mask[e])` (no empty skip), `[None, top_x]` gathers, `index_add_`, `scatter_` group mask,
`masked_fill`, `if self.training` gate branch, in-place `y += y_`.
"""

from __future__ import annotations

import enum
import math
from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
import torch.nn.init as init
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("kvcache-ai/ktransformers", "ktransformers/operators/experts.py",
                "582738a71137ec6ea1dbe21fbefedb452d4f6b3b", "KDeepseekV2MoE.forward")
HIDDEN, INTER, EXPERTS, TOP_K, SHARED, GROUPS, TOPK_GROUPS = 16, 8, 8, 2, 2, 4, 2


class DeepseekV2Config:
    def __init__(self, hidden_size=HIDDEN, moe_intermediate_size=INTER, n_routed_experts=EXPERTS,
                 n_shared_experts=SHARED, num_experts_per_tok=TOP_K, routed_scaling_factor=16.0,
                 scoring_func="softmax", aux_loss_alpha=0.001, seq_aux=True, topk_method="group_limited_greedy",
                 n_group=GROUPS, topk_group=TOPK_GROUPS, norm_topk_prob=False, hidden_act="silu"):
        self.hidden_size, self.moe_intermediate_size = hidden_size, moe_intermediate_size
        self.n_routed_experts, self.n_shared_experts = n_routed_experts, n_shared_experts
        self.num_experts_per_tok, self.routed_scaling_factor = num_experts_per_tok, routed_scaling_factor
        self.scoring_func, self.aux_loss_alpha, self.seq_aux = scoring_func, aux_loss_alpha, seq_aux
        self.topk_method, self.n_group, self.topk_group = topk_method, n_group, topk_group
        self.norm_topk_prob, self.hidden_act = norm_topk_prob, hidden_act


class InferenceState(enum.Enum):
    UNLOAD = 0
    PREFILL = 1
    GENERATE = 2
    RESTORE = 3


class TinyGGUFLoader:
    """Stand-in for the GGUF loader: one flat float32 buffer per expert tensor ("F32", one element a block)."""

    def __init__(self, key, experts, hidden, inter):
        self.tensor_info, self._data = {}, {}
        for suffix, (rows, cols) in ((".ffn_gate_exps.weight", (inter, hidden)),
                                     (".ffn_up_exps.weight", (inter, hidden)),
                                     (".ffn_down_exps.weight", (hidden, inter))):
            self.tensor_info[key + suffix] = {"shape": (cols, rows, experts)}  # GGUF order: innermost first
            self._data[key + suffix] = torch.randn(experts * rows * cols) / cols**0.5

    def get_mmap_tensor(self, name):
        return self._data[name]

    def load_expert_tensor(self, name, data, expert_id, elements_per_expert, device="cpu"):
        shape = self.tensor_info[name]["shape"]
        offset = expert_id * elements_per_expert
        values = data[offset: offset + elements_per_expert].to(device)
        return values.view(shape[-2::-1])


class DeepseekV2MLP(nn.Module):
    def __init__(self, config, hidden_size=None, intermediate_size=None):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size if hidden_size is None else hidden_size
        self.intermediate_size = config.moe_intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        act = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(act)


class MoEGate(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.top_k, self.n_routed_experts = config.num_experts_per_tok, config.n_routed_experts
        self.routed_scaling_factor, self.scoring_func = config.routed_scaling_factor, config.scoring_func
        self.alpha, self.seq_aux, self.topk_method = config.aux_loss_alpha, config.seq_aux, config.topk_method
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob, self.gating_dim = config.norm_topk_prob, config.hidden_size
        self.weight = nn.Parameter(torch.empty((self.n_routed_experts, self.gating_dim)))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, hidden_states):
        bsz, seq_len, h = hidden_states.shape
        hidden_states = hidden_states.view(-1, h)
        logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32), None)
        if self.scoring_func == "softmax":
            scores = logits.softmax(dim=-1, dtype=torch.float32)
        else:
            raise NotImplementedError(f"unsupported gate scoring function: {self.scoring_func}")

        if self.topk_method == "greedy":
            topk_weight, topk_idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        elif self.topk_method == "group_limited_greedy":
            group_scores = scores.view(bsz * seq_len, self.n_group, -1).max(dim=-1).values
            group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores)
            group_mask.scatter_(1, group_idx, 1)
            score_mask = (
                group_mask.unsqueeze(-1)
                .expand(bsz * seq_len, self.n_group, self.n_routed_experts // self.n_group)
                .reshape(bsz * seq_len, -1)
            )
            tmp_scores = scores.masked_fill(~score_mask.bool(), 0.0)
            topk_weight, topk_idx = torch.topk(tmp_scores, k=self.top_k, dim=-1, sorted=False)

        if self.top_k > 1 and self.norm_topk_prob:
            denominator = topk_weight.sum(dim=-1, keepdim=True) + 1e-20
            topk_weight = topk_weight / denominator
        else:
            topk_weight = topk_weight * self.routed_scaling_factor

        if self.training and self.alpha > 0.0:
            scores_for_aux, aux_topk = scores, self.top_k
            topk_idx_for_aux_loss = topk_idx.view(bsz, -1)
            if self.seq_aux:
                scores_for_seq_aux = scores_for_aux.view(bsz, seq_len, -1)
                ce = torch.zeros(bsz, self.n_routed_experts, device=hidden_states.device)
                ce.scatter_add_(
                    1, topk_idx_for_aux_loss, torch.ones(bsz, seq_len * aux_topk, device=hidden_states.device)
                ).div_(seq_len * aux_topk / self.n_routed_experts)
                aux_loss = (ce * scores_for_seq_aux.mean(dim=1)).sum(dim=1).mean() * self.alpha
            else:
                mask_ce = F.one_hot(topk_idx_for_aux_loss.view(-1), num_classes=self.n_routed_experts)
                ce = mask_ce.float().mean(0)
                pi = scores_for_aux.mean(0)
                fi = ce * self.n_routed_experts
                aux_loss = (pi * fi).sum() * self.alpha
        else:
            aux_loss = None
        return topk_idx, topk_weight, aux_loss


class KExpertsBase(ABC):
    def __init__(self, key, gguf_loader, config, orig_module, device="cuda", **kwargs):
        self.key = key
        self.gguf_loader = gguf_loader
        self.config = config
        self.device = device

    @abstractmethod
    def forward(self, input_tensor, expert_ids, weights):
        pass

    @abstractmethod
    def load(self, w=None, device="cpu", warmup=False):
        pass

    @abstractmethod
    def unload(self):
        pass


class KExpertsTorch(KExpertsBase):
    def __init__(self, key, gguf_loader, config, n_routed_experts, orig_module=None, device="cpu", **kwargs):
        super().__init__(key, gguf_loader, config, orig_module, device, **kwargs)
        self.expert_num = n_routed_experts
        self.act_fn = nn.SiLU()
        self.device = device
        self.elements_per_tensor = config.moe_intermediate_size * config.hidden_size
        self.gate = [None for _ in range(self.expert_num)]
        self.up = [None for _ in range(self.expert_num)]
        self.down = [None for _ in range(self.expert_num)]
        self.dtype = torch.get_default_dtype()

    def load(self, w=None, device=None, warmup=False):
        if device is None:
            device = self.device
        if w is None:
            w = self.load_weights()
            load_by_experts = True

        if load_by_experts:
            if isinstance(w, dict):
                for i in range(self.expert_num):
                    up = self.gguf_loader.load_expert_tensor(self.key + ".ffn_up_exps.weight", w["up"], i,
                                                             self.elements_per_tensor, device=self.device)
                    gate = self.gguf_loader.load_expert_tensor(self.key + ".ffn_gate_exps.weight", w["gate"], i,
                                                               self.elements_per_tensor, device=self.device)
                    down = self.gguf_loader.load_expert_tensor(self.key + ".ffn_down_exps.weight", w["down"], i,
                                                               self.elements_per_tensor, device=self.device)
                    self.up[i], self.gate[i], self.down[i] = up, gate, down
        else:
            if isinstance(w, dict):
                for i in range(self.expert_num):
                    self.gate[i] = w["gate"][i, ...].to(device=device, dtype=self.dtype)
                    self.up[i] = w["up"][i, ...].to(device=device, dtype=self.dtype)
                    self.down[i] = w["down"][i, ...].to(device=device, dtype=self.dtype)

        self.up = torch.stack(self.up, dim=0)
        self.gate = torch.stack(self.gate, dim=0)
        self.down = torch.stack(self.down, dim=0)

    def unload(self):
        if self.gate is not None:
            self.gate = None
            self.up = None
            self.down = None

    def load_weights(self, override_key=None):
        res = {}
        keys = override_key if override_key is not None else [self.key]
        gate = up = down = None
        for key in keys:
            if key + ".ffn_gate_exps.weight" in self.gguf_loader.tensor_info:
                gate = self.gguf_loader.get_mmap_tensor(key + ".ffn_gate_exps.weight")
                up = self.gguf_loader.get_mmap_tensor(key + ".ffn_up_exps.weight")
                down = self.gguf_loader.get_mmap_tensor(key + ".ffn_down_exps.weight")
            res = {"gate": gate, "up": up, "down": down}
        return res

    def forward(self, hidden_states_cpu, selected_experts_cpu, routing_weights_cpu):
        org_device = hidden_states_cpu.device
        hidden_states_cpu = hidden_states_cpu.to(self.device)
        selected_experts_cpu = selected_experts_cpu.to(self.device)
        routing_weights_cpu = routing_weights_cpu.to(self.device)

        batch_sequence_length, hidden_dim = hidden_states_cpu.size()
        final_hidden_states = torch.zeros(
            (batch_sequence_length, hidden_dim), dtype=self.gate.dtype, device=hidden_states_cpu.device
        )
        org_dtype = hidden_states_cpu.dtype
        hidden_states_cpu = hidden_states_cpu.to(self.gate.dtype)
        routing_weights_cpu = routing_weights_cpu.to(self.gate.dtype)
        expert_mask = F.one_hot(selected_experts_cpu, num_classes=self.expert_num).permute(2, 1, 0)

        for expert_idx in range(self.expert_num):
            idx, top_x = torch.where(expert_mask[expert_idx])
            current_state = hidden_states_cpu[None, top_x].reshape(-1, hidden_dim)
            g = current_state @ self.gate[expert_idx, ...].T
            a = self.act_fn(g)
            u = current_state @ self.up[expert_idx, ...].T
            h = a * u
            current_hidden_states = h @ self.down[expert_idx, ...].T * routing_weights_cpu[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x, current_hidden_states)

        return final_hidden_states.to(dtype=org_dtype, device=org_device)


EXPERTS_MAP = {"KExpertsTorch": KExpertsTorch}


class KTransformersExperts(nn.Module, KExpertsBase):
    def __init__(self, key, gguf_loader, config, n_experts, prefill_device="cpu", prefill_op="KExpertsTorch",
                 generate_device="cpu", generate_op="KExpertsTorch", **kwargs):
        nn.Module.__init__(self)
        KExpertsBase.__init__(self, key, gguf_loader, config, None, generate_device, **kwargs)
        self.prefill_device, self.generate_device = prefill_device, generate_device
        if generate_op is not None:
            self.generate_experts = EXPERTS_MAP[generate_op](key, gguf_loader, config, n_experts,
                                                             device=generate_device, **kwargs)
        else:
            self.generate_experts = None
        if prefill_op is not None:
            self.prefill_experts = EXPERTS_MAP[prefill_op](key, gguf_loader, config, n_experts,
                                                           device=prefill_device, **kwargs)
        else:
            self.prefill_experts = None
        self.gpu_mlp_type = prefill_op
        self.cpu_mlp_type = generate_op
        self.mode = InferenceState.UNLOAD

    def load(self, w=None, mode=None, warmup=True):
        if not mode:
            mode = InferenceState.GENERATE
        if mode == InferenceState.GENERATE:
            self.prefill_experts.unload()
            self.generate_experts.load(w, warmup=warmup)
            self.device = self.generate_experts.device
            self.mode = mode
        elif mode == InferenceState.PREFILL:
            self.generate_experts.unload()
            self.prefill_experts.load(w, warmup=warmup)
            self.device = self.prefill_experts.device
            self.mode = mode
        elif mode == InferenceState.UNLOAD:
            self.unload()
            self.mode = mode
            self.device = self.generate_experts.device
        else:
            raise ValueError("unknown inference mode")

    def unload(self):
        if self.generate_experts is not None:
            self.generate_experts.unload()
        if self.prefill_experts is not None:
            self.prefill_experts.unload()
        self.device = self.generate_experts.device

    def forward(self, input_tensor, expert_ids, weights):
        if self.mode == InferenceState.GENERATE:
            assert self.generate_experts is not None, "no generate experts"
            return self.generate_experts.forward(input_tensor, expert_ids, weights)
        elif self.mode == InferenceState.PREFILL:
            assert self.prefill_experts is not None, "no prefill experts"
            return self.prefill_experts.forward(input_tensor, expert_ids, weights)
        else:
            raise ValueError("experts used before a mode was set")

    def set_inference_mode(self, mode):
        if mode == InferenceState.GENERATE:
            self.load(mode=InferenceState.GENERATE, warmup=False)
        elif mode == InferenceState.PREFILL:
            self.load(mode=InferenceState.PREFILL, warmup=False)
        elif mode == InferenceState.UNLOAD:
            self.unload()
        else:
            raise ValueError("unknown inference mode")


class KDeepseekV2MoE(nn.Module):
    def __init__(self, config: DeepseekV2Config | None = None, key="blk.0"):
        super().__init__()
        config = config or DeepseekV2Config()
        self.config = config
        self.num_experts_per_tok = config.num_experts_per_tok
        self.gate = MoEGate(config)
        if config.n_shared_experts is not None:
            self.shared_experts = DeepseekV2MLP(
                config, intermediate_size=config.moe_intermediate_size * config.n_shared_experts
            )
        loader = TinyGGUFLoader(key, config.n_routed_experts, config.hidden_size, config.moe_intermediate_size)
        self.experts = KTransformersExperts(key, loader, config, config.n_routed_experts)
        self.experts.set_inference_mode(InferenceState.PREFILL)

    def forward(self, hidden_states):
        identity = hidden_states
        orig_shape = hidden_states.shape
        sequence_length = orig_shape[1]
        topk_idx, topk_weight, aux_loss = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])

        if (sequence_length == 1 and hasattr(self.experts.generate_experts, "submit_for_one_decode")
                and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            self.experts.generate_experts.submit_for_one_decode(hidden_states[0], topk_idx[0], topk_weight[0])
            if self.config.n_shared_experts is not None:
                y_ = self.shared_experts(identity).squeeze(0)
            y = self.experts.generate_experts.sync_for_one_decode().unsqueeze(0)
            y += y_
            y.resize_(*orig_shape)
            return y

        if self.config.n_shared_experts is not None:
            y_ = self.shared_experts(identity).squeeze(0)

        if isinstance(self.experts, KExpertsBase):
            y = self.moe_kexperts(hidden_states, topk_idx, topk_weight).view(*orig_shape).to(
                device=hidden_states.device)
        if self.config.n_shared_experts is not None:
            y += y_
        return y

    @torch.no_grad()
    def moe_kexperts(self, x, topk_ids, topk_weight):
        outs = self.experts(x, topk_ids, topk_weight)
        return outs


def build():
    return tiny(KDeepseekV2MoE, HIDDEN)
