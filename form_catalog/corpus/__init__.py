"""The wild corpus: MoE layers from public code bases the catalog does not mirror, one module each.

Why: the catalog was written beside the finders; this corpus was written from code read elsewhere,
before the capture code was changed for it, so that measuring it (tools/corpus.py) tests how far the
backend generalises. Each module mirrors one layer's forward faithfully (its data-dependent Python
included: host-side counts, empty-expert skips, boolean-mask gathers, loops of any shape), cites the
repository, file and commit it was read from (`SOURCE`), and offers `build() -> (model, inputs)` at tiny
sizes. No module states an expected outcome: the outcomes are measured, and pinned by tests/test_corpus.py.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType


def entries() -> dict[str, ModuleType]:
    """{entry name: module}, sorted by name; modules whose name starts with "_" are helpers."""
    names = sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
    return {name: importlib.import_module(f"{__name__}.{name}") for name in names}
