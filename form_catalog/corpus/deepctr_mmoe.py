"""DeepCTR-Torch's MMOE: multi-gate mixture of experts for multitask CTR, a dense mixture (no top-k).

Mirrors shenweichen/DeepCTR-Torch `deepctr_torch/models/multitask/mmoe.py` at commit f685425 (`MMOE.__init__`,
`MMOE.forward`), with `DNN` and `PredictionLayer` from `deepctr_torch/layers/core.py` and the `'relu'` case of
`activation_layer` from `deepctr_torch/layers/activation.py`. From the combined DNN input [B, D] the forward
runs every expert (a `DNN`: Linear, optional BatchNorm1d behind `if self.use_bn`, ReLU(inplace=True), Dropout,
per hidden layer) in a Python loop `for i in range(self.num_experts)`, appends to a list and `torch.stack`s
it on dim 1 to [B, E, U]. For each task, in a second loop, the gate is a `DNN` followed by a bias-free Linear
to E logits (only the Linear when `gate_dnn_hidden_units` is empty, a `len(...) > 0` branch), softmaxed over
dim 1, unsqueezed to [B, 1, E] and `torch.matmul`-ed with the stacked expert outputs; the [B, 1, U] result
goes through a bare `.squeeze()`. A third loop runs each task's tower (`DNN` then a bias-free Linear to one
logit, or only the Linear when `tower_dnn_hidden_units` is empty) and its `PredictionLayer`, which adds a
scalar bias in place (`output += self.bias`) and applies a sigmoid for "binary" tasks; the task outputs are
`torch.cat`-ed on the last dim to [B, num_tasks]. Every expert runs on every input: there is no routing.
The model takes 2-D input, so a wrapper flattens [B, S, H] to [B*S, H] and returns the first task's
column reshaped to [B, S, 1] (it broadcasts in the shell's residual add).
Left out: the feature-column front end (`BaseModel`, `input_from_feature_columns`, the embedding dict and
`combined_dnn_input`): `MMOE.forward` takes the already-concatenated dense input tensor [B, hidden], and
`input_dim` is a constructor argument in place of `compute_input_dim(dnn_feature_columns)`; the L2
regularisation bookkeeping (`add_regularization_weight`, training-only) and `device` moves. The activation
lookup becomes `nn.ReLU(inplace=True)`, the one `dnn_activation="relu"` (the default) selects; the DNN's
`nn.init.normal_` init is kept but overwritten by the corpus weights. The real defaults are 3 experts with
expert units (256, 128), gate (64,), tower (64,), two binary tasks.
Constructs: three Python loops over experts / tasks with list appends, `torch.stack` of all expert outputs,
`len(units) > 0` config branches, softmax gate `torch.matmul` combine over all experts, a bare `.squeeze()`,
`if self.use_bn` and task-string branches, in-place `+=` of a parameter and in-place ReLU, `torch.cat`.
"""

from __future__ import annotations

import torch
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("shenweichen/DeepCTR-Torch", "deepctr_torch/models/multitask/mmoe.py",
                "f6854257b1fc29caab655ce72c6b5528b7432574", "MMOE.forward")
HIDDEN, INTER, EXPERTS = 16, 8, 4
EXPERT_UNITS, GATE_UNITS, TOWER_UNITS = (HIDDEN, INTER), (INTER,), (INTER,)


class DNN(nn.Module):
    def __init__(self, inputs_dim, hidden_units, dropout_rate=0, use_bn=False, init_std=0.0001):
        super().__init__()
        self.dropout_rate = dropout_rate
        self.dropout = nn.Dropout(dropout_rate)
        self.use_bn = use_bn
        if len(hidden_units) == 0:
            raise ValueError("hidden_units must not be empty")
        hidden_units = [inputs_dim] + list(hidden_units)
        self.linears = nn.ModuleList(
            [nn.Linear(hidden_units[i], hidden_units[i + 1]) for i in range(len(hidden_units) - 1)])
        if self.use_bn:
            self.bn = nn.ModuleList([nn.BatchNorm1d(hidden_units[i + 1]) for i in range(len(hidden_units) - 1)])
        self.activation_layers = nn.ModuleList([nn.ReLU(inplace=True) for _ in range(len(hidden_units) - 1)])
        for name, tensor in self.linears.named_parameters():
            if "weight" in name:
                nn.init.normal_(tensor, mean=0, std=init_std)

    def forward(self, inputs):
        deep_input = inputs
        for i in range(len(self.linears)):
            fc = self.linears[i](deep_input)
            if self.use_bn:
                fc = self.bn[i](fc)
            fc = self.activation_layers[i](fc)
            fc = self.dropout(fc)
            deep_input = fc
        return deep_input


