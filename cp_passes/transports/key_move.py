"""The key mover: one function that brings an attention's keys as its :class:`~cp_passes.key_plan.KeyPlan` says.

Every attention's key side moves here, SDPA's K and V (:mod:`.attention`) and the key-axis operands of attention
written by hand (:mod:`.keys`) alike:

- ``Move.HALO``: the ``before`` rows before each of the rank's ranges and the ``after`` rows after
  (:func:`~.halo_exchange.halo_op`, one ``all_to_all``);
- ``Move.PREFIX``: every position before the end of the rank's last range, in global order, started, waited for
  and finished as three nodes so that compute runs while it travels (:func:`~.prefix_exchange.insert_exchange`);
  from each range's first key a mask shows (packed documents) in one op (:func:`~.prefix_exchange.prefix_gather_op`);
- ``Move.EVERY_KEY``: an all-gather (activations with a reduce-scatter backward, metadata without autograd), in
  rank order or in global order.

:func:`move_cost` is the one count of what each move receives and sends. A new move (a ring, say) is one more
branch in both, and one more :class:`~cp_passes.key_plan.Move`.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx

from ..key_plan import KeyPlan, Move
from ..layout import CONTIGUOUS, Layout
from .base import Cost
from .gathers import in_global_order, metadata_gather_op, sequence_gather_op  # noqa: F401  (registers the ops)
from .halo_exchange import halo_op  # noqa: F401  (registers cp_passes::halo)
from .prefix_exchange import insert_exchange, prefix_cost, prefix_gather_op, prefix_start  # noqa: F401

RUNTIME = (torch.ops.cp_passes.halo.default, torch.ops.cp_passes.prefix_gather.default,
           torch.ops.cp_passes.sequence_gather.default, torch.ops.cp_passes.metadata_gather.default, prefix_start)
"""The ops (and the traced start) that issue the key mover's collectives: the ranks' agreement fingerprints them."""


def move_keys(edit, x: torch.fx.Node, dim: int, plan: KeyPlan, name: str, *, firsts: torch.fx.Node | None = None,
              left_padding: int = 0, global_order: bool = False, metadata: bool = False) -> torch.fx.Node:
    """A node (before ``edit``'s origin) holding the keys of ``x`` along ``dim`` that ``plan`` brings.

    ``firsts``: each range's first key a mask shows (packed documents; the causal prefix only). ``left_padding``:
    zero rows in front of each range's halo (hidden by the mask). ``global_order``: every key in the order of
    global positions (what a mask over the whole sequence reads) rather than rank order. ``metadata``: every key
    moves without an autograd edge."""
    if plan.move == Move.HALO:
        return edit.insert(torch.ops.cp_passes.halo.default,
                           (x, dim, plan.halo, left_padding, edit.rank, edit.world, edit.group_name, edit.layout.kind)
                           + ((plan.after,) if plan.after else ()), name=name)
    if plan.move == Move.PREFIX and firsts is None:
        return insert_exchange(edit, x, dim, name)
    if plan.move == Move.PREFIX:
        return edit.insert(torch.ops.cp_passes.prefix_gather.default,
                           (x, dim, edit.rank, edit.world, edit.group_name, edit.layout.kind, firsts), name=name)
    op = torch.ops.cp_passes.metadata_gather if metadata else torch.ops.cp_passes.sequence_gather
    brought = edit.insert(op.default, (x, dim, edit.world, edit.group_name), name=name)
    if global_order and edit.layout.kind != CONTIGUOUS:
        brought = edit.insert(in_global_order, (brought, dim, edit.world, edit.layout.kind), name=name + "_in_order")
    return brought


def move_cost(plan: KeyPlan, layout: Layout, rank: int, local_len: int, row: int, itemsize: int,
              what: str | None = None, metadata: bool = False) -> Cost:
    """What :func:`move_keys` receives and sends on rank ``rank`` per forward (``row`` bytes a position), against
    the lower bound: the keys the plan's reach shows (for a window brought by gather, its halo). ``what`` names
    the tensor in the collective's text (``K+V``); ``metadata`` moves without a backward."""
    if plan.move == Move.HALO:
        send, recv, _ = layout.halo_counts(plan.halo, rank, local_len, plan.after)
        rows = f"{plan.halo} rows" + (f" before and {plan.after} after" if plan.after else "")
        moved = sum(recv) * row
        return Cost(f"all_to_all {rows}" + (f" of {what}" if what else "") + ("" if metadata else " | bw all_to_all"),
                    moved // itemsize, moved, moved, sum(send) * row)
    if plan.move == Move.PREFIX:
        scope = ("from each range's first key its mask shows, at most the causal prefix" if plan.first_keys
                 else "causal prefix")
        cost = prefix_cost(layout, rank, local_len, row, itemsize, what or "rows",
                           "" if metadata else " | bw all_to_all", scope=scope)
        if plan.reach.before is not None:  # a window by gather, as the spec asks: its halo is the bound
            window = sum(layout.halo_counts(plan.reach.before, rank, local_len)[1]) * row
            cost = dataclasses.replace(cost, lower_bound_bytes=window)
        return cost
    moved = (layout.world - 1) * local_len * row
    return Cost("all_gather" + (f" {what}" if what else "") + (" (no grad)" if metadata else " | bw reduce_scatter"),
                moved // itemsize, moved, moved, moved)
