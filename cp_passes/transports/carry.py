"""Carry: a recurrent kernel's state handed from rank to rank, so rank r starts where ranks 0..r-1 leave off.

The kernel is one ``cp_passes::recurrence`` op (:mod:`cp_passes.kernels`). Three algorithms, as
the spec's :class:`~cp_passes.spec.Recurrence` chooses:

- ``affine``: a shard's final state is ``M @ S0 + h`` (``S0 @ M + h`` for a ``[..., V, K]`` state). Every rank
  runs the kernel once more on its shard with values extended by K zero columns from the state ``[0 | I]``,
  which returns ``[h | M]``; one all-gather of those (backward: a reduce-scatter); each rank folds its predecessors'
  ``S <- M_q @ S + h_q`` and runs the kernel from the true ``S0``. Ranks work in parallel.
- ``sequential``: P - 1 rounds; in each, every rank runs from its predecessor's final state of the round
  before (one all-gather of final states per round); after round r - 1 rank r's state is exact.
- ``selective``: Mamba-1's selective scan, which takes no state: the kernel runs once from zeros, every rank
  gathers each rank's ``[h, M]`` (its final state and elementwise decay), folds ``S <- M_q * S + h_q`` and adds
  the state's part to the output (:mod:`cp_passes.selective_scan`).

Autograd runs through the kernel calls and the gathers, so the gradient of each initial state returns to
the ranks that produced it. Bytes are state-sized, independent of the sequence length.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass

import torch
import torch.fx

from ..graph.analysis import hint, meta_val
from ..kernels import recurrence_op  # noqa: F401  (registers cp_passes::recurrence)
from ..kernels import selective_roles
from ..kernels import value_axis as kernel_value_axis
from .. import selective_scan
from ..layout import Layout
from .base import Cost, Transport, register_transport
from .gathers import sequence_gather_op  # noqa: F401  (registers cp_passes::sequence_gather)

aten = torch.ops.aten


@dataclass
class Carry:
    """One ``cp_passes::recurrence`` node and its declaration."""

    node: torch.fx.Node
    recurrence: object
    final_read: bool = False
    """The model reads the final state (RecurrentGemma stores it on its module): every rank gets the last rank's,
    the sequence's."""

    @property
    def state(self) -> torch.Tensor:
        return meta_val(self.node)[1]

    @functools.cached_property
    def value_axis(self) -> int | None:
        """The state's V axis for the affine form (read from the kernel: :func:`cp_passes.kernels.value_axis`), read
        once, when the rule plans the carry: by the time the carry is applied, an earlier transport may have fed
        the kernel new nodes (a token shift's halo) that carry no fake values yet."""
        kernel, args, _, options, _, _ = self.node.args
        return kernel_value_axis(kernel, [meta_val(a) for a in args], options)


def shard_start(rank: int, world: int, local_len):
    """The global position of this rank's first row (a carry's shards are contiguous)."""
    return Layout(world).start(rank, local_len)


def affine_summary(kernel: str, args: list[torch.Tensor], options: str, value: int, state: list[int],
                   value_axis: int, dtype: torch.dtype, documents, offset) -> torch.Tensor:
    """``[h | M]`` of this rank's shard, in the ``[..., K, V]`` layout: the kernel from the state ``[0 | I]`` on
    values extended by K zero columns (``h``: the final state from zeros; ``M``: how the final state depends on
    the initial one). ``state`` is the kernel's state shape, whose ``value_axis`` (-1 or -2) is V; a
    ``[..., V, K]`` state runs from ``[0 ; I]`` and its result is transposed. With packed documents, a shard in
    which a document starts (at its first position or later) has ``M = 0``: the kernel restarts the state."""
    *batch, n_k, n_v = state if value_axis == -1 else (*state[:-2], state[-1], state[-2])
    v = args[value]
    extended = list(args)
    extended[value] = torch.cat([v, v.new_zeros(*v.shape[:-1], n_k)], -1)
    start = torch.cat([torch.zeros(*batch, n_k, n_v, dtype=dtype, device=v.device),
                       torch.eye(n_k, dtype=dtype, device=v.device).expand(*batch, n_k, n_k)], -1)
    if value_axis == -1:
        return torch.ops.cp_passes.recurrence(kernel, extended, start, options, documents, offset)[1]
    final = torch.ops.cp_passes.recurrence(kernel, extended, start.transpose(-1, -2), options, documents, offset)[1]
    return final.transpose(-1, -2)


