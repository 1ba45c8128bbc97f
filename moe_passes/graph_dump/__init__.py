"""The graph-dump tool (`moe-graph-dump`): what hpu_moe did to a model, as text, JSON or an HTML page.

Built on `moe_passes.explaining`; `targets` builds what to compile, `text` and `html` render the report,
`cli` is the command line.
"""

from .cli import main

__all__ = ["main"]
