"""The rule table and what a rule sees and returns.

A rule is a function ``rule(ctx: RuleContext)`` registered for one or more ops (an ``OpOverload`` or a
whole ``OpOverloadPacket``). It only decides; it returns

- ``None``: the op is correct on a local shard as it is;
- ``Value.PARTIAL``: as it is, but its output is this rank's share of a sum over the sequence;
- a :class:`Rewrite`: a request that the named transport (see :mod:`cp_passes.transports`) edits the graph
  for this node, with what it needs to know (``request``);

or refuses with ``ctx.refuse(why, fix)``, which stops compilation with an error naming the op and its
source line. An op with a sharded input and no rule is refused, never run as if it were position-wise.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch
import torch.fx

from ..errors import Problem
from ..graph.analysis import hint, meta_val, seq_dims

if TYPE_CHECKING:
    import sympy

    from ..layout import Layout
    from ..match import Matches
    from ..spec import CPSpec

aten = torch.ops.aten

_RULES: dict[object, Callable] = {}


class Value(enum.Enum):
    """What a value is under CP, as the planner tracks it (a lattice: each op's output from its inputs)."""

    REPLICATED = "replicated"
    """The same on every rank, or free of the sequence."""
    SEQUENCE = "sequence"
    """Sharded along the sequence: this rank's positions (read from the shape: a dim sized by the symbol)."""
    PARTIAL = "partial"
    """This rank's share of a sum over the sequence: the ranks' values add up to the single-device value (the ops
    it flows through as it is: :mod:`.partial`)."""


ALWAYS: set = set()
"""Ops whose rule is asked even when no input or output carries the sequence."""


def register_rule(*ops, always: bool = False, replace: bool = False):
    """Register ``fn`` as the rule for each op (an OpOverload, or an OpOverloadPacket for all overloads);
    ``always``: ask it for every call, not only those that touch the sequence. An op that has a rule keeps it
    unless ``replace`` says to replace it (a second registration is more often a mistake than an override)."""

    def decorator(fn):
        taken = [op for op in ops if op in _RULES and _RULES[op] is not fn]
        if taken and not replace:
            raise ValueError(f"{', '.join(map(str, taken))} already has a rule ({_RULES[taken[0]].__module__}."
                             f"{_RULES[taken[0]].__qualname__}); pass register_rule(..., replace=True) to replace it")
        for op in ops:
            _RULES[op] = fn
            if always:
                ALWAYS.add(op)
        return fn

    return decorator


def positionwise(*ops) -> None:
    """Declare ops that never mix sequence positions (each output position reads only its own)."""
    register_rule(*ops)(positionwise_rule)


def positionwise_rule(ctx: "RuleContext"):
    return None


def registered(target) -> bool:
    """Whether a rule was registered for ``target`` itself or its packet (not derived from another op)."""
    return target in _RULES or getattr(target, "overloadpacket", None) in _RULES


def lookup_rule(target):
    """The rule for ``target``: registered for the overload or its packet, the position-wise rule for ops
    tagged pointwise, or else the rule of the out-of-place op an in-place one (``add_``, ``__iand__``) mutates
    like."""
    if target in _RULES:
        return _RULES[target]
    packet = getattr(target, "overloadpacket", None)
    if packet is not None and packet in _RULES:
        return _RULES[packet]
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        return positionwise_rule
    functional = out_of_place(target)
    return lookup_rule(functional) if functional is not None else None


def out_of_place(target):
    """``aten.masked_fill.Scalar`` for ``aten.masked_fill_.Scalar``, ``aten.__and__.Tensor`` for
    ``aten.__iand__.Tensor``; None for other ops."""
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return None
    name = target.overloadpacket.__name__
    if name.startswith("__i") and name.endswith("__"):
        name = "__" + name[3:]
    elif name.endswith("_") and not name.endswith("__"):
        name = name[:-1]
    else:
        return None
    packet = getattr(torch.ops.aten, name, None)
    return getattr(packet, target._overloadname, None) if packet is not None else None


class Refusal(Exception):
    def __init__(self, problem: Problem):
        self.problem = problem


@dataclass
class Rewrite:
    """A rule's request: transport ``transport`` edits the graph for this node as ``request`` describes."""

    rule: str
    """Name shown in the rewrite table and the graph tags."""
    transport: str
    """A registered transport's name; planning refuses any other."""
    request: object = None
    output: Value | None = None
    """The output's value when the rewrite changes it (``Value.PARTIAL`` for a global mean)."""
    note: str = ""


@dataclass
class RuleContext:
    node: torch.fx.Node
    sym: sympy.Symbol
    """The sequence length's symbol."""
    spec: CPSpec
    rank: int
    world: int
    layout: Layout
    length: torch.SymInt
    """The local sequence length as the graph carries it (``sym`` is its symbol)."""
    matches: Matches | None = None
    """What the matchers found (:class:`cp_passes.match.Matches`)."""
    values: dict = field(default_factory=dict)
    """The planner's values so far: node -> :class:`Value` where it is not read from the shape."""
    orders: dict = field(default_factory=dict)
    """Values holding the rank's rows in a sort's order, its indices or counts -> their
    :class:`~cp_passes.rules.permutations.Order` (a tuple of them for a sort's outputs)."""
    args: dict = field(default_factory=dict)
    brought: set = field(default_factory=set)
    """Inputs the planner brings whole along the key axis of a ``[q, k]`` block: not sharded here."""

    # -- queries -------------------------------------------------------------------------
    def arg(self, name):
        return self.args[name]

    def seq_dims(self, value) -> tuple[int, ...]:
        """The sharded sequence dims: a block's key axis and a brought input are whole on every rank."""
        if isinstance(value, torch.fx.Node) and value in self.brought:
            return ()
        key = self.matches.blocks.keys.get(value) if isinstance(value, torch.fx.Node) and self.matches else None
        return tuple(d for d in seq_dims(value, self.sym) if d != key)

    def is_seq(self, value) -> bool:
        return bool(self.seq_dims(value))

    def value(self, value) -> Value:
        if isinstance(value, torch.fx.Node) and value in self.values:
            return self.values[value]
        return Value.SEQUENCE if self.is_seq(value) else Value.REPLICATED

    def is_partial(self, value) -> bool:
        return self.value(value) is Value.PARTIAL

    def tensor_inputs(self) -> list[torch.fx.Node]:
        return [a for a in self.node.all_input_nodes if isinstance(meta_val(a), torch.Tensor)]

    def seq_inputs(self) -> list[torch.fx.Node]:
        return [a for a in self.tensor_inputs() if self.is_seq(a)]

    def ndim(self, value) -> int:
        return meta_val(value).dim()

    def dims(self, dims, ndim: int) -> set[int]:
        """Normalise a dim / dim list argument; ``None`` or ``[]`` mean every dim."""
        if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
            return set(range(ndim))
        if isinstance(dims, int):
            dims = [dims]
        return {d % max(ndim, 1) for d in dims}

    def local_len(self) -> int:
        return hint(self.length)

    # -- verdicts ------------------------------------------------------------------------
    def refuse(self, why: str, fix: str):
        raise Refusal(Problem.at(self.node, why, fix))

    def require_not_along_sequence(self, value, dims, what: str = "operates along", fix: str | None = None):
        along = self.dims(dims, self.ndim(value)) & set(self.seq_dims(value))
        if along:
            self.refuse(
                f"it {what} dim {sorted(along)}, the sequence axis (sharded across {self.world} ranks), and "
                f"cp_passes has no rule for that",
                fix or NO_RULE_FIX,
            )


NO_RULE_FIX = (
    "keep this op off the sequence axis, move it outside the compiled module, or register a rule "
    "for it with @cp_passes.register_rule(op) (see README, 'Rules for your own ops')"
)
