"""What a compiled graph keeps for its backward, per rank, read from AOTAutograd's partition.

The backward graph's inputs are the incoming gradients (``tangents_*``) and everything the forward saved for
it; the saved tensors' sizes at the compiled length are this rank's saved activations (parameters the
backward reads are among them: they are the forward's inputs, not extra memory, and are counted apart).

:class:`MemoryEstimate` puts a rank's figures beside the single-device model's divided by P: saved tensors
by module, the largest collective buffer, and the largest tensor that grows with the square of the sequence
(a mask, say), which CP must keep at ``local x keys brought``.
"""

from __future__ import annotations

import collections
import operator
import re
from dataclasses import dataclass, field

import torch
import torch.fx

from ..graph.analysis import meta_val, numel_hint
from ..graph.calls import is_start, operands


@dataclass(frozen=True)
class Saved:
    name: str
    shape: str
    bytes: int
    primal: bool
    """An input of the forward (a parameter, a batch tensor) or a view of one (a weight's transpose): read by
    the backward, not kept by it."""
    module: str = ""
    """The module whose forward computed it (``layers.3.attn``), where the forward graph says."""


def _origins(forward: torch.fx.GraphModule | None) -> dict[str, tuple[torch.fx.Node, bool]]:
    """Each forward node -> the node whose memory it is, and whether it is that tensor itself rather than a view
    of it. A view's origin is its base's (``t(primals_3)``: ``primals_3``); a region call's result that the region
    handed back from one of its operands (a block returns its weights and its input for its backward), as it is or
    as a view, is that operand's. Any other value is its own."""
    if forward is None:
        return {}
    origins: dict[str, tuple[torch.fx.Node, bool]] = {}

    def handed_back(call: torch.fx.Node, index: int) -> tuple[object, bool]:
        """The call's operand that the subgraph's ``index``-th result is (or is a view of), if any."""
        value, same = _returned(forward, call, index), True
        while isinstance(value, torch.fx.Node) and _is_view(value):
            value, same = value.args[0], False
        if not (isinstance(value, torch.fx.Node) and value.op == "placeholder"):
            return None, True
        return operands(call)[list(value.graph.find_nodes(op="placeholder")).index(value)], same

    for node in forward.graph.nodes:
        origin, same, base = node, True, None
        if _is_view(node):
            base, same = node.args[0], False
        elif _call_of_result(node) is not None:
            base, same = handed_back(node.args[0], node.args[1])
        if isinstance(base, torch.fx.Node) and base.name in origins:
            origin, base_same = origins[base.name]
            same = same and base_same
        origins[node.name] = (origin, same)
    return origins


def _call_of_result(node: torch.fx.Node) -> torch.fx.Node | None:
    """The region call (``invoke_subgraph``) whose result ``node`` is (``call[i]``); None for any other value."""
    call = node.args[0] if node.target is operator.getitem and node.args else None
    return call if isinstance(call, torch.fx.Node) and call.target is torch.ops.higher_order.invoke_subgraph else None


def _returned(forward: torch.fx.GraphModule, call: torch.fx.Node, index: int):
    """The value the subgraph ``call`` runs returns as its ``index``-th result."""
    (output,) = getattr(forward, call.args[0].target).graph.find_nodes(op="output")
    return output.args[0][index]


def region_call_of(node: torch.fx.Node) -> torch.fx.Node | None:
    """The region call whose result ``node`` is, or a view of; None for any other value."""
    while _is_view(node):
        node = node.args[0]
    return _call_of_result(node)


def _is_view(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target.is_view
            and isinstance(node.args[0], torch.fx.Node))


def module_of(node: torch.fx.Node) -> str | None:
    """The module that made ``node`` (for a piece of a tuple without its own, the tuple's)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack and node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
        return module_of(node.args[0])
    return re.sub(r"^L\['self'\]\.?", "", str(list(stack.values())[-1][0])) if stack else None


def _module_paths(forward: torch.fx.GraphModule | None) -> dict[str, str]:
    """Each forward node's module path; a result of a region's call (``invoke_subgraph``) takes the path of the
    module inside the block that made it, under the call's block (``layers.5.attn``)."""
    if forward is None:
        return {}
    paths = {}
    for node in forward.graph.nodes:
        path = module_of(node)
        if path is not None:
            paths[node.name] = path
        call = _call_of_result(node)
        if call is not None:
            made = _returned(forward, call, node.args[1])
            inner, block = module_of(made) if isinstance(made, torch.fx.Node) else None, module_of(call)
            if inner and block:  # the subgraph's paths are the first call's block's: keep what is below it
                paths[node.name] = ".".join(block.split(".") + inner.split(".")[len(block.split(".")):])
    return paths


def _bytes(val: torch.Tensor, length) -> int:
    """``val``'s bytes at its compile-time sizes, or with ``length = (symbol, value)`` substituted."""
    if length is None:
        return numel_hint(val) * val.element_size()
    sym, value = length
    n = 1
    for size in val.shape:
        n *= int(size.node.expr.subs(sym, value)) if isinstance(size, torch.SymInt) else int(size)
    return n * val.element_size()


