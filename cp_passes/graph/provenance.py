"""Provenance: which pass and rule made or changed each node, in a form that survives AOTAutograd.

Tags live in ``node.meta["custom"]``; AOTAutograd copies that field onto every ATen node it traces
from a tagged node, in the forward graph and (for its gradient) in the backward graph, so the dumped
forward/backward graphs say which pass made each collective. :func:`format_graph` prints the tags.
"""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.fx

PASS, RULE = "cp_pass", "cp_rule"
_REPLACED = "cp_passes_replaced"
"""``gm.meta`` key: node -> the node a transport replaced its uses with."""
_PLANNED = "cp_passes_planned"
"""``gm.meta`` key: the inverse of ``_REPLACED`` (a replacement -> the node it replaced)."""
_COPIED_META = ("stack_trace", "nn_module_stack", "source_fn_stack")


def tag(node: torch.fx.Node, transport: str, rule: str) -> None:
    """Record that ``transport`` changed ``node`` for ``rule``."""
    custom = dict(node.meta.get("custom") or {})
    custom.update({PASS: transport, RULE: rule})
    node.meta["custom"] = custom


def tags(node: torch.fx.Node) -> tuple[str, str] | None:
    custom = node.meta.get("custom") or {}
    return (custom[PASS], custom[RULE]) if PASS in custom else None


class Edit:
    """The graph edits of one planned rewrite. Every node it creates or changes is tagged with the
    transport and rule, and the rewrite counts as applied once anything was tagged (verify checks).
    ``keep`` are nodes whose inputs no edit may rewire: the matchers claimed them for a pattern whose own
    rule evaluates them as the single device would (a model-built mask)."""

    def __init__(self, gm: torch.fx.GraphModule, origin: torch.fx.Node, transport: str, rule: str, *, rank: int,
                 world: int, group_name: str, layout, keep: frozenset = frozenset()):
        self.gm, self.graph, self.origin = gm, gm.graph, origin
        self.transport, self.rule = transport, rule
        self.rank, self.world, self.group_name, self.layout = rank, world, group_name, layout
        self.keep = keep
        self.nodes: list[torch.fx.Node] = []
        """Every node this edit created or changed."""
        self.created: list[torch.fx.Node] = []
        """The nodes this edit created."""

    @property
    def applied(self) -> bool:
        return bool(self.nodes)

    def replace_uses(self, old: torch.fx.Node, new: torch.fx.Node, *, keep_claimed: bool = True) -> None:
        """Make every user of ``old`` read ``new`` instead, except the nodes this edit created (which read
        ``old`` on purpose) and, unless ``keep_claimed`` is False, the kept nodes. Later transports find
        ``new`` in ``old``'s place through :meth:`current`."""
        created, keep = set(self.created), self.keep if keep_claimed else frozenset()
        old.replace_all_uses_with(new, delete_user_cb=lambda user: user not in created and user not in keep)
        self.gm.meta.setdefault(_REPLACED, {})[old] = new
        self.gm.meta.setdefault(_PLANNED, {})[new] = old

    def current(self, node: torch.fx.Node) -> torch.fx.Node:
        """What stands for ``node`` now: the value an earlier transport replaced it with, if any. A planned
        request names the nodes of the graph as it was planned; a transport reads its sources through this."""
        replaced = self.gm.meta.get(_REPLACED, {})
        while node in replaced:
            node = replaced[node]
        return node

    def planned(self, node: torch.fx.Node) -> torch.fx.Node:
        """The node of the graph as it was planned that ``node`` stands for now (the inverse of :meth:`current`):
        a pattern's nodes copied whole (a model-built mask) read their inputs as planned, not as an earlier
        transport rewired them (an ``arange`` the mask shares with the rotary, now this rank's positions)."""
        replaced_by = self.gm.meta.get(_PLANNED, {})
        while node in replaced_by:
            node = replaced_by[node]
        return node

    def insert(self, target, args, kwargs=None, *, name: str, before: torch.fx.Node | None = None) -> torch.fx.Node:
        """Create a node before ``before`` (default: the origin) with the origin's source information."""
        with self.graph.inserting_before(before if before is not None else self.origin):
            node = self.graph.create_node("call_function", target, tuple(args), kwargs or {}, name=name)
        for key in _COPIED_META:
            if key in self.origin.meta:
                node.meta[key] = self.origin.meta[key]
        self.created.append(node)
        return self.changed(node)

    def copy(self, node: torch.fx.Node, replace: dict, *, name: str) -> torch.fx.Node:
        """A copy of ``node`` before the origin, reading ``replace[a]`` where it reads ``a`` now or read it as
        planned."""
        args, kwargs = torch.fx.map_arg((node.args, node.kwargs),
                                        lambda a: replace[a] if a in replace else replace.get(self.planned(a), a))
        return self.insert(node.target, args, kwargs, name=name)

    def call_module(self, name: str, module: torch.nn.Module, args) -> torch.fx.Node:
        """A call of ``module`` before the origin, registered as ``name`` or, where another module already
        holds that name (two masks evaluated for one op), a fresh ``name_1``, ``name_2``..."""
        base, i = name, 0
        while (held := getattr(self.gm, name, None)) is not None and held is not module:
            i += 1
            name = f"{base}_{i}"
        self.gm.add_submodule(name, module)
        with self.graph.inserting_before(self.origin):
            node = self.graph.call_module(name, tuple(args))
        if "stack_trace" in self.origin.meta:
            node.meta["stack_trace"] = self.origin.meta["stack_trace"]
        self.created.append(node)
        return self.changed(node)

    def changed(self, node: torch.fx.Node) -> torch.fx.Node:
        tag(node, self.transport, self.rule)
        self.nodes.append(node)
        return node