def affine_fold(every: torch.Tensor, initial_state, n_v: int, rank: int, value_axis: int = -1) -> torch.Tensor:
    """This rank's initial state from every rank's ``[h | M]`` (stacked in rank order, ``[..., K, V + K]``): the
    preceding ranks' maps applied in order to the sequence's initial state, in the kernel's layout (transposed
    back when its ``value_axis`` is -2). Rank 0 reads ``every`` too (times zero), so that no rank's graph drops
    the all-gather that the others wait in."""
    if initial_state is not None and value_axis == -2:
        initial_state = initial_state.transpose(-1, -2)
    state = every[0, ..., :n_v] * 0 if initial_state is None else initial_state + every[0, ..., :n_v] * 0
    for q in range(rank):
        state = every[q, ..., n_v:] @ state + every[q, ..., :n_v]
    return state if value_axis == -1 else state.transpose(-1, -2).contiguous()


def selective_summary(kernel: str, args: list[torch.Tensor], options: str, zero) -> torch.Tensor:
    """``[h, M]`` of this rank's shard for a ``form="selective"`` kernel (Mamba-1's selective scan): its final state
    from zeros (the second output of ``zero``, the kernel's call from zeros) and its elementwise decay ``M``."""
    h = zero[1]
    return torch.stack([h, selective_scan.state_map(selective_roles(kernel, args, options)).to(h.dtype)])


