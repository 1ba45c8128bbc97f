"""The adapter for real vLLM (active only when vLLM is importable), and its vLLM plugin hook.

vLLM loads plugins from the `vllm.general_plugins` entry point group in every process it starts;
this package declares `register` there, so a vLLM server with moe-passes installed gets the adapter
without code changes. `install_if_loaded` adapts vLLM's FusedMoE when vLLM has been imported.
"""

from __future__ import annotations

import importlib
import logging
import sys

from . import vllm_style
from .base import env_enabled, install

log = logging.getLogger(__name__)

FUSED_MOE_MODULE = "vllm.model_executor.layers.fused_moe.layer"


def install_if_loaded() -> list[str]:
    """Adapt vLLM's FusedMoE if its module is already imported (never imports vLLM itself)."""
    module = sys.modules.get(FUSED_MOE_MODULE)
    if module is None or not env_enabled():
        return []
    cls = getattr(module, "FusedMoE", None)
    if cls is None or not vllm_style.follows_convention(cls):
        log.info("vLLM's FusedMoE does not follow the calling convention this adapter knows; left as is")
        return []
    if install(cls, vllm_style.traceable_forward, "vLLM FusedMoE (layer by reference)"):
        return [f"{cls.__module__}.{cls.__qualname__}"]
    return []


def register() -> None:
    """vLLM plugin entry point (`vllm.general_plugins`): adapt FusedMoE in this vLLM process."""
    if not env_enabled():
        return
    try:
        importlib.import_module(FUSED_MOE_MODULE)
    except ImportError as error:
        log.warning("moe-passes vLLM plugin: cannot import %s (%s)", FUSED_MOE_MODULE, error)
        return
    install_if_loaded()
