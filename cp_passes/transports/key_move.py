"""The key mover: one function that brings an attention's keys as its :class:`~cp_passes.key_plan.KeyPlan` says.

Every attention's key side moves here, SDPA's K and V (:mod:`.attention`) and the key-axis operands of attention
written by hand (:mod:`.keys`) alike: :func:`move_keys` inserts the nodes, :func:`move_cost` counts what they
receive and send. Each :class:`~cp_passes.key_plan.Move` has one :class:`KeyMover`:

- ``Move.HALO`` (:class:`HaloMover`): the ``before`` rows before each of the rank's ranges and the ``after`` rows
  after (:func:`~.halo_exchange.halo_op`, one ``all_to_all``);
- ``Move.PREFIX`` (:class:`PrefixMover`): every position before the end of the rank's last range, in global order,
  started, waited for and finished as three nodes so that compute runs while it travels
  (:func:`~.prefix_exchange.insert_exchange`); from each range's first key a mask shows (packed documents) in
  one op (:func:`~.prefix_exchange.prefix_gather_op`);
- ``Move.EVERY_KEY`` (:class:`EveryKeyMover`): an all-gather (activations with a reduce-scatter backward, metadata
  without autograd), in rank order or in global order.

Another way of moving a plan's keys (a ring that brings the causal prefix one rank at a time, say) is a
:class:`KeyMover` registered for its move with :func:`register_mover`: rules, plans and attention rewrites stay
as they are (``tests/test_key_move.py`` holds such a ring).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
import torch.fx

from ..key_plan import KeyPlan, Move
from ..layout import CONTIGUOUS, KINDS, Layout
from .base import Cost
from .gathers import in_global_order, metadata_gather_op, sequence_gather_op  # noqa: F401  (registers the ops)
from .halo_exchange import halo_op  # noqa: F401  (registers cp_passes::halo)
from .prefix_exchange import insert_exchange, prefix_cost, prefix_gather_op, prefix_start  # noqa: F401


class KeyMover:
    """How one :class:`~cp_passes.key_plan.Move` brings keys. Subclass, set ``move``, ``layouts`` and
    ``runtime``, implement :meth:`insert` and :meth:`cost`, and :func:`register_mover` an instance."""

    move: ClassVar[Move]
    layouts: ClassVar[tuple[str, ...]] = KINDS
    """The layout kinds it supports (others fail at compile time, on every rank)."""
    runtime: ClassVar[tuple] = ()
    """The ops (or traced functions) its nodes call that issue collectives: the ranks' agreement fingerprints
    them."""

    def insert(self, edit, x: torch.fx.Node, dim: int, plan: KeyPlan, name: str, *, firsts: torch.fx.Node | None,
               left_padding: int, global_order: bool, metadata: bool) -> torch.fx.Node:
        """A node (before ``edit``'s origin) holding the keys of ``x`` along ``dim`` that ``plan`` brings."""
        raise NotImplementedError

    def cost(self, plan: KeyPlan, layout: Layout, rank: int, local_len: int, row: int, itemsize: int, what: str | None,
             metadata: bool) -> Cost:
        """What :meth:`insert`'s nodes receive and send on rank ``rank`` per forward (``row`` bytes a position),
        against the lower bound."""
        raise NotImplementedError


class HaloMover(KeyMover):
    move = Move.HALO
    runtime = (torch.ops.cp_passes.halo.default,)

    def insert(self, edit, x, dim, plan, name, *, firsts, left_padding, global_order, metadata):
        return edit.insert(torch.ops.cp_passes.halo.default,
                           (x, dim, plan.halo, left_padding, edit.rank, edit.world, edit.group_name, edit.layout.kind)
                           + ((plan.after,) if plan.after else ()), name=name)

    def cost(self, plan, layout, rank, local_len, row, itemsize, what, metadata):
        send, recv, _ = layout.halo_counts(plan.halo, rank, local_len, plan.after)
        rows = f"{plan.halo} rows" + (f" before and {plan.after} after" if plan.after else "")
        moved = sum(recv) * row
        return Cost(f"all_to_all {rows}" + (f" of {what}" if what else "") + ("" if metadata else " | bw all_to_all"),
                    moved // itemsize, moved, moved, sum(send) * row)


class PrefixMover(KeyMover):
    move = Move.PREFIX
    runtime = (torch.ops.cp_passes.prefix_gather.default, prefix_start)

    def insert(self, edit, x, dim, plan, name, *, firsts, left_padding, global_order, metadata):
        if firsts is None:
            return insert_exchange(edit, x, dim, name)
        return edit.insert(torch.ops.cp_passes.prefix_gather.default,
                           (x, dim, edit.rank, edit.world, edit.group_name, edit.layout.kind, firsts), name=name)

    def cost(self, plan, layout, rank, local_len, row, itemsize, what, metadata):
        scope = ("from each range's first key its mask shows, at most the causal prefix" if plan.first_keys
                 else "causal prefix")
        cost = prefix_cost(layout, rank, local_len, row, itemsize, what or "rows",
                           "" if metadata else " | bw all_to_all", scope=scope)
        return with_window_bound(cost, plan, layout, rank, local_len, row)


class EveryKeyMover(KeyMover):
    move = Move.EVERY_KEY
    runtime = (torch.ops.cp_passes.sequence_gather.default, torch.ops.cp_passes.metadata_gather.default)

    def insert(self, edit, x, dim, plan, name, *, firsts, left_padding, global_order, metadata):
        op = torch.ops.cp_passes.metadata_gather if metadata else torch.ops.cp_passes.sequence_gather
        brought = edit.insert(op.default, (x, dim, edit.world, edit.group_name), name=name)
        if global_order and edit.layout.kind != CONTIGUOUS:
            brought = edit.insert(in_global_order, (brought, dim, edit.world, edit.layout.kind),
                                  name=name + "_in_order")
        return brought

    def cost(self, plan, layout, rank, local_len, row, itemsize, what, metadata):
        moved = (layout.world - 1) * local_len * row
        backward = " (no grad)" if metadata else " | bw reduce_scatter"
        return Cost("all_gather" + (f" {what}" if what else "") + backward, moved // itemsize, moved, moved, moved)


def with_window_bound(cost: Cost, plan: KeyPlan, layout: Layout, rank: int, local_len: int, row: int) -> Cost:
    """``cost`` of a causal move whose plan is a window brought by gather (as the spec asks): the window's halo is
    the lower bound."""
    if plan.reach.before is None:
        return cost
    window = sum(layout.halo_counts(plan.reach.before, rank, local_len)[1]) * row
    return dataclasses.replace(cost, lower_bound_bytes=window)


MOVERS: dict[Move, KeyMover] = {}
"""The mover of each :class:`~cp_passes.key_plan.Move`."""


def register_mover(mover: KeyMover, replace: bool = False) -> KeyMover:
    """Make ``mover`` the one that brings ``mover.move``'s keys; replacing one that is registered needs
    ``replace=True`` (a test's toy mover then restores the original with another call)."""
    if mover.move in MOVERS and not replace:
        raise ValueError(f"a key mover for {mover.move.value} is registered; pass replace=True to replace it")
    MOVERS[mover.move] = mover
    return mover


BUILT_IN = tuple(register_mover(mover) for mover in (HaloMover(), PrefixMover(), EveryKeyMover()))


def runtime() -> tuple:
    """Every registered mover's collective-issuing ops, for the key transports' ``runtime``."""
    return tuple(op for mover in MOVERS.values() for op in mover.runtime)


def move_keys(edit, x: torch.fx.Node, dim: int, plan: KeyPlan, name: str, *, firsts: torch.fx.Node | None = None,
              left_padding: int = 0, global_order: bool = False, metadata: bool = False) -> torch.fx.Node:
    """A node (before ``edit``'s origin) holding the keys of ``x`` along ``dim`` that ``plan`` brings, by the
    mover of its move.

    ``firsts``: each range's first key a mask shows (packed documents; the causal prefix only). ``left_padding``:
    zero rows in front of each range's halo (hidden by the mask). ``global_order``: every key in the order of
    global positions (what a mask over the whole sequence reads) rather than rank order. ``metadata``: every key
    moves without an autograd edge."""
    mover = MOVERS[plan.move]
    if edit.layout.kind not in mover.layouts:
        raise NotImplementedError(f"cp_passes: the {type(mover).__name__} key mover supports the layouts "
                                  f"{mover.layouts}, not {edit.layout.kind!r}")
    return mover.insert(edit, x, dim, plan, name, firsts=firsts, left_padding=left_padding,
                        global_order=global_order, metadata=metadata)


def move_cost(plan: KeyPlan, layout: Layout, rank: int, local_len: int, row: int, itemsize: int,
              what: str | None = None, metadata: bool = False) -> Cost:
    """What :func:`move_keys` receives and sends on rank ``rank`` per forward (``row`` bytes a position), against
    the lower bound: the keys the plan's reach shows (for a window brought by gather, its halo). ``what`` names
    the tensor in the collective's text (``K+V``); ``metadata`` moves without a backward."""
    return MOVERS[plan.move].cost(plan, layout, rank, local_len, row, itemsize, what, metadata)
