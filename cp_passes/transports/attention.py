"""SDPA's key side: move K/V as the plan says, mask at the rank's global positions, rewire the attention call.

A rule asks for :class:`AttentionKV` with its :class:`~cp_passes.key_plan.KeyPlan`: transport ``halo`` for a
band (the ``before`` rows before each range, and for a two-sided window the ``after`` rows after), else
``sequence_gather`` (the causal prefix, or every key). Either transport calls :func:`rewrite_attention`, which
moves K and V with the one key mover (:func:`~.key_move.move_keys`) and rewires the attention call; the model's
mask at the rank's rows comes from :func:`~.masks_at_rows.mask_at_rows`. Gathered keys without
a window are attended block by block (:mod:`.block_attention`): the pieces a query sees whole, its own
causally, no ``[queries, keys]`` mask built or saved unless the model's own mask reads data.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from ..errors import module_path
from ..graph.analysis import meta_val, numel_hint
from ..graph.checkpoint import NOT_RECOMPUTED
from ..graph.narrowest import Narrowest, Recompute, row_bytes
from ..key_plan import (EVERY_KEY_REACH, KeyPlan, Move, attention_pieces, by_blocks, no_dropout, outside,
                        own_keys_first, sized_by_data)
from .base import Cost
from .block_attention import block_attention_op, block_attention_rest_op
from .key_move import move_cost, move_keys
from .recompute import computed_positions, recompute_at_rows
from .mask_program import SHOWN, MaskProgram
from .rank_masks import RankMasks, global_mask
from .masks import (MetadataMask, brought_positions, first_keys, kept_keys, mask_block, query_positions,
                    reach_mask, sequence_positions)
from .prefix_exchange import prefix_finish
from .reductions import global_sum_op  # noqa: F401  (registers cp_passes::global_sum)
from .window_attention import window_attention_op  # noqa: F401  (registers cp_passes::window_attention)

aten = torch.ops.aten


@dataclass
class AttentionKV:
    """One ``scaled_dot_product_attention`` whose keys and values must come from other ranks."""

    node: torch.fx.Node
    query: torch.fx.Node
    key: torch.fx.Node
    """The keys to move: before the model's head repeat when ``enable_gqa`` takes its place."""
    value: torch.fx.Node
    dim: int
    """The sequence dim of ``key`` and ``value``."""
    plan: KeyPlan
    together: bool
    """Move K and V as one tensor (one collective)."""
    enable_gqa: bool
    dropout_p: object
    scale: object
    mask: MetadataMask | None = None
    notes: list[str] = field(default_factory=list)
    left_padding: int = 0
    """Zero rows in front of a halo (hidden by the mask)."""
    narrowest: Narrowest | None = None
    """The narrowest tensors K and V derive from position by position (the planner's
    :func:`~cp_passes.graph.narrowest.narrowest_rows`): the lower bound moves those."""
    recompute: Recompute | None = None
    """Set where those tensors move in place of K and V (``CPSpec.moved_keys``, :func:`recompute_pays`): every rank
    computes K and V again on the rows it receives (:func:`~.recompute.recompute_at_rows`)."""

    @property
    def kv_label(self) -> str:
        return "K+V" if self.together else "K, V"

    @property
    def elements(self) -> int:
        return numel_hint(self.key) + numel_hint(self.value)

    @property
    def itemsize(self) -> int:
        return meta_val(self.key).dtype.itemsize

    def row_bytes(self, local_len: int) -> int:
        return self.elements // local_len * self.itemsize

    def metadata_cost(self, world: int) -> Cost:
        """The metadata a model-built mask reads, gathered from every other rank (no autograd)."""
        if self.mask is None or not self.mask.gathered:
            return Cost()
        moved = self.mask.gathered_bytes(world)
        names = ", ".join(leaf.name for leaf in self.mask.gathered)
        return Cost(f"all_gather {names} (no grad)", 0, moved, moved, moved, moved)