class PredictionLayer(nn.Module):
    def __init__(self, task="binary", use_bias=True):
        if task not in ["binary", "multiclass", "regression"]:
            raise ValueError("task must be binary, multiclass or regression")
        super().__init__()
        self.use_bias = use_bias
        self.task = task
        if self.use_bias:
            self.bias = nn.Parameter(torch.zeros((1,)))

    def forward(self, X):
        output = X
        if self.use_bias:
            output += self.bias
        if self.task == "binary":
            output = torch.sigmoid(output)
        return output


class MMOE(nn.Module):
    def __init__(self, input_dim=HIDDEN, num_experts=EXPERTS, expert_dnn_hidden_units=EXPERT_UNITS,
                 gate_dnn_hidden_units=GATE_UNITS, tower_dnn_hidden_units=TOWER_UNITS, init_std=0.0001,
                 dnn_dropout=0, dnn_use_bn=False, task_types=("binary", "binary"), task_names=("ctr", "ctcvr")):
        super().__init__()
        self.num_tasks = len(task_names)
        if self.num_tasks <= 1:
            raise ValueError("need more than one task")
        if num_experts <= 1:
            raise ValueError("need more than one expert")
        if len(task_types) != self.num_tasks:
            raise ValueError("one task type per task")
        for task_type in task_types:
            if task_type not in ["binary", "regression"]:
                raise ValueError(f"unsupported task type {task_type}")

        self.num_experts = num_experts
        self.task_names = task_names
        self.input_dim = input_dim
        self.expert_dnn_hidden_units = expert_dnn_hidden_units
        self.gate_dnn_hidden_units = gate_dnn_hidden_units
        self.tower_dnn_hidden_units = tower_dnn_hidden_units

        self.expert_dnn = nn.ModuleList([
            DNN(self.input_dim, expert_dnn_hidden_units, dropout_rate=dnn_dropout, use_bn=dnn_use_bn,
                init_std=init_std) for _ in range(self.num_experts)])

        if len(gate_dnn_hidden_units) > 0:
            self.gate_dnn = nn.ModuleList([
                DNN(self.input_dim, gate_dnn_hidden_units, dropout_rate=dnn_dropout, use_bn=dnn_use_bn,
                    init_std=init_std) for _ in range(self.num_tasks)])
        self.gate_dnn_final_layer = nn.ModuleList([
            nn.Linear(gate_dnn_hidden_units[-1] if len(gate_dnn_hidden_units) > 0 else self.input_dim,
                      self.num_experts, bias=False) for _ in range(self.num_tasks)])

        if len(tower_dnn_hidden_units) > 0:
            self.tower_dnn = nn.ModuleList([
                DNN(expert_dnn_hidden_units[-1], tower_dnn_hidden_units, dropout_rate=dnn_dropout,
                    use_bn=dnn_use_bn, init_std=init_std) for _ in range(self.num_tasks)])
        self.tower_dnn_final_layer = nn.ModuleList([
            nn.Linear(tower_dnn_hidden_units[-1] if len(tower_dnn_hidden_units) > 0 else expert_dnn_hidden_units[-1],
                      1, bias=False) for _ in range(self.num_tasks)])

        self.out = nn.ModuleList([PredictionLayer(task) for task in task_types])

    def forward(self, dnn_input):
        expert_outs = []
        for i in range(self.num_experts):
            expert_out = self.expert_dnn[i](dnn_input)
            expert_outs.append(expert_out)
        expert_outs = torch.stack(expert_outs, 1)

        mmoe_outs = []
        for i in range(self.num_tasks):
            if len(self.gate_dnn_hidden_units) > 0:
                gate_dnn_out = self.gate_dnn[i](dnn_input)
                gate_dnn_out = self.gate_dnn_final_layer[i](gate_dnn_out)
            else:
                gate_dnn_out = self.gate_dnn_final_layer[i](dnn_input)
            gate_mul_expert = torch.matmul(gate_dnn_out.softmax(1).unsqueeze(1), expert_outs)
            mmoe_outs.append(gate_mul_expert.squeeze())

        task_outs = []
        for i in range(self.num_tasks):
            if len(self.tower_dnn_hidden_units) > 0:
                tower_dnn_out = self.tower_dnn[i](mmoe_outs[i])
                tower_dnn_logit = self.tower_dnn_final_layer[i](tower_dnn_out)
            else:
                tower_dnn_logit = self.tower_dnn_final_layer[i](mmoe_outs[i])
            output = self.out[i](tower_dnn_logit)
            task_outs.append(output)
        task_outs = torch.cat(task_outs, -1)
        return task_outs


class FlatCaller(nn.Module):
    """Feeds the model [B*S, H] rows as its callers feed [B, D] samples; returns the first task as [B, S, 1]."""

    def __init__(self):
        super().__init__()
        self.mmoe = MMOE()

    def forward(self, x):
        task_outs = self.mmoe(x.reshape(-1, x.size(-1)))
        return task_outs[:, :1].view(*x.shape[:-1], 1)


def build():
    return tiny(FlatCaller, HIDDEN)
