"""The architecture the code promises: no import cycles, a pure pass, short functions, forms by name,
a short path from the captured graph to the fused call, and counters for every step."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

import moe_passes
from form_catalog import catalog
from tests.helpers import run_hpu_moe

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "moe_passes"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The moe_passes modules `path` imports, at module level or inside functions."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("moe_passes")}
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) if node.level else node.module
            if not (base or "").startswith("moe_passes"):
                continue
            for alias in node.names:  # `from . import x` imports the module x; `from .m import f`, m
                sub = f"{base}.{alias.name}"
                where = PACKAGE.parent / sub.replace(".", "/")
                found.add(sub if where.with_suffix(".py").exists() or (where / "__init__.py").exists() else base)
    return found - {name}


def import_graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in PACKAGE.rglob("*.py")}


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(target):] + [target]))
            if target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_the_pass_knows_nothing_of_reports_printers_or_the_backend():
    outside = ("moe_passes.report", "moe_passes.printer", "moe_passes.explain", "moe_passes.backend",
               "moe_passes.steps", "moe_passes.graph_dump", "moe_passes.adapters")
    for module, imported in import_graph().items():
        if module.startswith("moe_passes.passes"):
            wrong = sorted(i for i in imported if i.startswith(outside))
            assert not wrong, f"{module} imports {wrong}"


def test_no_function_of_the_passes_is_longer_than_60_lines():
    long = []
    for path in (PACKAGE / "passes").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 60:
                long.append(f"{path.name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, long


@pytest.mark.parametrize("form", ["hf_batched_mm", "static_dense_loop"])
def test_one_layer_reaches_the_fused_call_in_at_most_10_hops_through_7_modules(form):
    """backend pass list -> canonicalize -> find -> the form's finder (and the shared reader it uses,
    e.g. expert_terms) -> rewrite (the pass manager's dispatch is not counted: tools/hops.py)."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import hops
    finally:
        sys.path.remove(str(ROOT / "tools"))
    functions, _ = hops.measure(form)
    modules = {hops._module_of(f) for f in functions}
    assert any(f.endswith("rewrite_experts") for f in functions), functions
    assert len(functions) <= 10 and len(modules) <= 7, functions


def test_forms_can_be_switched_off_by_name():
    model, inputs = catalog()["hf_batched_mm"].build()
    report, _, recorder = run_hpu_moe(model, inputs, forms=["batched_mm"])
    assert len(recorder.fused_nodes()) == 2, str(report)
    report, _, recorder = run_hpu_moe(model, inputs, forms=["dense_loop", "grouped_mm"])
    assert not recorder.fused_nodes() and not report.fused, str(report)
    assert set(moe_passes.FORMS) >= {"batched_mm", "dense_loop", "grouped_mm", "segments"}


@pytest.mark.parametrize(
    "forms, error",
    [(["no_such_form"], "option forms: unknown form(s) ['no_such_form']; known forms: ['grouped_mm'"),
     ("batched_mm", "a list of form names")],
)
def test_bad_form_names_are_refused_with_the_known_ones(forms, error):
    with pytest.raises((ValueError, TypeError)) as raised:
        moe_passes.Options.parse({"forms": forms})
    assert error in str(raised.value)


def test_every_step_is_counted_in_dynamo_counters():
    counters.clear()
    model, inputs = catalog()["hf_batched_mm"].build()
    run_hpu_moe(model, inputs)
    ours = counters["moe_passes"]
    assert ours["fused"] == 2 and ours["canonicalize"] == 1 and ours["find"] == 1 and ours["rewrite"] == 1, dict(ours)
    assert ours["inner compile"] == 1 and not ours["internal_errors"] and not ours["fallbacks"], dict(ours)
    torch._dynamo.reset()


def test_backend_functions_are_at_most_40_lines_and_the_forms_are_not_listed_by_hand():
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse((PACKAGE / "backend.py").read_text()))
        if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno >= 40
    ]
    assert not long, long
    # Each form registers its finder in its own module (passes/finder.py discovers them): the pipeline,
    # the options and the backend name none of them.
    for module in ("passes/pipeline.py", "options.py", "backend.py", "backend_passes.py"):
        imported = _imports(PACKAGE / module)
        assert not [i for i in imported if i.startswith("moe_passes.passes.experts_")], (module, imported)
    finders = {path.stem for path in (PACKAGE / "passes").glob("experts_*.py")}
    assert len(moe_passes.FORMS) == len(finders)



# The isinstance tests on str or tuple that the passes may keep, by (file, what they test): data that
# comes in either type, never a reader's answer. Readers answer with `matches.NoMatch`.
TYPE_CHECKS_OF_DATA = {
    ("axes.py", "label"),  # an einsum dim's label: one name, or a tuple of names for a merged dim
    ("expert_ids.py", "dim"),  # an indexing op's dim: an int, or the name of the argument holding it
}


def _class_names(classinfo: ast.expr) -> set[str]:
    """The type names an isinstance classinfo names: X, (X, Y), X | Y."""
    if isinstance(classinfo, ast.Tuple):
        return set().union(*map(_class_names, classinfo.elts))
    if isinstance(classinfo, ast.BinOp) and isinstance(classinfo.op, ast.BitOr):
        return _class_names(classinfo.left) | _class_names(classinfo.right)
    if isinstance(classinfo, ast.Name | ast.Attribute):
        return {classinfo.id if isinstance(classinfo, ast.Name) else classinfo.attr}
    return set()


def test_readers_say_no_with_one_type_not_with_str_or_tuple_results():
    """A reader returns what it read or a `NoMatch`; `isinstance(x, str)` / `isinstance(x, tuple)` is how
    the old readers said "no" (a reason string, or a (reason, node) tuple). `list | tuple` is a
    sequence test on an FX argument, not a result test, and is left alone."""
    found = []
    for path in sorted((PACKAGE / "passes").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"):
                continue
            names = _class_names(node.args[1]) if len(node.args) == 2 else set()
            if names & {"str", "tuple"} and "list" not in names:
                tested = ast.unparse(node.args[0])
                if (path.name, tested) not in TYPE_CHECKS_OF_DATA:
                    found.append(f"{path.name}:{node.lineno} isinstance({tested}, {ast.unparse(node.args[1])})")
    assert not found, found


def test_finders_do_not_import_each_other():
    for module, imported in import_graph().items():
        if module.startswith("moe_passes.passes.experts_"):
            others = sorted(i for i in imported if i.startswith("moe_passes.passes.experts_"))
            assert not others, f"{module} imports {others}: shared reading belongs in a module of its own"