def selective_fold(every: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's initial state from every rank's ``[h, M]`` (stacked in rank order): ``S <- M_q * S + h_q`` over
    the preceding ranks from zeros (rank 0 reads ``every`` times zero, as :func:`affine_fold` does)."""
    state = every[0, 0] * 0
    for q in range(rank):
        state = every[q, 1] * state + every[q, 0]
    return state


def selective_with_state(kernel: str, args: list[torch.Tensor], options: str, zero, state: torch.Tensor):
    """The kernel's ``(output, final state)`` from ``state``, given its call from zeros (``zero``): one kernel call
    per rank."""
    return selective_scan.from_state(selective_roles(kernel, args, options), zero[0], zero[1], state)


def final_state(kernel: str, args: list[torch.Tensor], state, options: str, documents, offset) -> torch.Tensor:
    return torch.ops.cp_passes.recurrence(kernel, args, state, options, documents, offset)[1]


def predecessor(every: torch.Tensor, initial_state, rank: int) -> torch.Tensor:
    """The final state of the rank before (rank 0: the sequence's initial state, reading ``every`` too)."""
    if rank > 0:
        return every[rank - 1]
    return every[0] * 0 if initial_state is None else initial_state + every[0] * 0


class CarryTransport(Transport):
    name = "carry"
    order = 27
    runtime = (torch.ops.cp_passes.sequence_gather.default,)

    def apply(self, edit, request: Carry) -> None:
        node, rec = request.node, request.recurrence
        kernel, args, initial_state, options, documents, _ = node.args
        args = [edit.current(a) for a in args]
        initial_state = edit.current(initial_state) if initial_state is not None else None
        # Packed documents are cut to the segments of this shard, from its first global position.
        length = edit.insert(aten.sym_size.int, (args[0], rec.seq_dim), name="cp_carry_length")
        offset = edit.insert(shard_start, (edit.rank, edit.world, length), name="cp_carry_offset")
        if rec.form == "selective":
            zero = edit.insert(torch.ops.cp_passes.recurrence.default, (kernel, args, None, options, None, offset),
                               name="cp_carry_from_zeros")
            summary = edit.insert(selective_summary, (kernel, args, options, zero), name="cp_carry_summary")
            every = self._gather(edit, summary, "cp_carry_summaries")
            start = edit.insert(selective_fold, (every, edit.rank), name="cp_carry_in")
            node.target, node.args = selective_with_state, (kernel, args, options, zero, start)
            edit.changed(node)
            self._final_everywhere(edit, request)
            return
        if rec.form == "affine":
            state, axis = request.state, request.value_axis
            summary = edit.insert(affine_summary, (kernel, args, options, rec.sequence_args.index(rec.value_arg),
                                                   [int(s) for s in state.shape], axis, state.dtype, documents,
                                                   offset), name="cp_carry_summary")
            every = self._gather(edit, summary, "cp_carry_summaries")
            n_v = int(state.shape[axis])
            start = edit.insert(affine_fold, (every, initial_state, n_v, edit.rank, axis), name="cp_carry_in")
        else:
            start = initial_state
            for round_ in range(edit.world - 1):
                final = edit.insert(final_state, (kernel, args, start, options, documents, offset),
                                    name=f"cp_carry_round{round_}")
                every = self._gather(edit, final, f"cp_carry_finals{round_}")
                start = edit.insert(predecessor, (every, initial_state, edit.rank), name=f"cp_carry_in{round_}")
        node.args = (kernel, args, start, options, documents, offset)
        edit.changed(node)
        self._final_everywhere(edit, request)

    def _final_everywhere(self, edit, request: Carry) -> None:
        """Where the model reads the final state: the last rank's (the sequence's) in its place on every rank, one
        all-gather (backward: its gradient returns to the last rank)."""
        if not request.final_read:
            return
        final = next(u for u in request.node.users if u.target is operator.getitem and u.args[1] == 1)
        order = {n: i for i, n in enumerate(edit.graph.nodes)}
        first = min(final.users, key=order.__getitem__)
        one = edit.insert(aten.unsqueeze.default, (final, 0), name="cp_carry_final_one", before=first)
        every = edit.insert(torch.ops.cp_passes.sequence_gather.default, (one, 0, edit.world, edit.group_name),
                            name="cp_carry_finals", before=first)
        last = edit.insert(aten.select.int, (every, 0, -1), name="cp_carry_final", before=first)
        edit.replace_uses(final, last)

    def _gather(self, edit, state: torch.fx.Node, name: str) -> torch.fx.Node:
        """Every rank's ``state`` stacked in rank order (a graph node, so the ranks' agreement sees it;
        backward: each rank's gradient returns to it)."""
        one = edit.insert(aten.unsqueeze.default, (state, 0), name=name + "_one")
        return edit.insert(torch.ops.cp_passes.sequence_gather.default, (one, 0, edit.world, edit.group_name),
                           name=name)

    def cost(self, request: Carry, layout, rank, local_len) -> Cost:
        cost = self._carry_cost(request, layout, rank)
        if request.final_read:  # every rank's final state, to read the last rank's (the bound: that one alone)
            one = math.prod(int(s) for s in request.state.shape)
            elements, itemsize = one * (layout.world - 1), request.state.dtype.itemsize
            cost = cost + Cost("all_gather final state | bw reduce_scatter", elements, elements * itemsize,
                               one * itemsize if rank != layout.world - 1 else 0, elements * itemsize)
        return cost

    def _carry_cost(self, request: Carry, layout, rank: int) -> Cost:
        state = request.state
        itemsize, shape = state.dtype.itemsize, [int(s) for s in state.shape]
        elements = math.prod(shape)
        bound = elements * itemsize if rank > 0 else 0  # the predecessor's final state
        others = layout.world - 1
        if request.recurrence.form == "selective":
            per_rank = 2 * elements  # [h, M]
            return Cost("all_gather [h, M] | bw reduce_scatter", per_rank * others, per_rank * others * itemsize,
                        bound, per_rank * others * itemsize)
        if request.recurrence.form == "affine":
            axis = request.value_axis
            per_rank = elements + elements // shape[axis] * shape[-1 if axis == -2 else -2]  # [h | M]: K more
            return Cost("all_gather [h | M] | bw reduce_scatter", per_rank * others, per_rank * others * itemsize,
                        bound, per_rank * others * itemsize)
        moved = elements * others * others  # P - 1 rounds, each receiving every other rank's state
        return Cost(f"{others} x all_gather final state | bw reduce_scatter", moved, moved * itemsize, bound,
                    moved * itemsize)


CARRY = register_transport(CarryTransport())


_CHECKED: dict[tuple, float | None] = {}


def _random_like(value: torch.Tensor, shape: list[int], generator: torch.Generator) -> torch.Tensor:
    if value.is_floating_point():
        return (torch.randn(shape, generator=generator) * 0.3).to(value.dtype).to(value.device)
    return torch.zeros(shape, dtype=value.dtype, device=value.device)


def split_error(kernel: str, rec, args: list[torch.Tensor], options: str, state: torch.Tensor, value_axis,
                lengths: tuple[int, ...]) -> float | None:
    """What the carry assumes of the kernel, tried on random inputs (``args`` give the shapes) from a random state:
    the kernel on a sequence cut in two, the second half starting from the state the carry hands it (for the
    affine form, the fold of the halves' ``[h | M]``; else the first half's final state), against the kernel on the
    whole. The largest difference of outputs and final states relative to the whole's largest value, at the first
    of ``lengths`` the kernel runs at; None where it runs at none of them (or not on this machine's devices)."""
    n = len(rec.sequence_args)
    key = (kernel, options, rec.form, *((str(tuple(a.shape[:rec.seq_dim] + a.shape[rec.seq_dim + 1:])) if i < n else
                                         str(tuple(a.shape)), a.dtype, a.device) for i, a in enumerate(args)))
    if key in _CHECKED:
        return _CHECKED[key]
    if any(a.device.type == "cuda" for a in args) and not torch.cuda.is_available():
        return None
    found = None
    with torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.no_grad():
        for length in lengths:
            generator = torch.Generator().manual_seed(0)
            whole = [_random_like(a, [length if i < n and d == rec.seq_dim else hint(s) for d, s in enumerate(a.shape)],
                                  generator) for i, a in enumerate(args)]
            start = _random_like(state, [hint(s) for s in state.shape], generator)
            half = length // 2
            parts = [[a.narrow(rec.seq_dim, lo, hi - lo) if i < n else a for i, a in enumerate(whole)]
                     for lo, hi in ((0, half), (half, length))]
            try:
                out, final = torch.ops.cp_passes.recurrence(kernel, whole, start, options, None, 0)
                first_out, first_final = torch.ops.cp_passes.recurrence(kernel, parts[0], start, options, None, 0)
                if rec.form == "affine":
                    value = rec.sequence_args.index(rec.value_arg)
                    every = torch.stack([affine_summary(kernel, part, options, value, list(final.shape), value_axis,
                                                        final.dtype, None, 0) for part in parts])
                    handed = affine_fold(every, start, int(final.shape[value_axis]), 1, value_axis)
                else:  # a selective kernel's final state from a state is the fold of its [h, M] already
                    handed = first_final
                second_out, second_final = torch.ops.cp_passes.recurrence(kernel, parts[1], handed, options, None, 0)
            except Exception:
                continue
            if not (out.isfinite().all() and final.isfinite().all()):
                continue
            joined = torch.cat([first_out, second_out], rec.seq_dim)
            found = max(float((joined - out).abs().max() / out.abs().max().clamp_min(1e-12)),
                        float((second_final - final).abs().max() / final.abs().max().clamp_min(1e-12)))
            break
    _CHECKED[key] = found
    return found
