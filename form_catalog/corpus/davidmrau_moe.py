"""davidmrau's `MoE`: Shazeer noisy top-k gating with a `SparseDispatcher` (nonzero sort, `.tolist()` split).

Mirrors davidmrau/mixture-of-experts `moe.py` at commit 0b67cc0 (`MoE.forward`, `MoE.noisy_top_k_gating`,
`MoE.cv_squared`, `MoE._gates_to_load`, `MoE._prob_in_top_k`, `SparseDispatcher`, `MLP`), a PyTorch port of
tensor2tensor's expert_utils. The gate is `x @ w_gate` ([H, E] parameter); in training (`noisy_gating and
train`, the layer passing `self.training`) it adds Gaussian noise scaled by softplus(x @ w_noise) + 1e-2.
It takes the top k+1 logits, softmaxes the first k and scatters them into a dense [T, E] gates tensor
created with `requires_grad=True`; the load is the probability-in-top-k estimate in training and the count
of nonzero gates otherwise; importance and load feed a squared-coefficient-of-variation loss (with a
`shape[0] == 1` early return). A `SparseDispatcher` object is built in the forward: it sorts
`torch.nonzero(gates)` by expert, keeps the token index of each (token, expert) pair, reads the per-expert
sizes on the host with `(gates > 0).sum(0).tolist()` and gathers each pair's gate. `dispatch` gathers the
tokens in expert order and `torch.split`s them by the sizes; a list comprehension runs every expert
(empty inputs included) -- each a Linear-ReLU-Linear MLP ending in a softmax over features; `combine`
exponentiates the concatenated outputs (the original treats them as log-space), multiplies by the gates,
`index_add`s them per token into zeros created with `requires_grad=True`, replaces exact zeros by machine
epsilon through boolean-mask assignment and returns the log. The layer is fed [T, H] by its callers, so a
wrapper flattens [B, S, H] to [T, H] and back, as `example.py` does with flat batches.
Left out: nothing of the forward; `np.finfo(float).eps` is written as `torch.finfo(torch.float64).eps`
(the same number) because the corpus imports only torch.
Constructs: a Python helper object built in forward, `torch.nonzero` + sort gathers, `.tolist()` split
sizes, a list comprehension over all experts, boolean-mask assignment, `if ... and train` noise branch,
a shape-based early return in the loss, `requires_grad=True` tensors created in forward.
"""

from __future__ import annotations

import torch
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("davidmrau/mixture-of-experts", "moe.py", "0b67cc0aac626c477d80879c46b4eaeccf424e94", "MoE.forward")
HIDDEN, EXPERT_HIDDEN, EXPERTS, TOP_K = 16, 8, 8, 2


class SparseDispatcher:
    def __init__(self, num_experts, gates):
        self._gates = gates
        self._num_experts = num_experts
        pairs, order = torch.nonzero(gates).sort(0)
        _, self._expert_index = pairs.split(1, dim=1)
        self._batch_index = torch.nonzero(gates)[order[:, 1], 0]
        self._part_sizes = (gates > 0).sum(0).tolist()
        self._nonzero_gates = torch.gather(gates[self._batch_index.flatten()], 1, self._expert_index)

    def dispatch(self, inp):
        return torch.split(inp[self._batch_index].squeeze(1), self._part_sizes, dim=0)

    def combine(self, expert_out, multiply_by_gates=True):
        stitched = torch.cat(expert_out, 0).exp()
        if multiply_by_gates:
            stitched = stitched.mul(self._nonzero_gates)
        zeros = torch.zeros(self._gates.size(0), expert_out[-1].size(1), requires_grad=True, device=stitched.device)
        combined = zeros.index_add(0, self._batch_index, stitched.float())
        combined[combined == 0] = torch.finfo(torch.float64).eps
        return combined.log()

    def expert_to_gates(self):
        return torch.split(self._nonzero_gates, self._part_sizes, dim=0)


