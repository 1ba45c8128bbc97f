"""A stable text form of a graph for snapshots and the dump tool: op names and wiring only.

Node names, strides, devices and stack traces change between torch releases; what a rewrite must
pin is which ops run and what feeds them. Values are renamed in order of appearance (`%0`, `%1`, ...),
graph inputs become `in0`, `in1`, ..., symbolic sizes print as `s`, and the per-expert weight lists
of a fused call print as one `unbind(...)` expression.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

_DROPPED_KWARGS = {"device", "pin_memory", "layout", "memory_format", "non_blocking"}


def _op_name(target) -> str:
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, torch._ops.OpOverload):
        namespace = target.namespace
        name = target._schema.name.split("::")[-1]
        overload = target._overloadname
        return f"{namespace}.{name}" + ("" if overload == "default" else f".{overload}")
    name = getattr(target, "__name__", str(target))
    # Python operators appear as operator.eq or as Tensor.__eq__ depending on the torch version
    if len(name) > 4 and name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
    return name


class _Namer:
    def __init__(self):
        self.names: dict[Node, str] = {}
        self.inputs = 0
        self.values = 0

    def define(self, node: Node) -> str:
        if node.op == "placeholder":
            name = f"in{self.inputs}"
            self.inputs += 1
        else:
            name = f"%{self.values}"
            self.values += 1
        self.names[node] = name
        return name


def _format_arg(arg, namer: _Namer) -> str:
    if isinstance(arg, Node):
        return namer.names.get(arg, "?")
    if isinstance(arg, list | tuple):
        collapsed = _collapse_unbind(arg, namer)
        if collapsed is not None:
            return collapsed
        inner = ", ".join(_format_arg(a, namer) for a in arg)
        return f"[{inner}]"
    if isinstance(arg, torch.SymInt | torch.SymFloat | torch.SymBool):
        return "s"
    if isinstance(arg, torch.dtype):
        return str(arg).replace("torch.", "")
    if isinstance(arg, float):
        return f"{arg:g}"
    return repr(arg)


def _collapse_unbind(items, namer: _Namer) -> str | None:
    """[getitem(u, 0), ..., getitem(u, n-1)] of one unbind -> 'unbind(<source>)[0:n]'."""
    if len(items) < 2 or not all(isinstance(i, Node) and i.target is operator.getitem for i in items):
        return None
    source = items[0].args[0]
    if any(i.args[0] is not source or i.args[1] != n for n, i in enumerate(items)):
        return None
    return f"{namer.names.get(source, '?')}[0:{len(items)}]"


def format_graph(gm: GraphModule | torch.fx.Graph, keep=None) -> str:
    """Every node (or only those `keep(node)` accepts), one per line, in graph order.

    Values used by printed nodes but not printed themselves appear as graph inputs `in<i>`, numbered in
    order of first use, so a partial view stays stable when unrelated parts of the graph change.
    """
    return "\n".join(line for _, line in graph_lines(gm, keep))


def graph_lines(gm: GraphModule | torch.fx.Graph, keep=None) -> list[tuple[Node | None, str]]:
    """`format_graph`, line by line, each with the node it prints (None for the header)."""
    graph = gm.graph if isinstance(gm, GraphModule) else gm
    namer, lines = _Namer(), []
    unbound = _unbind_items(graph)
    printed = [
        n
        for n in graph.nodes
        if n.op not in ("placeholder", "output") and n not in unbound and (keep is None or keep(n))
    ]
    printed_set = set(printed)
    for node in graph.nodes:
        if node.op == "placeholder" and keep is None:
            namer.define(node)
    for node in graph.nodes:
        if node in unbound:
            if node.args[0] in namer.names:
                namer.names[node] = f"{namer.names[node.args[0]]}[{node.args[1]}]"
            continue
        if node.op == "output":
            if keep is None:
                lines.append((node, f"return {_format_arg(node.args[0], namer)}"))
            continue
        if node not in printed_set:
            continue
        for source in node.all_input_nodes:
            origin = source.args[0] if source in unbound else source
            if origin not in namer.names and origin not in printed_set:
                namer.names[origin] = f"in{namer.inputs}"
                namer.inputs += 1
                if source in unbound:
                    namer.names[source] = f"{namer.names[origin]}[{source.args[1]}]"
        name = namer.define(node)
        if node.op == "get_attr":
            lines.append((node, f"{name} = get_attr"))
            continue
        args = [_format_arg(a, namer) for a in node.args]
        args += [f"{k}={_format_arg(v, namer)}" for k, v in node.kwargs.items() if k not in _DROPPED_KWARGS]
        lines.append((node, f"{name} = {_op_name(node.target)}({', '.join(args)})"))
    inputs = ", ".join(f"in{i}" for i in range(namer.inputs))
    return [(None, f"graph({inputs}):"), *((node, "  " + line) for node, line in lines)]


def node_lines(gm: GraphModule | torch.fx.Graph) -> dict[Node, str]:
    """{node: its line in `format_graph(gm)`}, to point at a node in a printed graph."""
    return {node: line.strip() for node, line in graph_lines(gm) if node is not None}


def _unbind_items(graph: torch.fx.Graph) -> set[Node]:
    return {
        n
        for n in graph.nodes
        if n.target is operator.getitem
        and isinstance(n.args[0], Node)
        and getattr(n.args[0].target, "overloadpacket", None) is torch.ops.aten.unbind
    }


def is_fused_moe(node: Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target._schema.name in (
        "moe_passes::mixture_of_experts",
        "hpu::mixture_of_experts",
    )


def format_fused_calls(gm: GraphModule, depth: int = 2) -> str:
    """The fused MoE calls and the ops that feed them (up to `depth` steps), for whole-model snapshots."""
    keep: set[Node] = set()
    for node in gm.graph.nodes:
        if is_fused_moe(node):
            frontier = [node]
            for _ in range(depth + 1):
                keep.update(frontier)
                frontier = [p for n in frontier for p in n.all_input_nodes if p.op == "call_function"]
    return format_graph(
        gm, keep=lambda n: n in keep and n.target is not operator.getitem or _is_unbind(n, keep)
    )


def _is_unbind(node: Node, keep: set[Node]) -> bool:
    return (
        node in keep
        and node.target is operator.getitem
        and getattr(node.args[0].target, "overloadpacket", None) is not torch.ops.aten.unbind
    )
