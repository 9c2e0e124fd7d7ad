"""Key axis: bring what a hand-written attention reads along its key axis from other ranks.

The planner asks for :class:`KeyOperand` where a sequence-sharded tensor lands on the key axis of a
``[q, k]`` block (K in ``q @ k^T``, V in ``probs @ v``, a key-side bias), and for :class:`KeyMask` where a
block is combined with a mask the model builds from sequence metadata. An operand is moved where it is
smallest (before a GQA head repeat and any transposes), then the ops between are replayed on what arrived;
a mask is evaluated at this rank's query rows and the keys brought only, its inputs picked there
(:func:`~cp_passes.transports.attention.mask_module`), from gathered metadata.

Where the model's masks hide keys from a softmax (:mod:`cp_passes.match.key_cuts`), a :class:`BroughtKeys`
says which keys come: the ``window - 1`` rows before this rank's (a halo; for a two-sided window the rows after
too) or the causal prefix (every position before the end of the rank's last range, only those moved).
Every operand and mask of that attention is cut to those keys, and the masks that hide the rest are checked
at run time: each rank its own queries against every key, a tile at a time where the masks split into
per-position terms (:func:`~.mask_program.outside_keys_op`); the ranks add their counts (one all-reduce), so all reach
the same verdict and no rank goes on while another fails. Keys concatenated from positions and windows of them
are cut in their first part (the positions); the windows come whole, and those masks are evaluated at the
rank's rows and every key, then cut (:func:`cut_mask`). Masks whose query and key axes are not their last two
dims, or whose sizes depend on data, are evaluated over the whole sequence and cut.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from ..errors import node_ref
from ..graph.analysis import INPUT_NAME, meta_val
from ..key_plan import EVERY_KEY_PLAN, KeyPlan, outside, sized_by_data
from ..layout import KINDS, Layout
from .rank_masks import RankMasks, global_mask
from .base import Cost, Transport, register_transport
from .halo import row_bytes
from .key_move import move_cost, move_keys, runtime as key_movers_runtime
from .mask_program import hidden_counts
from .masks import MetadataMask, key_positions, own_segment

aten = torch.ops.aten


@dataclass(frozen=True)
class BroughtKeys:
    """The keys a cut attention brings, as its :class:`~cp_passes.key_plan.KeyPlan` says: a halo (``plan.halo``
    rows before each of this rank's ranges, ``plan.after`` after) or the causal prefix of a gather. ``masking``
    hides every other key (:class:`~cp_passes.match.key_cuts.Masking`), which the run-time check confirms."""

    plan: KeyPlan
    masking: tuple
    first_part: bool = False
    """The key axis concatenates positions and windows of them: the cut applies to the first part, the
    positions (as many keys as the sequence has queries); the other parts come whole."""

    def describe(self) -> str:
        return self.plan.describe() + (" in its positions and every window entry" if self.first_part else "")


@dataclass
class KeyOperand:
    """``operand`` lands on the key axis of ``consumers``: gather ``source`` along ``dim`` and replay
    ``steps`` (nodes to copy, or an int: a head repeat of that many) to rebuild it whole."""

    operand: torch.fx.Node
    source: torch.fx.Node
    dim: int
    steps: list
    consumers: list[torch.fx.Node] = field(default_factory=list)
    brought: BroughtKeys | None = None
    """The keys to bring; None: every key."""
    reads_later: bool = False
    """A query may read a later key (no mask shows causal attention): end padding is visible to it."""
    concat: bool = False
    """``source`` concatenates positions and windows of them along ``dim``: each part is brought whole."""

    @property
    def metadata(self) -> bool:
        return not meta_val(self.source).is_floating_point()

    def describe(self) -> str:
        where = node_ref(self.source) + (f" (read at {node_ref(self.operand, code=False)})"
                                         if self.source is not self.operand else "")
        repeats = [s for s in self.steps if isinstance(s, int)]
        return where + (f", before its x{repeats[0]} head repeat" if repeats else "")


@dataclass
class KeyMask:
    """A mask the model builds from metadata, combined with a block whose query axis is ``query_dim``."""

    mask: MetadataMask
    query_dim: int
    key_dim: int
    brought: BroughtKeys | None = None
    """The keys to cut the mask to; None: every key."""
    checks: tuple = ()
    """``(mask, (hides, fill, dtype), (query dim, key dim))`` of every mask that hides keys outside ``keys``, the
    one applied last first: checked here, together (:func:`hidden_together`)."""
    consumers: list[torch.fx.Node] = field(default_factory=list)
    """The block ops that read the mask with these keys."""

    @property
    def at_rows(self) -> bool:
        """Whether the masks are evaluated at this rank's query rows only (:meth:`KeyGather._rows`): each mask's
        query and key axes are its last two dims, its sizes do not depend on data and an input of it says the local
        length."""
        masks = [(self.mask, (self.query_dim, self.key_dim))] + [(found, dims) for found, _, dims in self.checks]
        return length_source(self.mask, self.query_dim) is not None and all(
            _last_two(found, dims) and not sized_by_data(found) for found, dims in masks)

    def describe(self) -> str:
        names = ", ".join(leaf.meta.get(INPUT_NAME, leaf.name) for leaf in self.mask.tensor_leaves) or "positions"
        where = "at this rank's rows and the keys brought" if self.at_rows else "over the whole sequence"
        cut = (f", cut to {self.brought.describe()}" + (" and checked to hide every other key" if self.checks else "")
               if self.brought else "")
        return f"the model's mask from {names}, evaluated {where}{cut}"


def _last_two(found: MetadataMask, dims: tuple[int, int]) -> bool:
    rank = meta_val(found.mask).dim()
    return (dims[0] % rank, dims[1] % rank) == (rank - 2, rank - 1)


def length_source(found: MetadataMask, query_dim: int) -> tuple[torch.fx.Node, int | None] | None:
    """An input of the mask that holds the rank's local length: a size (``(node, None)``) or a tensor and its
    dim that the mask's query axis is as long as; None if none is."""
    want = str(meta_val(found.mask).shape[query_dim])
    for leaf in found.size_leaves:
        if str(meta_val(leaf)) == want:
            return leaf, None
    for leaf, dim in zip(found.tensor_leaves, found.leaf_dims):
        if str(meta_val(leaf).shape[dim]) == want:
            return leaf, dim
    return None


@dataclass
class KeySize:
    """A reshape of a block (Bloom's ``scores.view(batch, heads, q, k)``) that sizes the key axis with the local
    length: sized -1 there instead, the keys brought."""

    node: torch.fx.Node
    key_dim: int


def query_rows(global_mask: torch.Tensor, query_dim: int, rank: int, world: int, kind: str) -> torch.Tensor:
    """This rank's query rows of a mask evaluated over the whole sequence (every key kept)."""
    local = global_mask.shape[query_dim] // world
    return global_mask.index_select(query_dim, Layout(world, kind).positions(rank, local, global_mask.device))


EVERY_KEY_HIDDEN = ("cp_passes: the model's attention mask hides every key from some query, whose softmax then "
                    "spreads over every key on one device and over fewer under CP; let each query see a key "
                    "(itself), or set CPSpec(attention_keys='all')")
"""A row that hides every key is uniform over all keys on one device (``finfo.min``) but not over fewer."""


def check_hidden(masks: list[torch.Tensor], steps: tuple, dims: tuple, before: int | None,
                 first_part: bool = False, after: int = 0) -> None:
    """Fail unless the masks together (:func:`hidden_together`), evaluated over the whole sequence, hide every key
    a cut attention leaves out: a later key (more than ``after`` positions on), or (with ``before``) one
    ``before + 1`` or more positions back (with ``first_part``, among the first keys, one per query); and unless
    each query sees a key. Every rank checks the whole sequence, so all reach the same verdict."""
    if first_part:
        masks = [mask.narrow(k, 0, mask.shape[q]) for mask, (q, k) in zip(masks, dims)]
    (q, k), device = dims[0], masks[0].device
    counts = hidden_counts(masks, steps, dims, torch.arange(masks[0].shape[q], device=device),
                           torch.arange(masks[0].shape[k], device=device), before, after)
    torch._assert_async(counts[0] == 0, outside(before, after))
    torch._assert_async(counts[1] == 0, EVERY_KEY_HIDDEN)


def first_part_counts(masks: list[torch.Tensor], steps: tuple, query_positions: torch.Tensor, world: int,
                      before: int | None, after: int) -> torch.Tensor:
    """:func:`hidden_counts` of masks at this rank's queries and every key of a key axis that concatenates the
    positions and windows of them, over the positions part (the first ``world`` times the local length)."""
    length = world * query_positions.shape[0]
    masks = [mask.narrow(-1, 0, length) for mask in masks]
    return hidden_counts(masks, steps, ((-2, -1),) * len(masks), query_positions,
                         torch.arange(length, device=query_positions.device), before, after)


def rank_positions(local, rank: int, world: int, kind: str, device) -> torch.Tensor:
    """The global positions of the rank's ``local`` rows."""
    return Layout(world, kind).positions(rank, local, device)


def every_position(local, world: int, device) -> torch.Tensor:
    """Every global position of the sequence (``world`` times ``local``)."""
    return torch.arange(world * local, device=device)


def first_query(device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int64, device=device)


def last_key(local, world: int, device) -> torch.Tensor:
    return torch.full((1,), world * local - 1, dtype=torch.int64, device=device)


def _hiding(cut: torch.Tensor, fill: str | None, corner: torch.Tensor | None) -> torch.Tensor:
    """The value a cut mask takes at a key it must hide: as ``fill`` (how the mask hides keys) says, or, for a mask
    that hides none, ``corner`` (its value at query 0 and the last key)."""
    if fill == "additive":
        return torch.tensor(torch.finfo(cut.dtype).min, dtype=cut.dtype, device=cut.device)
    if fill is not None:
        return torch.tensor(fill == "true", device=cut.device)
    return corner


def hide_outside(cut: torch.Tensor, brought: torch.Tensor, local, rank: int, world: int, kind: str, before: int,
                 after: int, fill: str | None, corner: torch.Tensor | None) -> torch.Tensor:
    """``cut`` (``[.., local, keys]``: a mask at this rank's rows and a halo's keys, at ``brought``) with the keys
    before the sequence start (the halo's zero rows) and those of another of the rank's ranges (a row two ranges
    share counts once, :func:`~.masks.own_segment`) hidden (:func:`_hiding`)."""
    hide = (brought < 0)[None, :]
    own = own_segment(local, world, kind, before, cut.device, after=after)
    if own is not None:
        hide = hide | ~own
    return torch.where(hide, _hiding(cut, fill, corner), cut)


def cut_mask(global_mask: torch.Tensor, query_dim: int, key_dim: int, rank: int, world: int, kind: str,
             before: int | None, checked: list[torch.Tensor], steps: tuple, dims: tuple, fill: str | None,
             first_part: bool, after: int = 0, corner: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's query rows of a mask evaluated over the whole sequence, at the keys a :class:`BroughtKeys`
    brings (with ``first_part``, those of the first keys, one per query, then every other key). A key
    before the sequence start (a halo's zeros), or in another of the rank's ranges' halos (a row two ranges
    share counts once), takes the hiding value (``fill``: how this mask hides keys) or, for a mask that
    hides none, the value of query 0 and the last key. Given ``corner`` (the mask at query 0 and every key),
    ``global_mask`` holds this rank's query rows only, at every key."""
    if checked:
        check_hidden(checked, steps, dims, before, first_part, after)
    query_dim, key_dim = query_dim % global_mask.dim(), key_dim % global_mask.dim()
    rows = global_mask if corner is not None else query_rows(global_mask, query_dim, rank, world, kind)
    local = rows.shape[query_dim]
    positions = key_positions(local, rank, world, kind, before, global_mask.device, after=after)
    in_front = positions < 0
    own = own_segment(local, world, kind, before, global_mask.device, after=after) if before is not None else None
    if first_part:
        length, total = world * local, global_mask.shape[key_dim]
        positions = torch.cat([positions, torch.arange(length, total, device=positions.device)])
        in_front = torch.cat([in_front, torch.zeros(total - length, dtype=torch.bool, device=in_front.device)])
        if own is not None:
            own = torch.cat([own, own.new_ones(local, total - length)], 1)
    cut = rows.index_select(key_dim, positions.clamp(min=0))
    if before is None:
        return cut
    shape = [1] * cut.dim()
    shape[key_dim] = -1
    hide = in_front.reshape(shape)
    if own is not None:
        pair = [1] * cut.dim()
        pair[query_dim], pair[key_dim] = own.shape
        hide = hide | ~(own if query_dim < key_dim else own.t()).reshape(pair)
    corner = (global_mask if corner is None else corner).narrow(query_dim, 0, 1)
    corner = corner.narrow(key_dim, corner.shape[key_dim] - 1, 1)
    return torch.where(hide, _hiding(cut, fill, corner), cut)


class KeyGather(Transport):
    name = "key_gather"
    order = 35
    layouts = KINDS
    gathers_keys = True

    @property
    def runtime(self) -> tuple:
        return key_movers_runtime()

    def apply(self, edit, request) -> None:
        if isinstance(request, KeyMask):
            return self._mask(edit, request)
        if isinstance(request, KeySize):
            sizes = list(request.node.args[1])
            sizes[request.key_dim] = -1
            request.node.update_arg(1, sizes)
            edit.changed(request.node)
            return None
        name = f"cp_{request.source.name}_keys"
        if request.concat:  # positions and windows of them: each part along its own axis, then joined
            parts = [self._bring(edit, request, part, request.brought if i == 0 else None, f"{name}_part")
                     for i, part in enumerate(request.source.args[0])]
            brought = edit.insert(aten.cat.default, (parts, request.dim), name=name)
        else:
            brought = self._bring(edit, request, request.source, request.brought, name)
        for step in request.steps:
            if isinstance(step, int):
                brought = edit.insert(aten.repeat_interleave.self_int, (brought, step, 1),
                                      name=f"cp_{request.operand.name}_heads")
            else:
                brought = edit.copy(step, {step.args[0]: brought}, name=f"cp_{step.name}_keys")
        operand = edit.current(request.operand)
        for consumer in request.consumers:
            consumer.replace_input_with(operand, brought)
            edit.changed(consumer)

    @staticmethod
    def _bring(edit, request: KeyOperand, source: torch.fx.Node, keys: BroughtKeys | None, name: str):
        """The rows of ``source`` (the current node: a scan or positions may have made it global) that ``keys``
        asks for along ``request.dim`` (:func:`~.key_move.move_keys`; every key in global order, as the masks read
        them, metadata without autograd)."""
        return move_keys(edit, edit.current(source), request.dim, EVERY_KEY_PLAN if keys is None else keys.plan, name,
                         global_order=True, metadata=request.metadata)

    def _mask(self, edit, request: KeyMask) -> None:
        rows = self._rows(edit, request) if request.at_rows else self._whole(edit, request)
        for consumer in request.consumers:
            consumer.replace_input_with(request.mask.mask, rows)
            edit.changed(consumer)

    def _rows(self, edit, request: KeyMask) -> torch.fx.Node:
        """The mask at this rank's query rows and the keys brought, its inputs picked there: ``[.., L, keys]``,
        nothing ``[S, S]``; with :meth:`_check` where it hides keys the cut leaves out."""
        found, keys, rank, world, kind = request.mask, request.brought, edit.rank, edit.world, edit.layout.kind
        before, after = (keys.plan.halo, keys.plan.after) if keys is not None else (None, 0)
        device = meta_val(found.mask).device
        source, dim = length_source(found, request.query_dim)
        length = source if dim is None else edit.insert(aten.sym_size.int, (source, dim), name="cp_mask_length")
        queries = edit.insert(rank_positions, (length, rank, world, kind, device), name="cp_query_positions")
        masks = RankMasks(edit)
        if keys is not None and keys.first_part:
            return self._first_part(edit, request, masks, queries, length, device)
        brought = (edit.insert(every_position, (length, world, device), name="cp_key_positions") if keys is None else
                   edit.insert(key_positions, (length, rank, world, kind, before, device), {"after": after},
                               name="cp_key_positions"))
        evaluated = edit.insert(torch.clamp_min, (brought, 0), name="cp_key_positions_in_sequence")
        rows = masks.at(found, queries, evaluated)
        if before is not None:
            fill = next((m.hides for m in keys.masking if m.mask is found.mask), None)
            corner = None
            if fill is None:  # a mask that hides none: its value at query 0 and the last key
                first = edit.insert(first_query, (device,), name="cp_first_query")
                corner = masks.at(found, first, edit.insert(last_key, (length, world, device), name="cp_last_key"))
            rows = edit.insert(hide_outside, (rows, brought, length, rank, world, kind, before, after, fill, corner),
                               name="cp_mask_keys")
        if request.checks:
            self._check(edit, request, masks, queries, length, device)
        return rows

    @staticmethod
    def _check(edit, request: KeyMask, masks: RankMasks, queries, length, device) -> None:
        """Each rank counts, for its own queries against every key, what the masks show outside the keys brought
        and the queries they hide every key from (:meth:`~.rank_masks.RankMasks.count_outside`); the ranks add the
        counts and all fail alike."""
        plan = request.brought.plan
        every = edit.insert(every_position, (length, edit.world, device), name="cp_sequence_positions")
        count = masks.count_outside([found for found, _, _ in request.checks],
                                    tuple(step for _, step, _ in request.checks), queries, every, plan.halo,
                                    plan.after, "cp_mask_hidden")
        masks.fail_together(count, (outside(plan.halo, plan.after), EVERY_KEY_HIDDEN), "cp_mask_hidden")

    @staticmethod
    def _first_part(edit, request: KeyMask, masks: RankMasks, queries, length, device) -> torch.fx.Node:
        """Keys that concatenate positions and windows of them: the masks at this rank's query rows and every key
        (``[.., L, keys]``), then cut as :func:`cut_mask` cuts (the positions part to the keys brought, the
        windows whole); the check counts over the positions part, each rank its own queries."""
        found, plan = request.mask, request.brought.plan
        first = edit.insert(first_query, (device,), name="cp_first_query")
        rows = {id(mask): masks.at(mask, queries, queries, every_key=True)
                for mask in [found] + [checked for checked, _, _ in request.checks]}
        fill = next((m.hides for m in request.brought.masking if m.mask is found.mask), None)
        corner = masks.at(found, first, first, every_key=True)
        cut = edit.insert(cut_mask, (rows[id(found)], -2, -1, edit.rank, edit.world, edit.layout.kind, plan.halo, [],
                                     (), (), fill, True, plan.after, corner), name="cp_mask_keys")
        if request.checks:
            count = edit.insert(first_part_counts, ([rows[id(c)] for c, _, _ in request.checks],
                                                    tuple(step for _, step, _ in request.checks), queries,
                                                    edit.world, plan.halo, plan.after), name="cp_mask_hidden")
            masks.fail_together(count, (outside(plan.halo, plan.after), EVERY_KEY_HIDDEN), "cp_mask_hidden")
        return cut

    def _whole(self, edit, request: KeyMask) -> torch.fx.Node:
        """The mask over the whole sequence, then this rank's rows and the keys brought (:func:`cut_mask`)."""
        whole = global_mask(edit, request.mask)
        if request.brought is None:
            return edit.insert(query_rows, (whole, request.query_dim, edit.rank, edit.world, edit.layout.kind),
                               name="cp_mask_rows")
        checked = [whole if found is request.mask else global_mask(edit, found) for found, *_ in request.checks]
        fill = next((m.hides for m in request.brought.masking if m.mask is request.mask.mask), None)
        return edit.insert(cut_mask, (whole, request.query_dim, request.key_dim, edit.rank, edit.world,
                                      edit.layout.kind, request.brought.plan.halo, checked,
                                      tuple(c[1] for c in request.checks), tuple(c[2] for c in request.checks),
                                      fill, request.brought.first_part, request.brought.plan.after),
                           name="cp_mask_keys")

    def cost(self, request, layout, rank, local_len) -> Cost:
        if isinstance(request, KeySize):
            return Cost()
        if isinstance(request, KeyMask):
            leaves, moved = request.mask.gathered, request.mask.gathered_bytes(layout.world)
            return Cost(f"all_gather {', '.join(leaf.name for leaf in leaves)} (no grad)" if leaves else "none",
                        0, moved, moved, moved, moved)
        if request.concat:
            return sum((self._rows_cost(request, part, request.brought if i == 0 else None, layout, rank, local_len)
                        for i, part in enumerate(request.source.args[0])), Cost())
        return self._rows_cost(request, request.source, request.brought, layout, rank, local_len)

    @staticmethod
    def _rows_cost(request: KeyOperand, source: torch.fx.Node, keys: BroughtKeys | None, layout, rank: int,
                   local_len: int) -> Cost:
        """What bringing ``keys`` of ``source`` (a part of a concatenation, or the whole operand) moves."""
        return move_cost(EVERY_KEY_PLAN if keys is None else keys.plan, layout, rank, local_len,
                         row_bytes(source, local_len), meta_val(source).dtype.itemsize, metadata=request.metadata)


KEY_GATHER = register_transport(KeyGather())
