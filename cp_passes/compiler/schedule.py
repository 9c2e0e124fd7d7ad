"""Order AOTAutograd's forward and backward graphs so that collectives overlap compute.

A functional collective (``_c10d_functional*``: a transport's start, such as the causal key gather's
``all_to_all``, or the one AOTAutograd differentiates it into) is issued as soon as its inputs exist, and its
``wait_tensor`` runs only when no other node is ready: every node that does not need the collective's result
runs between the start and the wait. Kahn's algorithm, ready nodes taken starts and the nodes the next start
needs first, then compute, then waits, each by its original position. The collectives keep their order (every
rank issues them in the same order: the graphs of different ranks may differ in their compute) with one in
flight at a time (the next starts after the last one's wait: a collective's buffer is not allocated long before
its use), and a node that mutates or has other side effects is a barrier nothing crosses.
"""

from __future__ import annotations

import heapq

import torch
import torch.fx

from ..graph.calls import WAIT, is_start

INPUT, START, COMPUTE, WAITS = -1, 0, 1, 2


def _barrier(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or is_start(node) or node.target is WAIT:
        return False
    schema = getattr(node.target, "_schema", None)
    return (schema is not None and schema.is_mutable) or node.is_impure()


def schedule_for_overlap(gm: torch.fx.GraphModule, collectives: set = frozenset()) -> bool:
    """Reorder ``gm``'s nodes (see the module); ``collectives`` are the blocking ops that issue one (kept in
    order with the starts). Returns whether anything moved."""
    moved = False
    for child in gm.children():  # a nested compile region's graphs
        if isinstance(child, torch.fx.GraphModule):
            moved |= schedule_for_overlap(child, collectives)
    graph = gm.graph
    nodes = list(graph.nodes)
    moved |= _plain_collectives(nodes)
    if not any(is_start(n) for n in nodes):
        if moved:
            gm.recompile()
        return moved
    after, waiting, chained = _dependencies(nodes, collectives)
    order = _overlap_order(nodes, after, waiting, [n for n in chained if is_start(n)])
    if order == nodes:
        return moved
    previous = None
    for n in order:
        if previous is not None:
            previous.append(n)
        previous = n
    graph.lint()
    gm.recompile()
    return True


def _plain_collectives(nodes: list[torch.fx.Node]) -> bool:
    """Replace each autograd functional collective by the plain op; returns whether there was one.

    After AOTAutograd nothing differentiates: the plain op, whose in-flight input Inductor keeps alive until the
    wait (it runs the autograd one as an opaque kernel and may reuse its input's buffer)."""
    replaced = False
    for n in nodes:
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "_c10d_functional_autograd":
            n.target = getattr(torch.ops._c10d_functional, n.target._schema.name.split("::")[1]).default
            replaced = True
    return replaced


def _dependencies(nodes: list[torch.fx.Node], collectives: set) -> tuple[dict, dict, list]:
    """The order's constraints as ``(after, waiting, chained)``: each node's successors, each node's count of
    predecessors, and the collectives in graph order. A node comes after its inputs, each collective after the
    previous one's wait, and a barrier (a mutation, a side effect, the output) between what precedes and follows
    it."""
    index = {n: i for i, n in enumerate(nodes)}
    after: dict[torch.fx.Node, list[torch.fx.Node]] = {n: [] for n in nodes}
    waiting = {n: 0 for n in nodes}

    def edge(a, b):
        after[a].append(b)
        waiting[b] += 1

    for n in nodes:
        for a in n.all_input_nodes:
            edge(a, n)
    chained = [n for n in nodes if is_start(n) or (n.op == "call_function" and n.target in collectives)]
    for a, b in zip(chained, chained[1:]):
        # One collective in flight: the next starts after this one's wait (a backward's recomputed key
        # gathers, whose inputs exist from its first node, would otherwise all be in memory at once).
        for w in [u for u in a.users if u.target is WAIT] or [a]:
            edge(w, b)
    barrier = None
    for n in nodes:  # a barrier comes after every node before it and before every node after it
        if barrier is not None:
            edge(barrier, n)
        if _barrier(n) or n.op == "output":
            for m in nodes[index[barrier] + 1 if barrier is not None else 0:index[n]]:
                if m not in n.all_input_nodes:
                    edge(m, n)
            barrier = n
    return after, waiting, chained


def _feeding(start: torch.fx.Node | None, done: set) -> set:
    """The nodes not yet scheduled (not in ``done``) that ``start`` needs: they run first, so that it starts
    early."""
    found, todo = set(), [start] if start is not None else []
    while todo:
        for a in todo.pop().all_input_nodes:
            if a not in done and a not in found:
                found.add(a)
                todo.append(a)
    return found


def _kind(n: torch.fx.Node, feeds: set) -> int:
    """Which ready nodes run first: inputs, then starts and what the next start needs, then compute, then waits."""
    if n.op == "placeholder":
        return INPUT
    if n.target is WAIT:  # even one the next start needs: whatever else is ready runs first
        return WAITS
    return START if is_start(n) or n in feeds else COMPUTE


def _overlap_order(nodes: list[torch.fx.Node], after: dict, waiting: dict, starts: list) -> list[torch.fx.Node]:
    """Kahn's algorithm over the constraints, ready nodes taken by :func:`_kind`, then by original position."""
    index = {n: i for i, n in enumerate(nodes)}
    done: set = set()
    feeds = _feeding(starts[0], done)
    ready = [(_kind(n, feeds), index[n], n) for n in nodes if not waiting[n]]
    heapq.heapify(ready)
    order, next_start = [], 0
    while ready:
        _, _, n = heapq.heappop(ready)
        order.append(n)
        done.add(n)
        if next_start < len(starts) and n is starts[next_start]:
            next_start += 1
            feeds = _feeding(starts[next_start] if next_start < len(starts) else None, done)
            ready = [(_kind(m, feeds), index[m], m) for _, _, m in ready]
            heapq.heapify(ready)
        for m in after[n]:
            waiting[m] -= 1
            if not waiting[m]:
                heapq.heappush(ready, (_kind(m, feeds), index[m], m))
    assert len(order) == len(nodes), "cp_passes internal error: the overlap schedule left nodes out"
    return order
