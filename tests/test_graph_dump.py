"""`moe-graph-dump`: every catalog form and two transformers families in every format, bad input, tooling.

Most runs call the CLI's main() in process; one test runs the installed console script. The HTML page
is opened in headless chromium (required in CI, skipped elsewhere when absent).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from form_catalog import FORMS, catalog
from moe_passes.graph_dump import main
from moe_passes.graph_dump.html import dot_available, graph_to_dot
from moe_passes.report import REPORT_KEYS, Report
from tests.helpers import requires_transformers_5, skip_unless_dynamo_slices_for

ROOT = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI", "").lower() == "true"


def dump(capsys, tmp_path, *argv) -> tuple[dict, Path, str]:
    """(JSON printed on stdout, the --out directory, stderr) of one in-process run."""
    out = tmp_path / "dump"
    assert main([*argv, "--json", "--out", str(out)]) == 0, capsys.readouterr().err
    captured = capsys.readouterr()
    return json.loads(captured.out), out, captured.err


def check_formats(data: dict, out: Path) -> Report:
    """The three files agree with the JSON on stdout, and the JSON is a report."""
    assert list(data) == list(REPORT_KEYS)
    report = Report.from_dict(data)
    assert json.loads(report.to_json()) == data  # round trip: nothing lost, nothing invented
    assert json.loads((out / "report.json").read_text()) == data
    text = (out / "report.txt").read_text()
    page = (out / "report.html").read_text()
    assert "\033[" not in text  # no colour in files
    for heading in ("Summary", "Fused layers", "Declined candidates", "Graph breaks", "Recompiles"):
        assert heading in text and heading in page
    assert f"graphs: {report.graph_count}" in text and f"fused layers: {len(report.fused)}" in text
    for f in report.fused:
        assert f.layer in text and f.overload in text and f.layer in page
    for d in report.declined:
        assert d.reason in text
    assert page.count('<section class="graph"') == report.graph_count == len(report.graphs)
    return report


@pytest.mark.parametrize("name", FORMS)
def test_every_catalog_form_in_every_format(name, capsys, tmp_path):
    skip_unless_dynamo_slices_for(name)
    data, out, _ = dump(capsys, tmp_path, f"catalog:{name}")
    report = check_formats(data, out)
    expected = catalog()[name].EXPECTED
    assert len(report.fused) == expected.fused and len(report.declined) == expected.declined, str(report)
    assert data["graph_count"] == report.graph_count and data["compile_count"] >= 1
    assert (data["graph_break_count"] > 0) == expected.graph_breaks
    text = (out / "report.txt").read_text()
    if expected.fused:
        assert text.count("<- fused") == expected.fused  # each fused call marked in the rewritten graph
        assert all(g["captured"] and g["rewritten"] for g in data["graphs"] if g["fused"])
    for d in report.declined:  # the node where matching stopped is printed and marked in its graph
        assert d.stopped_at.startswith("%") and " = " in d.stopped_at
        assert "<- declined: matching stopped here" in text
    if expected.graph_breaks:
        assert report.graph_breaks and all(b.user_stack for b in report.graph_breaks)
        assert any(
            f.file.endswith(f"{name}.py") or "form_catalog" in f.file
            for b in report.graph_breaks
            for f in b.user_stack
        )


@requires_transformers_5
@pytest.mark.parametrize(
    ("family", "implementation"), [("mixtral", "grouped_mm"), ("qwen3_moe", "batched_mm")]
)
def test_transformers_families_in_every_format(family, implementation, capsys, tmp_path):
    data, out, _ = dump(
        capsys,
        tmp_path,
        f"hf:{family}",
        "--layers",
        "1",
        "--experts-implementation",
        implementation,
        "--verify",
    )
    report = check_formats(data, out)
    assert (report.graph_count, report.graph_break_count, report.compile_count) == (1, 0, 1)
    (fused,) = report.fused
    assert fused.form == implementation and fused.max_error is not None and fused.max_error < 1e-4
    assert "max error" in (out / "report.txt").read_text()
    assert set(report.pass_seconds) >= {"canonicalize", "find", "rewrite", "verify", "inner compile"}


def test_text_is_coloured_only_when_asked(capsys):
    assert main(["catalog:hf_batched_mm", "--layers", "1", "--color", "always"]) == 0
    assert "\033[" in capsys.readouterr().out
    assert main(["catalog:hf_batched_mm", "--layers", "1"]) == 0  # auto: stdout is not a terminal here
    assert "\033[" not in capsys.readouterr().out


def test_regional_compile_of_vllm_style_layers_shows_recompiles_and_the_fix(capsys, tmp_path):
    data, _, _ = dump(
        capsys, tmp_path, "catalog:vllm_fused_moe", "--layers", "3", "--regional", "--no-adapters"
    )
    assert data["recompile_count"] == 2 and data["fused"] == []
    assert all("layer_name" in r["guard_failures"][0] for r in data["recompiles"])
    data, _, _ = dump(capsys, tmp_path, "catalog:vllm_fused_moe", "--layers", "3", "--regional")
    assert (data["compile_count"], data["recompile_count"], data["graph_break_count"]) == (1, 0, 0)
    assert len(data["fused"]) == 1  # one graph, one fused call, serving all three layers


BAD_TARGETS = [
    (["catalog:no_such_form"], "unknown catalog form 'no_such_form'"),
    (["hf:no_such_family"], "transformers has no model type 'no_such_family'"),
    (["hf:mixtral", "--experts-implementation", "fancy"], "experts implementation must be one of"),
    (["no_such_module_xyz:build"], "cannot import no_such_module_xyz"),
    (["tests.test_graph_dump:failing_factory"], "tests.test_graph_dump:failing_factory() failed: ValueError"),
    (["tests.test_graph_dump:not_a_pair"], "must return (model, example_inputs)"),
    (["tests.test_graph_dump:model_that_fails"], "running tests.test_graph_dump:model_that_fails failed"),
    (["just-a-word"], "is not catalog:<name>, hf:<model_type> or package.module:callable"),
    (["catalog:static_dense_loop", "--regional"], "found no layer list"),
]


def failing_factory():
    raise ValueError("this factory cannot build its model")


def not_a_pair():
    return 42


def model_that_fails():
    def forward(x):
        raise RuntimeError("the model itself is broken")

    import torch

    return forward, (torch.ones(2),)


@pytest.mark.parametrize(("argv", "message"), BAD_TARGETS, ids=[a[0] for a, _ in BAD_TARGETS])
def test_bad_input_is_one_clear_line_and_a_failing_status(argv, message, capsys):
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moe-graph-dump: error: ") and message in lines[0], lines
    assert "Traceback" not in captured.err


def test_user_callable_target(capsys, tmp_path):
    module = tmp_path / "my_moe_model.py"
    module.write_text(
        textwrap.dedent(
            """
            from form_catalog import hf_batched_mm

            def build():
                return hf_batched_mm.build(layers=1)
            """
        )
    )
    sys.path.insert(0, str(tmp_path))
    try:
        data, out, _ = dump(capsys, tmp_path, "my_moe_model:build")
    finally:
        sys.path.remove(str(tmp_path))
    check_formats(data, out)
    assert len(data["fused"]) == 1


def test_console_script_runs_from_a_clean_process(tmp_path):
    script = shutil.which("moe-graph-dump", path=str(Path(sys.executable).parent))
    if script is None:
        if IN_CI:
            pytest.fail(
                "moe-graph-dump is not installed: pyproject.toml must declare it in [project.scripts]"
            )
        pytest.skip("moe-graph-dump is not installed in this environment (pip install -e .)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [script, "catalog:near_miss_exact_gelu", "--layers", "1", "--html", str(tmp_path / "page.html")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Declined candidates (1)" in result.stdout and "exact erf" in result.stdout
    assert (tmp_path / "page.html").read_text().startswith("<!DOCTYPE html>")
    bad = subprocess.run([script, "hf:no_such_family"], capture_output=True, text=True, cwd=ROOT, env=env)
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


def test_graph_pictures_wire_values_and_colour_fused_and_stopped_nodes():
    text = "graph(in0, in1):\n  %0 = aten.mm(in0, in1)\n  %1 = moe_passes.mixture_of_experts(%0, in1[0])\n  return (%1,)"
    dot = graph_to_dot(text, stops={"%0 = aten.mm(in0, in1)"})
    assert '"in0" -> "%0";' in dot and '"in1" -> "%1";' in dot and '"%1" -> "return";' in dot
    assert '"%1" [label="%1 moe_passes.mixture_of_experts", fillcolor="#b7ebc0"]' in dot
    assert '"%0" [label="%0 aten.mm", fillcolor="#ffd199"]' in dot


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def test_html_page_renders_in_a_headless_browser(capsys, tmp_path):
    browser = chromium()
    if browser is None:
        if IN_CI:
            pytest.fail("CI must install chromium (.ci/run) for the browser test")
        pytest.skip("chromium is not installed here")
    if IN_CI:
        assert dot_available(), "CI must install graphviz (.ci/run) so that graphs are drawn"
    pages = {}
    for name in ("hf_batched_mm", "near_miss_exact_gelu"):
        data, out, _ = dump(capsys, tmp_path / name, f"catalog:{name}", "--layers", "2")
        pages[name] = (data, out / "report.html")
    for data, page in pages.values():
        dom = subprocess.run(
            [
                browser,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--dump-dom",
                page.as_uri(),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
        assert "<table" in dom and 'id="summary"' in dom, dom[:2000]
        for table, entries in (("fused", data["fused"]), ("declined", data["declined"])):
            if entries:  # header + one row per entry
                rows = dom.split(f'<table id="{table}">', 1)[1].split("</table>", 1)[0]
                assert rows.count("<tr>") == 1 + len(entries), table
            else:
                assert f'<p id="{table}" class="none">none</p>' in dom
        pictures = dom.count("<svg")
        if dot_available():
            drawn = sum(1 + (g["rewritten"] is not None) for g in data["graphs"])
            assert pictures == drawn, (pictures, drawn)
        else:
            assert "<pre>" in dom
    screenshot = tmp_path / "page.png"
    subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            f"--screenshot={screenshot}",
            "--window-size=1200,1600",
            pages["hf_batched_mm"][1].as_uri(),
        ],
        capture_output=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
