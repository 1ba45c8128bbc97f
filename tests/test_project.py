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


def test_torch_is_pinned_and_test_tools_are_extras_only():
    text = (ROOT / "pyproject.toml").read_text()
    dependencies = re.search(r"^dependencies = \[(.*?)\]", text, re.M | re.S).group(1)
    assert '"torch==' in dependencies
    assert "transformers" not in dependencies
    assert 'hpu_moe = "moe_passes.backend:hpu_moe"' in text


def test_patterns_and_tools_are_not_installed_as_top_level_packages():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'include = ["moe_passes", "moe_passes.*"]' in text
