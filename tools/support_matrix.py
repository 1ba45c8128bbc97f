"""Run the test suite against another torch and transformers release: one cell of the support matrix.

Each cell gets its own virtual environment (kept under .matrix/ and reused), with torch and transformers
from PyPI (torch wheels there are large CUDA builds; they run on CPU), the test tools, and this package
installed without dependencies so that nothing replaces the chosen torch. Not part of CI.

    python tools/support_matrix.py --torch 2.9.1 --transformers 5.23.0
    python tools/support_matrix.py --torch 2.13.0 --transformers 4.55.4 -- -n 2 tests/test_transformers4.py

Prints the cell (torch, transformers, pytest's closing line) last; the exit code is pytest's.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST_TOOLS = ["numpy", "pytest>=8", "expecttest==0.3.0", "hypothesis>=6.100", "pytest-xdist", "packaging"]


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def installed_version(python: Path, name: str) -> str | None:
    code = f"import importlib.metadata as m; print(m.version({name!r}))"
    result = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return result.stdout.strip() if result.returncode == 0 else None


def prepare(venv: Path, torch_version: str, transformers_version: str) -> Path:
    """The cell's environment, created or brought to the requested versions."""
    python = venv_python(venv)
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    # the local-version-free comparison: PyPI's 2.9.1 installs as 2.9.1 (or 2.9.1+cuXXX)
    if (installed_version(python, "torch") or "").split("+")[0] != torch_version:
        subprocess.run([*pip, f"torch=={torch_version}"], check=True)
    if installed_version(python, "transformers") != transformers_version:
        subprocess.run([*pip, f"transformers=={transformers_version}"], check=True)
    subprocess.run([*pip, *TEST_TOOLS], check=True)
    subprocess.run([*pip, "--no-deps", "-e", str(ROOT)], check=True)
    return python


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", required=True, help="torch release, e.g. 2.9.1")
    parser.add_argument("--transformers", required=True, help="transformers release, e.g. 4.55.4")
    parser.add_argument("--venv", type=Path, help="environment to use (default .matrix/torch-X-transformers-Y)")
    parser.add_argument("pytest_args", nargs="*", help="after --: arguments for pytest (default: the suite)")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"\d+\.\d+(\.\d+)?", args.torch) or not re.fullmatch(r"\d+\.\d+(\.\d+)?", args.transformers):
        parser.error("--torch and --transformers take release numbers such as 2.9.1 and 4.55.4")
    venv = args.venv or ROOT / ".matrix" / f"torch-{args.torch}-transformers-{args.transformers}"
    python = prepare(venv, args.torch, args.transformers)
    pytest_args = args.pytest_args or ["--ignore", "tests/test_fuzz.py"]
    env = {**os.environ, "PYTHONPATH": ""}
    result = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    sys.stdout.write(result.stdout[-20000:])
    sys.stderr.write(result.stderr[-5000:])
    closing = next((line for line in reversed(result.stdout.splitlines()) if re.search(r"\d+ (passed|failed)", line)), "")
    versions = f"torch {installed_version(python, 'torch')}, transformers {installed_version(python, 'transformers')}"
    print(f"\ncell: {versions}: {closing.strip('= ')}")
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