def format_graph(gm: torch.fx.GraphModule) -> str:
    """``print_readable`` with every tagged node marked ``# cp_passes: pass=.. rule=..``."""
    made = {n.name: tags(n) for n in gm.graph.nodes if tags(n)}
    lines = []
    for line in gm.print_readable(print_output=False).splitlines():
        m = re.match(r"\s+(\w+)(?::\s*\"[^\"]*\")?\s*=", line)
        if m and m.group(1) in made:
            transport, rule = made[m.group(1)]
            line = f"{line}  # cp_passes: pass={transport} rule={rule}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def eliminate_dead_code(gm: torch.fx.GraphModule, pinned: frozenset = frozenset()) -> None:
    """Remove the nodes nothing reads, except ``pinned`` ones (a later transport copies them), counting a node
    a transport replaced (:meth:`Edit.replace_uses`) as pure: FX keeps an unread
    ``scaled_dot_product_attention`` for the random numbers its dropout could draw, so a replaced attention (and
    the mask only it read) would otherwise stay in the rewritten graph: in the dry run's graphs and its memory
    report, at least."""
    replaced = gm.meta.get(_REPLACED, {})
    gm.graph.eliminate_dead_code(
        is_impure_node=lambda n: n in pinned or (n not in replaced and n.is_impure()))


def request_nodes(requests) -> frozenset:
    """Every graph node the planned requests name, through their dataclass fields and containers (a mask's
    nodes, which the key transports copy whole)."""
    found, todo, seen = set(), list(requests), set()
    while todo:
        item = todo.pop()
        if isinstance(item, torch.fx.Node):
            found.add(item)
        elif id(item) in seen:
            continue
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            seen.add(id(item))
            todo.extend(getattr(item, f.name) for f in dataclasses.fields(item))
        elif isinstance(item, (list, tuple, set, frozenset)):
            seen.add(id(item))
            todo.extend(item)
        elif isinstance(item, dict):
            seen.add(id(item))
            todo.extend(item.keys())
            todo.extend(item.values())
    return frozenset(found)
