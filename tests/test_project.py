"""The project's own promises: README commands, CI script, packaging."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```(?:bash|sh)\n(.+?)\n```", text)[:2]


def test_readme_opens_with_two_commands_and_ci_runs_the_test_one():
    demo, test = readme_commands()
    assert "tools/demo.py" in demo
    assert "pytest" in test and "ruff check" in test and test.index("ruff") < test.index("pytest")
    ci = (ROOT / ".ci" / "run").read_text()
    assert test in ci
    assert ci.index(test) < ci.index("tools/vllm_env.py test --vllm")  # then the real-vLLM tests, in vLLM's env


def runtime_requirements() -> list[str]:
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)\]", text, re.M | re.S).group(1)
    return re.findall(r'"([^"]+)"', block)


def test_test_tools_are_extras_only_and_the_backend_is_an_entry_point():
    requirements = " ".join(runtime_requirements())
    assert "transformers" not in requirements and "pytest" not in requirements
    text = (ROOT / "pyproject.toml").read_text()
    # The entry point's module prepares the backend when dynamo looks it up (import moe_passes does not).
    assert 'hpu_moe = "moe_passes.registered:hpu_moe"' in text
    from moe_passes import backend, registered

    assert registered.hpu_moe is backend.hpu_moe


def test_development_commands_take_the_cpu_wheel_through_the_constraints_file():
    constraints = (ROOT / "dev-constraints.txt").read_text()
    assert re.search(r"^torch==\d+\.\d+\.\d+$", constraints, re.M)
    for command in readme_commands():
        assert "-c dev-constraints.txt" in command


def test_the_catalog_and_tools_are_not_installed_as_top_level_packages():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'include = ["moe_passes", "moe_passes.*"]' in text


def test_the_options_page_is_generated_from_the_options_docstring():
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "tools/docs.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr + "\nrun: python tools/docs.py"


def test_the_readme_is_a_front_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300
