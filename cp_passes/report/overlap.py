"""How much of the collectives' traffic has compute to hide behind: in AOTAutograd's forward and backward graphs,
the bytes of each collective whose result is waited for only after some independent compute (a functional
collective and its ``wait_tensor`` with work between them), against all the collectives' bytes.

A collective that is one blocking op (``cp_passes::prefix_gather`` with packed documents' first keys, the halo,
a key gather's parts: they issue their ``all_to_all`` and wait inside the op) has nothing between its start and
its wait: none of its bytes overlap. :mod:`cp_passes.compiler.schedule` orders the graphs this counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from ..graph.analysis import meta_val, numel_hint
from ..graph.calls import WAIT, is_start
from ..rules import VIEW_OPS

_NOT_COMPUTE = {*(op.default for op in VIEW_OPS if hasattr(op, "default")), WAIT}


@dataclass(frozen=True)
class Overlap:
    total: int = 0
    """Bytes the collectives receive, forward and backward."""
    overlapped: int = 0
    """Of those, the bytes of collectives waited for after some compute that does not need them."""
    blocking: tuple[str, ...] = ()
    """The collective ops that start and wait in one op (nothing can overlap them)."""

    @property
    def fraction(self) -> float:
        return self.overlapped / self.total if self.total else 1.0


def _bytes(val) -> int:
    return numel_hint(val) * val.element_size() if isinstance(val, torch.Tensor) else 0


def _graph_calls(graphs: list[torch.fx.GraphModule]) -> list[tuple[torch.fx.Graph, int]]:
    """Every graph with the number of times it runs: a region's subgraph once per call."""
    found = []

    def visit(gm: torch.fx.GraphModule, times: int) -> None:
        found.append((gm.graph, times))
        calls: dict[str, int] = {}
        for node in gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph):
            calls[node.args[0].target] = calls.get(node.args[0].target, 0) + 1
        for name, count in calls.items():
            visit(getattr(gm, name), times * count)

    for gm in graphs:
        visit(gm, 1)
    return found


def overlap(graphs: list[torch.fx.GraphModule], collectives: set) -> Overlap:
    """:class:`Overlap` of ``graphs`` (AOTAutograd's forward and backward); ``collectives`` are cp_passes'
    runtime ops that issue a collective (blocking)."""
    total = overlapped = 0
    blocking = set()
    for graph, times in _graph_calls(graphs):
        order = {node: i for i, node in enumerate(graph.nodes)}
        nodes = list(graph.nodes)
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            functional = is_start(node)
            if not functional and node.target not in collectives:
                continue
            size = _bytes(meta_val(node)) * times
            total += size
            if not functional:
                blocking.add(str(node.target))
                continue
            waits = [u for u in node.users if u.target is WAIT]
            end = min((order[w] for w in waits), default=order[node] + 1)
            if any(n.op == "call_function" and n.target not in _NOT_COMPUTE and n not in node.users
                   for n in nodes[order[node] + 1:end]):
                overlapped += size
    return Overlap(total, overlapped, tuple(sorted(blocking)))


def format_overlap(found: Overlap, fmt) -> str:
    if not found.total:
        return "collectives overlapped with compute: none issued"
    line = (f"collectives overlapped with compute: {fmt(found.overlapped)} of {fmt(found.total)} "
            f"({100 * found.fraction:.0f}%) of the bytes received, forward and backward")
    if found.blocking:
        line += f"; blocking (start and wait in one op): {', '.join(found.blocking)}"
    return line
