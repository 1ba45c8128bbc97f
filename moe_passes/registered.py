"""The `hpu_moe` backend as the `torch_dynamo_backends` entry point loads it.

Dynamo imports this module when a compile first asks for backend="hpu_moe" by name. That is the moment
the backend's preparation belongs to (adapters.prepare: the framework MoE classes already loaded get the
forward hpu_moe traces, and dynamo looks for new ones before it compiles each frame for hpu_moe), rather
than `import moe_passes`, which changes nothing outside the package.
"""

from __future__ import annotations

from .adapters import prepare
from .backend import hpu_moe

prepare()

__all__ = ["hpu_moe"]
