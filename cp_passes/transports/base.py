"""What a transport is, and the registry of them.

A transport moves sequence data between ranks for a rewrite a rule asked for. It owns four things:

- ``name`` (what a rule's :class:`~cp_passes.rules.Rewrite` names) and ``order`` (transports run one
  after another in this order; each graph in a compile record's history shows one transport added);
- ``layouts``: the :class:`~cp_passes.layout.Layout` kinds it supports (planning refuses others);
- ``apply(edit, request)``: the graph edit for one request, made through
  :class:`~cp_passes.graph.provenance.Edit` so every node it touches is tagged;
- ``cost(request, layout, rank, local_len)``: what this rank receives and sends per forward and the lower
  bound, from the layout (the only place bytes are counted);

plus ``runtime``: the custom ops (``cp_passes::...``) its edits insert that issue collectives. Every rank
must issue those in the same order; :mod:`cp_passes.compiler.agreement` checks that they do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..layout import CONTIGUOUS


@dataclass
class Cost:
    """What one rewrite moves for one rank per forward (the backward moves the same the other way)."""

    collective: str = ""
    elements: int = 0
    bytes: int = 0
    lower_bound_bytes: int = 0
    sent_bytes: int = 0
    metadata_bytes: int = 0
    """Of ``bytes``, those of metadata gathered without autograd: positions, doc ids, counts."""

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(" + ".join(c for c in (self.collective, other.collective) if c),
                    self.elements + other.elements, self.bytes + other.bytes,
                    self.lower_bound_bytes + other.lower_bound_bytes, self.sent_bytes + other.sent_bytes,
                    self.metadata_bytes + other.metadata_bytes)


class Transport:
    """Base class: subclass, set the class attributes, implement ``apply`` and ``cost``, and register an
    instance with :func:`register_transport`."""

    name: ClassVar[str]
    order: ClassVar[int]
    layouts: ClassVar[tuple[str, ...]] = (CONTIGUOUS,)
    runtime: ClassVar[tuple] = ()
    """The custom ops this transport's edits insert that issue collectives."""
    gathers_keys: ClassVar[bool] = False
    """Its edits all-gather keys and values for attention, with autograd: ``CPSpec.gathered_keys`` chooses
    whether the backward saves the gathered copy or gathers again."""

    def apply(self, edit, request) -> None:
        raise NotImplementedError

    def cost(self, request, layout, rank: int, local_len: int) -> Cost:
        return Cost()


def gradient_by(op, backward_op, backward_args=None) -> None:
    """Register the autograd of custom op ``op(x, *args)``: its gradient is ``backward_op(grad, *args)`` (or
    ``backward_op(grad, *backward_args(*args))``), and the other arguments (ints, the group name) have none."""

    def setup_context(ctx, inputs, output):
        ctx.args = inputs[1:]

    def backward(ctx, grad):
        args = backward_args(*ctx.args) if backward_args is not None else ctx.args
        return (backward_op(grad.contiguous(), *args),) + (None,) * len(ctx.args)

    op.register_autograd(backward, setup_context=setup_context)


TRANSPORTS: dict[str, Transport] = {}


def register_transport(transport: Transport) -> Transport:
    if not isinstance(transport, Transport):
        raise TypeError(f"register_transport takes a Transport instance, got {transport!r}")
    if transport.name in TRANSPORTS and type(TRANSPORTS[transport.name]) is not type(transport):
        raise ValueError(f"a transport named {transport.name!r} is already registered "
                         f"({type(TRANSPORTS[transport.name]).__name__})")
    TRANSPORTS[transport.name] = transport
    return transport


def unregister_transport(name: str) -> None:
    TRANSPORTS.pop(name, None)


def in_order() -> list[Transport]:
    return sorted(TRANSPORTS.values(), key=lambda t: (t.order, t.name))


def collective_ops() -> set:
    """Every runtime op that issues a collective, over all registered transports."""
    return {op for t in TRANSPORTS.values() for op in t.runtime}
