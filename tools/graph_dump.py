"""`python tools/graph_dump.py TARGET [options]`: the `moe-graph-dump` console script from a checkout.

python tools/graph_dump.py catalog:hf_grouped_mm --html dump.html
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moe_passes.graph_dump import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
