"""Adapters: make framework MoE layers traceable before dynamo traces them.

Some frameworks hide an MoE layer from the compiler: vLLM's FusedMoE passes its own name to an opaque
custom op that finds the layer again through a forward context. Dynamo then guards on the name (one
recompile per layer), breaks the graph on context accesses, and never sees the experts. An adapter
gives such a class a forward that holds the layer by reference and runs its routing and experts in the
open, so that one compiled graph serves every layer and the passes can fuse it.

An adapted class keeps its own forward everywhere except while dynamo traces it for the `hpu_moe`
backend with adapters enabled (`options={"adapters": False}` or `MOE_PASSES_ADAPTERS=0` turn them off):
eager runs, other backends and other compiles see the original code.

Adapters are installed when hpu_moe is used, never at import: when the backend is looked up by name
(`torch.compile(..., backend="hpu_moe")`), before dynamo compiles a frame for hpu_moe, when the backend
compiles a graph, and by `explain`; `moe_passes.adapt()` installs them explicitly.
"""

from __future__ import annotations

from .base import ENV_VAR, adapted_classes, adapters_active, env_enabled, install
from .discovery import adapt, install_discovery_hook, prepare

__all__ = [
    "ENV_VAR",
    "adapt",
    "adapted_classes",
    "adapters_active",
    "env_enabled",
    "install",
    "install_discovery_hook",
    "prepare",
]
