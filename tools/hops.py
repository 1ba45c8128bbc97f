"""How far a reader walks from the captured graph to the fused call: hops and modules of moe_passes.

Compiles one catalog form with backend="hpu_moe" under a profiler hook and records the stack of
moe_passes functions at the moments a layer passes through: the captured graph made canonical
(make_fx), the expert match made (finder), the fused call node emitted (rewrite). A hop is a distinct
function on those stacks, from the backend entry down; the modules are the files they live in. The pass
manager's dispatch is not a hop: a reader goes from the declared pass list (backend.py) to the pass.

    python tools/hops.py [--form hf_grouped_mm]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import form_catalog  # noqa: E402
import moe_passes  # noqa: E402

PACKAGE = os.path.dirname(os.path.abspath(moe_passes.__file__))
DISPATCH = os.path.join(PACKAGE, "pass_manager.py")  # runs the declared passes: not a place a reader goes


def _own(frame) -> str | None:
    """"module.function" for a frame of moe_passes code, else None."""
    path = frame.f_code.co_filename
    if not path.startswith(PACKAGE) or path == DISPATCH or frame.f_code.co_name.startswith("<") and frame.f_code.co_name != "<lambda>":
        return None  # comprehensions are expressions, not places a reader goes
    module = os.path.relpath(path, os.path.dirname(PACKAGE))[: -len(".py")].replace(os.sep, ".")
    return f"{module}.{frame.f_code.co_qualname if hasattr(frame.f_code, 'co_qualname') else frame.f_code.co_name}"


def _stack(frame) -> list[str]:
    names = []
    while frame is not None:
        name = _own(frame)
        if name is not None:
            names.append(name)
        frame = frame.f_back
    return names[::-1]


def measure(form_name: str) -> tuple[list[str], set[str]]:
    """(the functions on the stacks of those moments, in first-seen order; every moe_passes module
    entered at all during the compile) for one compile."""
    from torch.fx.experimental import proxy_tensor

    from moe_passes.passes import matches

    watched = {matches.ExpertsMatch.__init__.__code__, proxy_tensor.make_fx.__code__}
    seen: list[str] = []
    entered: set[str] = set()

    def note(frame) -> None:
        for name in _stack(frame):
            if name not in seen:
                seen.append(name)

    emitted = torch.fx.Graph.call_function

    def profiler(frame, event, _arg):
        if event == "call":
            name = _own(frame)
            if name is not None:
                entered.add(_module_of(name))
        if event == "call" and frame.f_code in watched:
            note(frame.f_back)

    def watched_call_function(self, target, *args, **kwargs):
        if "mixture_of_experts" in str(target):
            note(sys._getframe(1))
        return emitted(self, target, *args, **kwargs)

    form = form_catalog.catalog()[form_name]
    model, inputs = form.build()
    torch._dynamo.reset()
    moe_passes.install_discovery_hook()  # reset() clears it
    compiled = torch.compile(model, backend="hpu_moe", options={"inner": "eager"})
    sys.setprofile(profiler)
    torch.fx.Graph.call_function = watched_call_function
    try:
        with torch.no_grad(), form_catalog.dynamo_config(form):
            compiled(*inputs)
    finally:
        sys.setprofile(None)
        torch.fx.Graph.call_function = emitted
    return seen, entered


def _module_of(name: str) -> str:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        candidate = ".".join(parts[:i])
        if candidate in sys.modules:
            return candidate
    return name


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--form", default="hf_grouped_mm", choices=sorted(form_catalog.catalog()))
    args = parser.parse_args(argv)
    functions, entered = measure(args.form)
    modules = []
    for name in functions:
        module = _module_of(name)
        if module not in modules:
            modules.append(module)
    for name in functions:
        print(f"  {name}")
    print(f"{args.form}: {len(functions)} hops in {len(modules)} modules ({', '.join(modules)})")
    print(f"modules entered during the compile: {len(entered)} ({', '.join(sorted(entered))})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