def saved_for_backward(backward: torch.fx.GraphModule, forward: torch.fx.GraphModule | None = None,
                       length=None) -> list[Saved]:
    """The backward's inputs other than gradients; named by module when the ``forward`` graph is given, sized
    at ``length = (symbol, value)`` when given (else at the compile-time hint)."""
    paths, origins, saved, kept = _module_paths(forward), _origins(forward), [], set()
    for node in backward.graph.find_nodes(op="placeholder"):
        val = meta_val(node)
        if node.name.startswith("tangents") or not isinstance(val, torch.Tensor):
            continue
        origin, same = origins.get(node.name, (None, True))
        if same:  # one tensor the backward receives twice (a region hands back its operand): kept once
            if (origin.name if origin is not None else node.name) in kept:
                continue
            kept.add(origin.name if origin is not None else node.name)
        primal = node.name.startswith("primals") or (origin is not None and origin.op == "placeholder")
        saved.append(Saved(node.name, str(tuple(val.shape)), _bytes(val, length), primal, paths.get(node.name, "")))
    return saved


def saved_activation_bytes(saved: list[Saved]) -> int:
    """The bytes the forward kept for the backward beyond its own inputs."""
    return sum(s.bytes for s in saved if not s.primal)


def by_module(saved: list[Saved]) -> list[tuple[str, int, int]]:
    """Saved activations grouped by module path with layer indices folded (``layers.*.attn``): ``(path,
    tensors, bytes)``, largest first."""
    groups: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for s in saved:
        if not s.primal:
            group = groups[re.sub(r"(?<=\.)\d+(?=\.|$)", "*", s.module) or "(model)"]
            group[0] += 1
            group[1] += s.bytes
    return sorted(((path, n, b) for path, (n, b) in groups.items()), key=lambda g: -g[2])


@dataclass(frozen=True)
class Largest:
    bytes: int = 0
    what: str = ""
    elements: int = 0


def largest(graphs: list[torch.fx.GraphModule], keep, length=None) -> Largest:
    """The largest tensor value of a node ``keep(node, val)`` accepts, in any of ``graphs``."""
    best = Largest()
    for graph in [g for top in graphs for g in top.modules() if isinstance(g, torch.fx.GraphModule)]:
        paths = _module_paths(graph)  # a region's subgraph is a submodule of the graph that calls it
        for node in graph.graph.nodes:
            val = meta_val(node)
            if isinstance(val, torch.Tensor) and node.op == "call_function" and keep(node, val):
                size = _bytes(val, length)
                if size > best.bytes:
                    where = paths.get(node.name)
                    best = Largest(size, f"{node.target} {tuple(val.shape)} {str(val.dtype).removeprefix('torch.')}"
                                   + (f" in {where}" if where else ""), size // val.element_size())
    return best


def quadratic(sym):
    """``keep`` for :func:`largest`: a value with two or more dims that grow with the sequence (``sym``)."""

    def keep(node, val):
        return sum(isinstance(s, torch.SymInt) and sym in s.node.expr.free_symbols for s in val.shape) >= 2

    return keep


def collective_output(ops):
    """``keep`` for :func:`largest`: the result of a collective (``ops``, or a functional collective the graph
    waits for), forward or backward."""

    def keep(node, val):
        return node.target in ops or is_start(node)

    return keep


@dataclass
class MemoryEstimate:
    """One rank's memory beside the single-device model's divided by P, from AOTAutograd's partitions."""

    world: int
    saved: list[Saved]
    single_saved: list[Saved]
    collective: Largest = field(default_factory=Largest)
    quadratic: Largest = field(default_factory=Largest)
    single_quadratic: Largest = field(default_factory=Largest)
    parameter_bytes: int = 0

    @property
    def saved_bytes(self) -> int:
        return saved_activation_bytes(self.saved)

    @property
    def single_share(self) -> float:
        """The single-device model's saved activations divided by P."""
        return saved_activation_bytes(self.single_saved) / self.world

    @property
    def ratio(self) -> float:
        return self.saved_bytes / self.single_share if self.single_share else float("nan")


def format_memory(estimate: MemoryEstimate, rank: int, local_len: int, fmt, groups: int = 6) -> list[str]:
    """The memory lines of the CLI's plan; ``fmt`` formats bytes."""
    world, saved = estimate.world, estimate.saved_bytes
    lines = [f"memory of rank {rank} at {local_len} tokens (AOTAutograd's min-cut partition of the rewritten graph "
             f"on fake tensors, as cp_compile lowers it):",
             f"  saved for backward   {fmt(saved)}; one device at {world * local_len} tokens saves "
             f"{fmt(world * estimate.single_share)}, / {world} = {fmt(estimate.single_share)} "
             f"(ratio {estimate.ratio:.2f})"]
    table = by_module(estimate.saved)
    for path, n, size in table[:groups]:
        lines.append(f"    {path:<32} {fmt(size):>10} in {n} tensors")
    if len(table) > groups:
        lines.append(f"    {'(the rest)':<32} {fmt(sum(g[2] for g in table[groups:])):>10}")
    lines.append(f"  largest collective buffer  {fmt(estimate.collective.bytes)} "
                 f"({estimate.collective.what or 'none'}): held while it is used")
    single = estimate.single_quadratic
    lines.append(f"  largest [sequence x sequence] tensor  {fmt(estimate.quadratic.bytes)} "
                 f"({estimate.quadratic.what or 'none'}); one device: {fmt(single.bytes)} ({single.what or 'none'})")
    params = estimate.parameter_bytes
    lines.append(f"  parameters {fmt(params)} and their gradients {fmt(params)} on every CP rank; AdamW adds two "
                 f"copies more (shard all three over data x context parallel ranks with FSDP2)")
    lines.append(f"  at least {fmt(saved + estimate.collective.bytes + 2 * params)} on this rank at the start of the "
                 f"backward (saved + the collective buffer + parameters and gradients), before optimizer state "
                 f"and the backward's own transients")
    return lines
