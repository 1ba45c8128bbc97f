"""Which vLLM calling convention the vLLM adapter finds in vLLM source trees, without importing vLLM.

For each unpacked vLLM source tree (a release's sdist, or a checkout), rebuilds the MoE classes the
adapter looks at (`moe_passes.adapters.vllm.CANDIDATES`) from their source, methods only (bodies
compiled, never run; decorators other than `property` and annotations dropped, so no vLLM import is
needed), and prints what `detect_api_shape` decides: adapted with which convention, or declined and why.

    python tools/vllm_conventions.py /path/to/vllm-0.19.0 /path/to/vllm-0.33.0 ...
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moe_passes.adapters.vllm import CANDIDATES, LAYER_MODULE, detect_api_shape  # noqa: E402


def class_from_source(tree: Path, module: str, name: str) -> type | None:
    """`module.name` rebuilt from `tree`'s source: its own methods, no base classes, or None if absent."""
    path = tree / (module.replace(".", "/") + ".py")
    if not path.exists():
        return None
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            namespace: dict[str, object] = {"__module__": module, "__qualname__": name}
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    item.decorator_list = [
                        d for d in item.decorator_list if getattr(d, "id", None) == "property"
                    ]
                    item.returns = None
                    for argument in item.args.posonlyargs + item.args.args + item.args.kwonlyargs:
                        argument.annotation = None
                    scope = {"__name__": module}
                    exec(compile(ast.unparse(item), str(path), "exec"), scope)
                    namespace[item.name] = scope[item.name]
            if any(isinstance(b, ast.Name) and b.id == "ABC" for b in node.bases) and "forward" in namespace:
                if not any(n in namespace for n in ("_forward_impl", "forward_impl")):
                    return None  # the abstract MoERunner of 0.17-0.19
            return type(name, (), namespace)
    return None


def describe(tree: Path) -> str:
    owner = class_from_source(tree, LAYER_MODULE, "FusedMoE")
    for module, name in CANDIDATES:
        cls = class_from_source(tree, module, name)
        if cls is None:
            continue
        shape = detect_api_shape(cls, owner if owner is not None and cls is not owner else None)
        where = f"{module.rsplit('.', 1)[1]}.{name}"
        if shape.supported:
            return f"{tree.name:14} {where:36} adapted   {shape.name}: {shape.convention}"
        return f"{tree.name:14} {where:36} declined  {shape.name}: {shape.reason}"
    return f"{tree.name:14} no MoE class the adapter knows"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="+", type=Path, help="unpacked vLLM source trees (holding vllm/)")
    for tree in parser.parse_args().trees:
        print(describe(tree))


if __name__ == "__main__":
    main()
