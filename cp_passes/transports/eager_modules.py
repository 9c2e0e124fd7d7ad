"""Eager modules: a module that runs outside the analysed graph on every rank moves nothing; the rewrite table lists
it so that ``explain`` says what ran where. It runs last: it only tags, and the graph's dead-code elimination
after a transport must not run before the transports whose requests name nodes still unused."""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx

from .base import Cost, Transport, register_transport


@dataclass
class EagerCall:
    node: torch.fx.Node
    path: str


class EagerTransport(Transport):
    name = "eager_modules"
    order = 50

    def apply(self, edit, request: EagerCall) -> None:
        edit.changed(request.node)

    def cost(self, request: EagerCall, layout, rank, local_len) -> Cost:
        return Cost("none: eager on every rank, whole inputs (the backward runs it again)")


EAGER = register_transport(EagerTransport())
