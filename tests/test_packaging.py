"""Installing the package keeps the user's torch: Gaudi's own builds (local and pre-release versions)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent

# Version strings of the torch builds users have: Intel Gaudi software 1.23 / 1.24 (Habana's builds of
# PyTorch 2.9 / 2.10, pre-release with git hashes, or with an hpu local tag), PyPI's CPU and CUDA
# builds, and nightlies.
SUPPORTED = [
    "2.9.0a0+git5fbf8f3",
    "2.9.0+hpu.1.23.0.695.git4f6e2c1",
    "2.10.0a0+gitc1a2b3d",
    "2.10.0+hpu_1.24.0-120.gitabcdef0",
    "2.9.1+cpu",
    "2.10.0",
    "2.11.0+cu128",
    "2.13.0",
    "2.14.0.dev20261101",
]
TOO_OLD = ["2.8.0", "2.8.0+hpu.1.22.0", "2.6.0a0+git1234567"]


def torch_requirement() -> Requirement:
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)\]", text, re.M | re.S).group(1)
    requirements = [Requirement(r) for r in re.findall(r'"([^"]+)"', block)]
    (torch,) = [r for r in requirements if r.name == "torch"]
    return torch


@pytest.mark.parametrize("version", SUPPORTED)
def test_the_torch_requirement_admits_the_builds_users_have(version):
    # prereleases=None: the specifier's own rule (what pip applies), not a permissive override
    assert torch_requirement().specifier.contains(version, prereleases=None)


@pytest.mark.parametrize("version", TOO_OLD)
def test_the_torch_requirement_rejects_older_torch(version):
    assert not torch_requirement().specifier.contains(version, prereleases=None)


def _fake_installed(site_packages: Path, name: str, version: str) -> None:
    """Only the metadata pip reads to decide what is installed: enough to test the resolver."""
    info = site_packages / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")


def _can_build_here() -> bool:
    """setuptools new enough for the build (>= 70.1 builds wheels by itself) in this environment."""
    try:
        import setuptools
    except ImportError:
        return False
    return Version(setuptools.__version__) >= Version("70.1")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    command = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(ROOT)]
    if _can_build_here():  # machines without an index (the GPU machine) build with what they have
        command.append("--no-build-isolation")
    subprocess.run(command, check=True, capture_output=True)
    (built,) = out.glob("moe_passes-*.whl")
    return built


@pytest.mark.parametrize("version", ["2.9.0a0+git5fbf8f3", "2.10.0+hpu_1.24.0-120.gitabcdef0"])
def test_pip_installing_the_package_keeps_an_installed_gaudi_torch(tmp_path, wheel, version):
    env = tmp_path / "env"
    venv.create(env, with_pip=True)
    python = env / "bin" / "python"
    site = Path(
        subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip()
    )
    _fake_installed(site, "torch", version)
    _fake_installed(site, "numpy", "2.1.0")
    report = tmp_path / "report.json"
    # --no-index: nothing may be fetched, so anything pip would have to install shows up as a failure
    result = subprocess.run(
        [python, "-m", "pip", "install", "--dry-run", "--no-index", "--report", str(report), str(wheel)],
        capture_output=True,
        text=True,
        # PYTHONPATH would show pip a checkout's moe_passes as installed in the fresh environment
        env={**os.environ, "PIP_CONSTRAINT": "", "PIP_FIND_LINKS": "", "PIP_CONFIG_FILE": os.devnull, "PYTHONPATH": ""},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    to_install = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert to_install == ["moe-passes"]
