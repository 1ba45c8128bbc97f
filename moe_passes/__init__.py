"""moe-passes: torch.compile passes that fuse Mixture-of-Experts layers into one kernel call.

`torch.compile(model, backend="hpu_moe")` rewrites each MoE layer the passes recognise into one call of
`torch.ops.hpu.mixture_of_experts` on Gaudi, or of its portable twin `torch.ops.moe_passes.mixture_of_experts`
elsewhere. `moe_passes.explain(model, *args)` says what happened.
"""

from . import (
    fused_op,  # noqa: F401  (registers torch.ops.moe_passes.mixture_of_experts)
    routing_op,  # noqa: F401  (registers torch.ops.moe_passes.softmax_topk)
)
from .adapters import adapt, install_discovery_hook, prepare
from .backend import hpu_moe
from .explain import explain, explaining
from .options import Options
from .pass_manager import BackendPass, GraphState
from .passes.pipeline import FORMS
from .report import Declined, Fused, Report

__all__ = [
    "FORMS",
    "BackendPass",
    "GraphState",
    "Declined",
    "Fused",
    "Options",
    "Report",
    "adapt",
    "explain",
    "explaining",
    "hpu_moe",
    "install_discovery_hook",
    "prepare",
]
__version__ = "0.1.0"

# Importing the package changes nothing outside it: no class, no dynamo setting, no callback. Looking up
# backend="hpu_moe" (moe_passes/registered.py, the entry point), `explain` and each hpu_moe compile
# prepare what the backend needs (adapters.prepare).
