"""A PNG picture of a `moe-graph-dump` HTML page, taken by headless chromium (the README's picture).

    python tools/graph_dump_picture.py catalog:hf_batched_mm docs/graph_dump.png -- --layers 1

Arguments after `--` go to moe-graph-dump. Needs chromium (Debian: apt-get install chromium) and, for
the graph pictures, graphviz.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moe_passes.graph_dump import main as graph_dump  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("png")
    parser.add_argument("--size", default="1400,1700", help="window width,height in pixels")
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    extra = argv[split + 1 :]  # moe-graph-dump options
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        print("graph_dump_picture: chromium is not installed", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "report.html"
        with open(os.devnull, "w") as devnull:
            stdout, sys.stdout = sys.stdout, devnull
            try:
                status = graph_dump([args.target, "--html", str(page), *extra])
            finally:
                sys.stdout = stdout
        if status != 0:
            return status
        png = Path(args.png).resolve()
        png.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                browser,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--hide-scrollbars",
                f"--window-size={args.size}",
                f"--screenshot={png}",
                page.as_uri(),
            ],
            check=True,
            capture_output=True,
            timeout=120,
            cwd=tmp,
        )
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