def attention_cost(request: AttentionKV, layout, rank: int, local_len: int) -> Cost:
    """What moving the attention's K and V (:func:`~.key_move.move_cost`) and its mask's metadata receives. The
    lower bound moves the narrowest tensors K and V derive from position by position, where they are narrower
    (an MLA latent) than K and V."""
    row = request.row_bytes(local_len)
    if request.recompute is not None:
        return _recompute_cost(request, layout, rank, local_len) + request.metadata_cost(layout.world)
    keys = move_cost(request.plan, layout, rank, local_len, row, request.itemsize, request.kv_label)
    if request.narrowest is not None and request.narrowest.row_bytes < row:
        keys = dataclasses.replace(keys, lower_bound_bytes=keys.lower_bound_bytes * request.narrowest.row_bytes // row)
    return keys + request.metadata_cost(layout.world)


def _recompute_cost(request: AttentionKV, layout, rank: int, local_len: int) -> Cost:
    """The narrowest tensors' rows and the free values the copies read that the layout does not give (a table's
    rows, packed documents' positions), each moved as the plan moves keys, with autograd; the lower bound is the
    narrowest tensors' alone (integer positions count as metadata)."""
    path = request.recompute
    cost = Cost()
    for node, _ in path.moved:
        label = (module_path(node) or node.name).rsplit(".", 1)[-1]
        cost = cost + move_cost(request.plan, layout, rank, local_len, row_bytes(node, local_len),
                                meta_val(node).dtype.itemsize, label)
    for node in moved_free(request, path):
        value = meta_val(node)
        moved = move_cost(request.plan, layout, rank, local_len, row_bytes(node, local_len), value.dtype.itemsize,
                          f"{node.name} (from positions)")
        integer = not value.dtype.is_floating_point
        cost = cost + dataclasses.replace(moved, lower_bound_bytes=0, metadata_bytes=moved.bytes if integer else 0)
    return cost


def moved_free(request: AttentionKV, path: Recompute) -> list[torch.fx.Node]:
    """The free values ``path`` reads that move (rather than being computed from the layout)."""
    return [node for node, _ in path.free if not computed_positions(node, request.plan)]


FLOPS_PER_BYTE = 2000
"""What a byte moved between ranks costs in FLOPs not computed: an H100 SXM computes ~990 TFLOP/s (bf16, dense)
and its NVLink moves ~450 GB/s each way. Across nodes a byte costs ~10x more, so the choice it makes holds there."""


def recompute_pays(request: AttentionKV, path: Recompute, local_len: int, regather: bool) -> tuple[bool, int, int]:
    """Whether a training step's FLOPs computing K and V again on a row received cost less than moving the bytes a
    row the narrowest tensors save (less the free values that move with them: a table's rows), at
    :data:`FLOPS_PER_BYTE`; both figures. The step computes the copies forward, their backward (twice the
    forward) and, where the backward gathers again (``regather``), the forward once more; it moves the rows forward,
    their gradients back and, regathering, the rows again. FLOPs and bytes both scale with the rows received, so
    the answer is the same on every rank and at every length."""
    moved = request.narrowest.row_bytes + sum(row_bytes(node, local_len) for node in moved_free(request, path))
    flops = path.row_flops * (3 + regather)
    saved = (request.row_bytes(local_len) - moved) * (2 + regather)
    return saved > 0 and flops <= FLOPS_PER_BYTE * saved, flops, saved


def rewrite_attention(edit, request: AttentionKV) -> None:
    """Replace the attention's K/V with those its plan brings (:func:`~.key_move.move_keys`) and its mask with one
    at this rank's global positions (the model's own mask, evaluated over the whole sequence, when it reads
    metadata)."""
    q, plan = edit.current(request.query), request.plan
    halo = plan.move == Move.HALO
    blocks = by_blocks(plan.reach, plan.move, request.dropout_p)
    mask = local_mask(edit, request.mask, q, plan.reach.causal) if blocks and request.mask is not None else None
    firsts = _first_keys(edit, mask, q) if plan.first_keys else None
    suffix = "_halo" if halo else "_gathered"

    def move(x: torch.fx.Node, name: str) -> torch.fx.Node:
        return move_keys(edit, x, request.dim, plan, name + suffix, firsts=firsts, left_padding=request.left_padding)

    k, v = edit.current(request.key), edit.current(request.value)  # made global by an earlier transport?
    if request.recompute is not None:
        def move_rows(x, dim, name):
            return move_keys(edit, x, dim, plan, name + suffix, firsts=firsts)

        copies = recompute_at_rows(edit, request.recompute, plan, move_rows)
        keys, values = copies[request.key], copies[request.value]
    elif request.together:
        # Sizes from the planned nodes: k and v may be nodes a transport made (no fake value yet).
        sizes = [meta_val(request.key).shape[-1], meta_val(request.value).shape[-1]]
        moved = move(edit.insert(aten.cat.default, ([k, v], -1), name="cp_kv"), "cp_kv")
        parts = edit.insert(aten.split_with_sizes.default, (moved, sizes, -1), name="cp_kv_split")
        keys = edit.insert(operator.getitem, (parts, 0), name="cp_k")
        values = edit.insert(operator.getitem, (parts, 1), name="cp_v")
    else:
        keys, values = move(k, "cp_k"), move(v, "cp_v")
    if blocks:
        own = (k, v) if mask is None and plan.reach.causal and _exchanged(keys) else None
        _attend_blocks(edit, request, q, keys, values, mask, own)
    elif halo and request.mask is None and no_dropout(request.dropout_p):
        _attend_window(edit, request, q, keys, values)
    else:
        _attend_with_mask(edit, request, q, keys, values)


def _first_keys(edit, mask, q: torch.fx.Node) -> torch.fx.Node:
    """Each range's first key the mask shows (packed documents): only the keys from there move."""
    if isinstance(mask, MaskProgram):
        return edit.insert(torch.ops.cp_passes.program_first_keys.default,
                           (list(mask.leaves), mask.program, q, mask.key_positions, edit.layout.chunks),
                           name="cp_first_keys")
    return edit.insert(first_keys, (mask, q, edit.world, edit.layout.kind), name="cp_first_keys")


def _attend_with_mask(edit, request: AttentionKV, q, keys, values) -> None:
    """SDPA as it is, over the keys brought, with a mask at this rank's rows and those keys: the model's own
    (:func:`mask_at_keys`, or over the whole sequence and cut), the plan's band after a halo, or the causal mask
    where a rank's visible keys are not only its own."""
    node, plan, rank = request.node, request.plan, edit.rank
    layout_args = (rank, edit.world, edit.layout.kind, plan.move.value, plan.reach.before, plan.reach.after)
    mask = None
    if request.mask is not None:
        mask = mask_at_keys(edit, request, q)
        if mask is None:  # a mask the split cannot write down: over the whole sequence, then cut
            whole = global_mask(edit, request.mask)
            mask = edit.insert(mask_block, (whole, q, *layout_args, request.left_padding), name="cp_mask_block")
    elif plan.move == Move.HALO:
        mask = edit.insert(reach_mask, (q, *layout_args, request.left_padding), name="cp_window_mask")
    elif plan.reach.causal and (plan.reach.before is not None or not edit.layout.first_is_local(rank)):
        # the causal prefix came; where the visible keys are only this rank's own, causal attention needs no mask
        mask = edit.insert(reach_mask, (q, *layout_args), name="cp_causal_mask")
    node.args = (q, keys, values, mask, request.dropout_p)
    node.kwargs = {"is_causal": mask is None and plan.reach.causal, "scale": request.scale,
                   "enable_gqa": request.enable_gqa}
    edit.changed(node)


def _exchanged(keys: torch.fx.Node) -> bool:
    """Whether ``keys`` came by the causal gather started and waited for apart (:mod:`.prefix_exchange`)."""
    while keys.target is operator.getitem or keys.target is aten.split_with_sizes.default:
        keys = keys.args[0]
    return keys.target is prefix_finish


def _attend_blocks(edit, request: AttentionKV, q, keys, values, mask, own=None) -> None:
    """Causal (or full) attention over gathered keys as :func:`block_attention_op`: the SDPA call's uses read
    its output. Causal, the keys are those a causal query can see (the transport brought only them); a
    model-built mask (:func:`local_mask`) is cut to them too. With ``own`` (this rank's keys and values, which
    the gather started to send) the rank's queries attend to them first, in a call that does not wait for the
    gather, and the other ranks' keys are merged in after (:func:`~cp_passes.key_plan.own_keys_first`)."""
    node, rank = request.node, edit.rank
    q_units, k_units, kinds = attention_pieces(edit.layout, rank, request.plan.reach.causal, mask is not None)
    # Cast apart from the attention call, so that regather recomputes the casts of the gathered keys too and
    # the partitioner cannot keep a cast copy of them on some ranks only (a different backward schedule).
    cast = [(q, "q"), (keys, "k"), (values, "v")] + ([(own[0], "own_k"), (own[1], "own_v")] if own else [])
    q, keys, values, *own = (edit.insert(autocast_like_sdpa, (x,), name=f"cp_{name}_attention_dtype")
                             for x, name in cast)
    if own:
        q_units, own_kinds, k_units, rest_kinds, all_kinds = own_keys_first(edit.layout, rank)
        first = edit.insert(own_keys_attention, (q, *own, q_units, own_kinds, request.scale, edit.layout.chunks),
                            name="cp_own_keys_attention")
        both = edit.insert(rest_attention, (q, keys, values, first, q_units, k_units, rest_kinds, all_kinds,
                                            request.scale, edit.layout.chunks), name="cp_block_attention")
        first.meta[NOT_RECOMPUTED] = True
    else:
        program = (mask.program, list(mask.leaves)) if isinstance(mask, MaskProgram) else ("", None)
        both = edit.insert(gathered_attention, (q, keys, values, None if program[0] else mask, q_units, k_units,
                                                kinds, request.scale, edit.layout.chunks, *program),
                           name="cp_block_attention")
    out = edit.insert(operator.getitem, (both, 0), name="cp_attention_out")
    for made in (both, out):
        made.meta[NOT_RECOMPUTED] = True
    edit.replace_uses(node, out)


def _attend_window(edit, request: AttentionKV, q, keys, values) -> None:
    """A sliding window over the halo's keys as :func:`window_attention_op`: the band is made tile by tile
    inside the op from the layout's positions, no ``[queries, keys]`` mask in the graph."""
    q, keys, values = (edit.insert(autocast_like_sdpa, (x,), name=f"cp_{name}_attention_dtype")
                       for x, name in ((q, "q"), (keys, "k"), (values, "v")))
    scale = edit.insert(sdpa_scale, (q, request.scale), name="cp_attention_scale")
    both = edit.insert(torch.ops.cp_passes.window_attention.default,
                       (q, keys, values, edit.rank, edit.world, edit.layout.kind, request.plan.halo, request.plan.after,
                        scale), name="cp_window_attention")
    out = edit.insert(operator.getitem, (both, 0), name="cp_attention_out")
    for made in (both, out):
        made.meta[NOT_RECOMPUTED] = True
    edit.replace_uses(request.node, out)


def sdpa_scale(q: torch.Tensor, scale) -> float:
    """SDPA's softmax scale: ``scale``, or one over the square root of the head size."""
    return q.shape[-1] ** -0.5 if scale is None else scale


def autocast_like_sdpa(x: torch.Tensor) -> torch.Tensor:
    """``x`` cast as SDPA's inputs are under autocast (to the autocast dtype; unchanged without autocast):
    :func:`block_attention_op` has no autocast rule of its own."""
    device = x.device.type
    return x.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else x


def gathered_attention(q, keys, values, mask, q_units, k_units, kinds, scale, chunks: int = 1, program: str = "",
                       leaves=None):
    """:func:`block_attention_op` with its piece bounds (units of one of the rank's ``chunks`` ranges) at this
    call's local length: ``(output, logsumexp)``."""
    length = q.shape[-2] // chunks
    scale = sdpa_scale(q, scale)
    return block_attention_op(q, keys, values, mask, [u * length for u in q_units], [u * length for u in k_units],
                              kinds, scale, False, program, leaves)


def own_keys_attention(q, keys, values, q_units, kinds, scale, chunks: int):
    """:func:`gathered_attention` of this rank's queries and its own keys, without autograd: the call that merges
    the other ranks' keys in (:func:`rest_attention`) differentiates every pair, these included. (Differentiated
    here too, the backward would run this call's attention backward on zero gradients and save its output.)"""
    return gathered_attention(q.detach(), keys.detach(), values.detach(), None, q_units, q_units, kinds, scale, chunks)


def rest_attention(q, keys, values, first, q_units, k_units, kinds, all_kinds, scale, chunks: int):
    """:func:`block_attention_rest_op` at this call's local length, merging into ``first`` (the output and
    logsumexp over the rank's own keys)."""
    length = q.shape[-2] // chunks
    return block_attention_rest_op(q, keys, values, first[0], first[1], [u * length for u in q_units],
                                   [u * length for u in k_units], kinds, all_kinds, sdpa_scale(q, scale))


def local_mask(edit, found: MetadataMask, q: torch.fx.Node, causal: bool = True) -> torch.fx.Node | MaskProgram:
    """The model's mask at this rank's query rows and the keys a causal gather brings (every key, not
    ``causal``), ``[.., L, keys]``, its rows and keys picked where the mask's terms are still per position
    (:mod:`~cp_passes.graph.selection`): as a :class:`MaskProgram` (those terms, combined a tile at a time inside
    the ops that read it) where :func:`split_mask` can write it so, else a tensor. No rank evaluates a future key
    for its own queries, so each checks the transposed block instead: the queries of the keys it brings against its
    own keys, where a key after its query must be masked. Every causal violation falls in one rank's block; the
    ranks add their counts (one all-reduce) and all fail together. Masks whose sizes depend on data take the
    whole-sequence path (:func:`global_mask`)."""
    kind = edit.layout.kind
    moved = (Move.PREFIX.value, None, 0) if causal else (Move.EVERY_KEY.value, None, None)
    if sized_by_data(found):
        return edit.insert(mask_block, (global_mask(edit, found), q, edit.rank, edit.world, kind, *moved),
                           name="cp_mask_block")
    masks = RankMasks(edit)
    positions = edit.insert(query_positions, (q, edit.rank, edit.world, kind), name="cp_query_positions")
    brought = edit.insert(brought_positions, (q, edit.rank, edit.world, kind, *moved), name="cp_key_positions")
    mask = masks.at(found, positions, brought, program=True)
    if causal:  # the transposed block: the queries of the keys brought against this rank's own keys
        count = masks.count_outside([found], SHOWN, brought, positions, None, 0, "cp_mask_future_keys")
        masks.fail_together(count, (CAUSAL_VIOLATION,), "cp_mask_causal")
    return mask


def mask_at_keys(edit, request: AttentionKV, q: torch.fx.Node) -> torch.fx.Node | None:
    """For SDPA that keeps its mask (a window's halo, a window by gather, dropout): the model's mask at this rank's
    rows and the keys its plan brings, ``[.., L, keys]``, and the run-time check that it shows no key outside the
    plan's reach, each rank its own queries against every key, a tile at a time (:func:`~.mask_program.outside_keys_op`;
    the ranks add their counts, so all fail together). Nothing ``[S, S]``. None where the mask's sizes depend on
    data or :func:`split_mask` cannot write it down (then :func:`global_mask`)."""
    found, plan, masks = request.mask, request.plan, RankMasks(edit)
    if sized_by_data(found) or masks.split(found) is None:
        return None
    rank, world, kind = edit.rank, edit.world, edit.layout.kind
    moved = (plan.move.value, plan.reach.before, plan.reach.after, request.left_padding)
    positions = edit.insert(query_positions, (q, rank, world, kind), name="cp_query_positions")
    keys = edit.insert(brought_positions, (q, rank, world, kind, *moved), name="cp_key_positions")
    evaluated = edit.insert(torch.clamp_min, (keys, 0), name="cp_key_positions_in_sequence")
    mask = edit.insert(kept_keys, (masks.at(found, positions, evaluated), keys, q, world, kind, *moved),
                       name="cp_mask_block")
    if plan.reach != EVERY_KEY_REACH:
        every = edit.insert(sequence_positions, (q, world), name="cp_sequence_positions")
        count = masks.count_outside([found], SHOWN, positions, every, plan.reach.before, plan.reach.after or 0,
                                    "cp_mask_outside_keys")
        masks.fail_together(count, (plan.message(),), "cp_mask_outside")
    return mask


CAUSAL_VIOLATION = outside(None)


