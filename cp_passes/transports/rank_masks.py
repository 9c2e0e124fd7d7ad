"""The model's mask at this rank's rows: one builder for every attention, SDPA and written by hand alike.

A mask the model builds from positions and metadata (:class:`~.masks.MetadataMask`) is evaluated where the rank
needs it: its inputs over the whole sequence (:func:`mask_leaves`: gathered metadata, global lengths, parameters),
its subgraph as a module picked at the global positions of some queries and some keys (:func:`mask_module`, the
picks moved to the inputs by :class:`~cp_passes.graph.selection.Selector`), so nothing ``[S, S]`` is computed.
:class:`RankMasks` makes each mask's leaves and module once per rewrite and evaluates them at the positions a
caller brings: the rank's query rows against the keys brought (the mask the attention reads; as a
:class:`~.mask_program.MaskProgram` where it splits into per-position terms), or against every key (the run-time
check, :meth:`RankMasks.count_outside`: the one counter of what masks show outside a band, a tile at a time where
they split), whose counts the ranks add before all fail together (:meth:`RankMasks.fail_together`).
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from ..graph.analysis import meta_val
from ..graph.selection import Selector, compare_without_differences
from ..key_plan import outside_band_counts, sized_by_data
from ..layout import CONTIGUOUS
from .gathers import in_global_order
from .mask_program import SHOWN, MaskProgram, hidden_counts, outside_keys_op, split_mask, steps_text  # noqa: F401
from .masks import MetadataMask, global_shaped
from .reductions import global_sum_op  # noqa: F401  (registers cp_passes::global_sum)

aten = torch.ops.aten


class RankMasks:
    """The model's masks of one attention rewrite, evaluated at the positions the rewrite needs. Each mask's
    leaves (:func:`mask_leaves`) and picked module (:func:`mask_module`) are made once and shared by every
    evaluation and check."""

    def __init__(self, edit):
        self.edit = edit
        self.name = f"cp_mask_fn_{edit.origin.name}"
        self._leaves, self._modules, self._splits = {}, {}, {}

    def leaves(self, found: MetadataMask) -> list[torch.fx.Node]:
        if id(found) not in self._leaves:
            self._leaves[id(found)] = mask_leaves(self.edit, found)
        return self._leaves[id(found)]

    def module(self, found: MetadataMask, keys: bool = True) -> torch.fx.GraphModule:
        """The mask picked at query and key positions (``keys`` False: at query positions, every key)."""
        if (id(found), keys) not in self._modules:
            self._modules[(id(found), keys)] = mask_module(self.edit, found, picked=True, keys=keys)
        return self._modules[(id(found), keys)]

    def split(self, found: MetadataMask) -> tuple | None:
        """:func:`~.mask_program.split_mask` of the picked mask: its per-position terms and program, or None."""
        if id(found) not in self._splits:
            self._splits[id(found)] = split_mask(self.module(found))
        return self._splits[id(found)]

    def at(self, found: MetadataMask, queries: torch.fx.Node, keys: torch.fx.Node, *, program: bool = False,
           every_key: bool = False) -> torch.fx.Node | MaskProgram:
        """``found`` at the queries and keys at global positions ``queries`` and ``keys`` (nodes), ``[.., queries,
        keys]``: with ``program``, as a :class:`~.mask_program.MaskProgram` where it splits into per-position terms,
        else a tensor (``every_key``: every key of the sequence, ``keys`` unread)."""
        inputs = self.leaves(found) + [queries, keys]
        split = self.split(found) if program and not every_key else None
        if split is None:
            return self.edit.call_module(self.name, self.module(found, keys=not every_key), inputs)
        terms, text = split
        return MaskProgram(mask_terms(self.edit, self.name, terms, inputs), text, keys)

    def count_outside(self, masks: list[MetadataMask], steps, queries: torch.fx.Node, keys: torch.fx.Node,
                      before: int | None, after: int, name: str) -> torch.fx.Node:
        """``[2]`` (:func:`~cp_passes.key_plan.outside_band_counts`): what ``masks``, combined as ``steps`` says
        (:data:`~.mask_program.SHOWN`: one boolean mask; else :func:`~.mask_program.hidden_together`'s replay),
        show at ``queries`` x ``keys`` outside ``-after <= q - k <= before``, and the queries they show no key of
        it; a tile at a time where every mask splits (:func:`~.mask_program.outside_keys_op`), else in the graph."""
        splits = [self.split(found) for found in masks]
        if all(split is not None for split in splits):
            terms = [mask_terms(self.edit, self.name, split[0], self.leaves(found) + [queries, keys])
                     for split, found in zip(splits, masks)]
            return self.edit.insert(torch.ops.cp_passes.outside_keys.default,
                                    ([t for part in terms for t in part], "\n".join(split[1] for split in splits),
                                     [len(part) for part in terms], steps if steps == SHOWN else steps_text(steps),
                                     queries, keys, before, after), name=name)
        shown = [self.at(found, queries, keys) for found in masks]
        if steps == SHOWN:
            return self.edit.insert(outside_band_counts, (shown[0], queries, keys, before, after), name=name)
        return self.edit.insert(hidden_counts, (shown, steps, ((-2, -1),) * len(shown), queries, keys, before, after),
                                name=name)

    def fail_together(self, count: torch.fx.Node, messages: tuple, name: str) -> None:
        """:func:`fail_together`."""
        fail_together(self.edit, count, messages, name)


def fail_together(edit, count: torch.fx.Node, messages: tuple, name: str) -> None:
    """Add the ranks' counts (``[2]``: :func:`~cp_passes.key_plan.outside_band_counts`) in one all-reduce and
    fail on every rank alike where count ``i`` is not zero, with ``messages[i]``."""
    total = edit.insert(torch.ops.cp_passes.global_sum.default, (count, edit.group_name), name=f"{name}_total")
    for i, message in enumerate(messages):
        broken = edit.insert(operator.getitem, (total, i), name=f"{name}_count")
        edit.insert(aten._assert_async.msg, (edit.insert(operator.eq, (broken, 0), name=f"{name}_none"), message),
                    name=f"{name}_check")


def mask_terms(edit, name: str, terms: torch.fx.GraphModule, inputs: list) -> tuple:
    """The per-position terms of a split mask (:func:`split_mask`), each a node."""
    called = edit.call_module(name + "_terms", terms, inputs)
    (outputs,) = next(n for n in terms.graph.nodes if n.op == "output").args
    return tuple(edit.insert(operator.getitem, (called, i), name=f"{name}_term") for i in range(len(outputs)))


def mask_leaves(edit, found: MetadataMask) -> list[torch.fx.Node]:
    """The mask's inputs over the whole sequence, in global order: gathered metadata (and activations, for a
    mask computed without gradient, detached), global lengths, and the parameters it reads."""

    def detached(leaf):
        """This rank's ``leaf`` as the rewritten graph computes it (a scan's, say, after its carry), without
        its autograd edge (the graph's fake values do not say which tensors require grad: any float may)."""
        now = edit.current(leaf)
        if not meta_val(leaf).is_floating_point():
            return now
        return edit.insert(aten.detach.default, (now,), name=f"cp_{leaf.name}_detached")

    def gathered(leaf, d):
        rows = edit.insert(torch.ops.cp_passes.metadata_gather.default,
                           (detached(leaf), d, edit.world, edit.group_name), name=f"cp_{leaf.name}_gathered")
        if edit.layout.kind == CONTIGUOUS:
            return rows
        return edit.insert(in_global_order, (rows, d, edit.world, edit.layout.kind),
                           name=f"cp_{leaf.name}_in_order")

    leaves = [edit.insert(global_shaped, (edit.current(leaf), d, edit.world), name=f"cp_{leaf.name}_shape")
              if found.shape_only(leaf) else gathered(leaf, d)
              for leaf, d in zip(found.tensor_leaves, found.leaf_dims)]
    # A length k * s of the local sequence is k * world * s globally (every rank holds s positions).
    leaves += [edit.insert(operator.mul, (leaf, edit.layout.world), name=f"cp_{leaf.name}_global")
               for leaf in found.size_leaves]
    return leaves + [edit.current(leaf) if found.learned else detached(leaf) for leaf in found.inputs]


def global_mask(edit, found: MetadataMask) -> torch.fx.Node:
    """The model's mask over the whole sequence: its subgraph as a submodule, fed gathered metadata (and
    activations, for a mask computed without gradient), global lengths and the parameters it reads."""
    leaves = mask_leaves(edit, found)
    if sized_by_data(found):
        # Sizes that depend on data (an indexer's top-k width) are bound node by node: inline the mask.
        env = dict(zip(found.tensor_leaves + found.size_leaves + found.inputs, leaves))
        for n in found.nodes:
            env[n] = edit.copy(n, env, name=f"cp_mask_{n.name}")
        return env[found.mask]
    return edit.call_module(f"cp_mask_fn_{edit.origin.name}", mask_module(edit, found, picked=False), leaves)


def mask_module(edit, found: MetadataMask, picked: bool, keys: bool = True) -> torch.fx.GraphModule:
    """The mask's subgraph as a module of its leaves (:func:`mask_leaves`' order); ``picked`` adds two inputs,
    the query and key positions, and returns only those rows and keys (:class:`~cp_passes.graph.selection.Selector`;
    not ``keys``: those rows and every key, the key positions unread)."""
    graph, env = torch.fx.Graph(), {}
    for leaf in found.tensor_leaves + found.size_leaves + found.inputs:
        env[leaf] = graph.placeholder(leaf.name)
        env[leaf].meta["val"] = meta_val(leaf)  # the Selector reads ranks and size-1 dims (the same globally)
    picks = (graph.placeholder("query_positions"), graph.placeholder("key_positions")) if picked else ()
    for n in found.nodes:
        env[n] = graph.node_copy(n, lambda a: env[a] if a in env else env[edit.planned(a)])
    replaced = compare_without_differences(graph)
    out = replaced.get(env[found.mask], env[found.mask])
    if picked:
        rank = meta_val(found.mask).dim()
        out = Selector(graph)(out, ((rank - 2, picks[0]), (rank - 1, picks[1])) if keys else ((rank - 2, picks[0]),))
    graph.output(out)
    graph.eliminate_dead_code()  # the whole-sequence nodes the picks went around
    return torch.fx.GraphModule(edit.gm, graph)