class MLP(nn.Module):
    def __init__(self, input_size, output_size, hidden_size):
        super().__init__()
        self.fc1 = nn.Linear(input_size, hidden_size)
        self.fc2 = nn.Linear(hidden_size, output_size)
        self.relu = nn.ReLU()
        self.soft = nn.Softmax(1)

    def forward(self, x):
        return self.soft(self.fc2(self.relu(self.fc1(x))))


class MoE(nn.Module):
    def __init__(self, input_size=HIDDEN, output_size=HIDDEN, num_experts=EXPERTS, hidden_size=EXPERT_HIDDEN,
                 noisy_gating=True, k=TOP_K):
        super().__init__()
        self.noisy_gating, self.num_experts, self.k = noisy_gating, num_experts, k
        self.input_size, self.output_size, self.hidden_size = input_size, output_size, hidden_size
        self.experts = nn.ModuleList(MLP(input_size, output_size, hidden_size) for _ in range(num_experts))
        self.w_gate = nn.Parameter(torch.zeros(input_size, num_experts), requires_grad=True)
        self.w_noise = nn.Parameter(torch.zeros(input_size, num_experts), requires_grad=True)
        self.softplus = nn.Softplus()
        self.softmax = nn.Softmax(1)
        self.register_buffer("mean", torch.tensor([0.0]))
        self.register_buffer("std", torch.tensor([1.0]))
        assert self.k <= self.num_experts

    def cv_squared(self, x):
        if x.shape[0] == 1:
            return torch.tensor([0], device=x.device, dtype=x.dtype)
        return x.float().var() / (x.float().mean() ** 2 + 1e-10)

    def _gates_to_load(self, gates):
        return (gates > 0).sum(0)

    def _prob_in_top_k(self, clean, noisy, noise_std, noisy_top):
        batch, m = clean.size(0), noisy_top.size(1)
        flat_top = noisy_top.flatten()
        pos_in = torch.arange(batch, device=clean.device) * m + self.k
        thr_in = torch.unsqueeze(torch.gather(flat_top, 0, pos_in), 1)
        is_in = torch.gt(noisy, thr_in)
        thr_out = torch.unsqueeze(torch.gather(flat_top, 0, pos_in - 1), 1)
        normal = torch.distributions.Normal(self.mean, self.std)
        p_in = normal.cdf((clean - thr_in) / noise_std)
        p_out = normal.cdf((clean - thr_out) / noise_std)
        return torch.where(is_in, p_in, p_out)

    def noisy_top_k_gating(self, x, train, noise_epsilon=1e-2):
        clean = x @ self.w_gate
        if self.noisy_gating and train:
            noise_std = self.softplus(x @ self.w_noise) + noise_epsilon
            noisy = clean + torch.randn_like(clean) * noise_std
            logits = noisy
        else:
            logits = clean
        top_logits, top_idx = logits.topk(min(self.k + 1, self.num_experts), dim=1)
        k_logits, k_idx = top_logits[:, :self.k], top_idx[:, :self.k]
        k_gates = self.softmax(k_logits)
        gates = torch.zeros_like(logits, requires_grad=True).scatter(1, k_idx, k_gates)
        if self.noisy_gating and self.k < self.num_experts and train:
            load = self._prob_in_top_k(clean, noisy, noise_std, top_logits).sum(0)
        else:
            load = self._gates_to_load(gates)
        return gates, load

    def forward(self, x, loss_coef=1e-2):
        gates, load = self.noisy_top_k_gating(x, self.training)
        importance = gates.sum(0)
        loss = self.cv_squared(importance) + self.cv_squared(load)
        loss *= loss_coef
        dispatcher = SparseDispatcher(self.num_experts, gates)
        inputs = dispatcher.dispatch(x)
        gates = dispatcher.expert_to_gates()
        outputs = [self.experts[i](inputs[i]) for i in range(self.num_experts)]
        return dispatcher.combine(outputs), loss


class FlatCaller(nn.Module):
    """Feeds the layer [T, H] as its callers do and restores [B, S, H]."""

    def __init__(self):
        super().__init__()
        self.moe = MoE()

    def forward(self, x):
        y, loss = self.moe(x.reshape(-1, x.size(-1)))
        return y.view(x.shape), loss


def build():
    return tiny(FlatCaller, HIDDEN)
