"""The key side of attention: which keys each query needs, and how they reach its rank.

Every question of the form "which keys does this attention's query see, and how do they come" is answered
here, for every attention alike. SDPA's rule (:mod:`cp_passes.rules.attention`) and hand-written attention's
planner (:mod:`cp_passes.rules.key_axis`) both read the model's masks with one probe (:func:`read_reach`, on
:func:`mask_reach`) into a :class:`Reach`, and decide one :class:`KeyPlan`; the transports move (a halo, the
causal prefix of a gather, every key), count and check exactly what it says, with one run-time message
(:func:`outside`), and causal attention over gathered keys computes the block kinds of :func:`attention_pieces`.

- :class:`Reach`: how far before and after its own position a query sees (a causal prefix, a window's band, a
  two-sided band, everything). ``before`` is the halo's width: ``window - 1``.
- :class:`KeyPlan`: a reach and how its keys move (:class:`Move`): ``Move.HALO`` (the ``before`` rows before each
  of the rank's ranges and the ``after`` rows after), ``Move.PREFIX`` (the causal prefix of a gather; for packed
  documents from each range's first key its mask shows) or ``Move.EVERY_KEY`` (an all-gather). One mover,
  :func:`cp_passes.transports.key_move.move_keys`, executes every plan.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from .errors import CPCompileError
from .graph.analysis import meta_val


class Move(str, enum.Enum):
    """How an attention's keys reach its rank (not to be confused with the ``halo`` transport, which also moves a
    convolution's rows)."""

    HALO = "halo"
    PREFIX = "prefix"
    EVERY_KEY = "every_key"


PROBE_MAX_LEN = 4100
"""Longest single-device sequence at which a model-built attention mask is evaluated: to cross-check the reach
read from its structure (:mod:`cp_passes.match.mask_bands`, any length), and to read the masks whose structure
does not say (just over 4096, so that power-of-two windows up to 4096 show as bands). Not a limit on the
length: beyond it such a mask is evaluated at each rank's rows and checked at run time."""

SKIP, FULL, CAUSAL = 0, 1, 2
"""Block kinds of one (query piece, key piece) pair: computed not at all, every score, the causal triangle of
two pieces that start at the same position."""


@dataclass(frozen=True)
class Reach:
    """Key ``j`` may be visible to query ``i`` iff ``-after <= i - j <= before``; ``None`` on a side: no limit
    there (``Reach(None, 0)``: causal; ``Reach(w - 1, 0)``: a window of ``w``; ``Reach(None, None)``: every key)."""

    before: int | None
    after: int | None = 0

    @property
    def causal(self) -> bool:
        """A query sees no later key."""
        return self.after == 0

    @property
    def window(self) -> int | None:
        """``before + 1``: the keys up to and including the query's own a window shows (None: no window)."""
        return None if self.before is None else self.before + 1

    @property
    def banded(self) -> bool:
        """Bounded before and after: a halo can bring its keys."""
        return self.before is not None and self.after is not None

    def at(self, length: int) -> Reach:
        """How this reach shows in a sequence of ``length`` positions (a side as long as the sequence is no
        limit)."""
        return Reach(None if self.before is None or self.before >= length - 1 else self.before,
                     None if self.after is None or self.after >= length - 1 else self.after)

    def band(self, length: int, device=None) -> torch.Tensor:
        """``[length, length]``: the keys this reach lets each query see."""
        return band(length, self.window, device, length if self.after is None else self.after)

    def describe(self) -> str:
        if self.after is None:
            return "every key" if self.before is None else f"every later key and {self.before} before"
        if self.after:
            earlier = "every earlier key" if self.before is None else f"{self.before} keys before"
            return f"two-sided window: {earlier} and {self.after} after"
        return "causal" if self.before is None else f"window {self.window}"


CAUSAL_REACH, EVERY_KEY_REACH = Reach(None, 0), Reach(None, None)


@dataclass(frozen=True)
class KeyPlan:
    """One attention's key side: what each query needs (``reach``) and how it moves (``move``, one of
    :class:`Move`). ``first_keys``: gathered from each range's first key the model's mask shows (packed
    documents; the mask is evaluated at the rank's rows before K/V move)."""

    reach: Reach
    move: Move
    first_keys: bool = False

    def __post_init__(self) -> None:
        if self.first_keys and (self.move != Move.PREFIX or self.reach.before is not None):
            raise ValueError("only the causal prefix of a gather moves from each range's first key")
        if self.move not in tuple(Move):
            raise ValueError(f"KeyPlan.move must be a Move, got {self.move!r}")
        if self.move == Move.HALO and not self.reach.banded:
            raise ValueError(f"a halo brings a bounded band of keys, not {self.reach.describe()}")
        if self.move == Move.PREFIX and self.reach.after != 0:
            raise ValueError(f"the causal prefix holds no later key, and the reach is {self.reach.describe()}")
        if self.move == Move.EVERY_KEY and self.reach != EVERY_KEY_REACH:
            raise ValueError(f"every key moves for a query that may see every key, not {self.reach.describe()}")

    @classmethod
    def decide(cls, reach: Reach, halo: bool, first_keys: bool = False) -> KeyPlan:
        """A band by halo where ``halo`` allows it (the spec's ``window_transport``, and nothing that a halo's
        zero rows would break), a causal reach as the causal prefix of a gather (``first_keys``: from each range's
        first key its mask shows), anything else every key (every key a query may see)."""
        if halo and reach.banded:
            return cls(reach, Move.HALO)
        if reach.causal:  # a window by gather cuts its mask to the whole prefix: no first keys
            return cls(reach, Move.PREFIX, first_keys and reach.before is None)
        return cls(EVERY_KEY_REACH, Move.EVERY_KEY)

    @property
    def halo(self) -> int | None:
        """The rows before each of the rank's ranges a halo brings (None: not a halo)."""
        return self.reach.before if self.move == Move.HALO else None

    @property
    def after(self) -> int:
        """The rows after each range a halo brings (a two-sided window)."""
        return self.reach.after if self.move == Move.HALO else 0

    def describe(self) -> str:
        if self.move == Move.HALO:
            if self.after:
                return (f"a halo of the {self.halo} rows before this rank's and the {self.after} after (a two-sided "
                        f"window)")
            return f"a halo of the {self.halo} rows before this rank's (window {self.reach.window})"
        if self.move == Move.PREFIX:
            scope = ("from each range's first key its mask shows, at most the causal prefix" if self.first_keys
                     else "the causal prefix")
            return scope + (f" ({self.reach.describe()}, by gather)" if self.reach.before is not None else "")
        return "every key"

    def message(self) -> str:
        """The run-time message for a mask that shows a key outside this plan's reach."""
        return outside(self.reach.before, self.reach.after or 0)


EVERY_KEY_PLAN = KeyPlan(EVERY_KEY_REACH, Move.EVERY_KEY)


def no_dropout(dropout_p) -> bool:
    """Whether an attention's ``dropout_p`` is none or zero."""
    return dropout_p is None or (isinstance(dropout_p, (int, float)) and dropout_p == 0)


def by_blocks(reach: Reach, move: Move | None, dropout_p) -> bool:
    """Whether SDPA over gathered keys runs as block attention
    (:func:`~cp_passes.transports.block_attention.block_attention_op`): keys not by halo (``move`` None: not yet
    decided), no window, no dropout."""
    return move != Move.HALO and reach.before is None and no_dropout(dropout_p)


def sized_by_data(found) -> bool:
    """Whether a model-built mask's (:class:`~cp_passes.transports.masks.MetadataMask`) sizes depend on data (an
    indexer's top-k width): it is then evaluated over the whole sequence, inlined node by node."""
    return any(free_unbacked_symbols(meta_val(n)) for n in found.nodes)


def evaluated_at_rows(found, reach: Reach, move: Move | None, dropout_p) -> bool:
    """Whether SDPA's model-built mask is evaluated only at this rank's rows and the keys brought
    (:func:`~cp_passes.transports.attention.local_mask`) rather than over the whole sequence."""
    return by_blocks(reach, move, dropout_p) and not sized_by_data(found)


def band(size: int, window: int | None, device=None, ahead: int = 0) -> torch.Tensor:
    """``[size, size]``: key ``j`` may be visible to query ``i`` (``-ahead <= i - j``, ``< window`` for a
    window): causal with ``ahead`` 0, a two-sided band of ``ahead`` later keys otherwise."""
    visible = torch.ones(size, size, dtype=torch.bool, device=device).tril(ahead)
    return visible if window is None else visible.triu(1 - window)


def band_sides(allowed: torch.Tensor) -> tuple[int, int] | None:
    """``(before, after)``: how far before and after its query the farthest key any query of ``allowed``
    (``[n, n]``, True: seen) sees lies; None when no query sees a key."""
    if not bool(allowed.any()):
        return None
    n = allowed.shape[-1]
    distance = (torch.arange(n, device=allowed.device)[:, None] - torch.arange(n, device=allowed.device)[None, :])
    seen = distance[allowed]
    return int(seen.max()), -int(seen.min())


def mask_reach(allowed: torch.Tensor, exact: bool = True) -> Reach | str:
    """The reach of ``allowed`` (``[n, n]``, True: seen): the band it is (``exact``), or the smallest band
    holding it; or why it has none. Every reading of a window from a mask is this one."""
    n, sides = allowed.shape[-1], band_sides(allowed)
    if sides is None:
        return "its mask hides every key from every query"
    reach = Reach(*(sides if exact else (max(side, 0) for side in sides))).at(n)
    if exact and not torch.equal(allowed, reach.band(n, allowed.device)):
        return "its mask is not a band of keys around each query"
    return reach


def probe_lengths(longer: int) -> tuple[int, int]:
    """The two sequence lengths a mask is read at: ``longer`` (the compile-time length, capped) and about
    half of it."""
    return longer, max(2, longer // 2 + 1)


def read_reach(read: Callable[[int], Reach | str], longer: int) -> Reach | str:
    """The reach a mask shows at both :func:`probe_lengths` (``read(n)``: its reach for one document of ``n``
    positions, or why none), when the shorter reading is the longer one seen in fewer positions; else why
    not. The reach at the longer length is the one a transport is planned for."""
    longer, shorter = probe_lengths(longer)
    found = read(longer)
    if isinstance(found, str):
        return found
    again = read(shorter) if shorter != longer else found
    if isinstance(again, str):
        return again
    if again != found.at(shorter):
        return (f"the keys its mask shows change with the sequence length ({found.describe()} at {longer}, "
                f"{again.describe()} at {shorter})")
    return found


def outside_band_counts(shown: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor,
                        before: int | None, after: int = 0) -> torch.Tensor:
    """The one count of what a mask shows outside a band: ``[2]``, how many (query, key) pairs ``shown``
    (``[.., queries, keys]``, True: the query sees the key; queries at ``query_positions``, keys at
    ``key_positions``) shows outside ``-after <= q - k <= before`` (``before`` None: every earlier key), and how
    many queries it shows no key of that band. Compared by broadcasting positions: nothing int64 of the block's
    size."""
    inside = key_positions[None, :] <= (query_positions + after)[:, None]
    if before is not None:
        inside = inside & (key_positions[None, :] >= (query_positions - before)[:, None])
    return torch.stack([(shown & ~inside).sum(), (~(shown & inside).any(-1)).sum()])


def outside(before: int | None, after: int = 0) -> str:
    """The run-time message for a mask that lets a query see a key the transport did not bring: outside the
    causal prefix (``before`` None), a causal window of ``before + 1``, or a two-sided window."""
    envelope = ("the causal prefix" if before is None else f"the window of {before} keys before and {after} after"
                if after else f"the window of {before + 1}")
    return (f"cp_passes: the model's attention mask lets a query see a key outside {envelope} in this batch, and "
            "only those keys were brought (what the mask showed for one document when compiling, or the spec "
            "declares); fix: declare the window these modules really use in an AttentionRule (window=None: every "
            "preceding key), or build the mask so that no query sees past it; where the data decides which keys a "
            "query sees, attention written by hand takes CPSpec(attention_keys='all')")


def attention_pieces(layout, rank: int, causal: bool, masked: bool) -> tuple[list[int], list[int], list[int]]:
    """The block kinds gathered attention computes on rank ``rank``: how its queries and the keys it attends to
    split, in units of one range (``1 / layout.chunks`` of the local length): query pieces (the layout's ranges,
    in local order), key pieces (causal: every chunk up to the rank's last, in global order; else every rank's
    ranges in gather order), and each pair's kind. Causal pairs are ``FULL`` when the keys precede the queries,
    ``CAUSAL`` on the diagonal, ``SKIP`` after; adjacent ``FULL`` key pieces are one call unless a mask is cut
    per piece (``masked``: it then decides, and may skip a piece)."""
    units = layout.chunks
    q_ranges = layout.ranges(rank, units)
    if causal:  # every chunk up to this rank's last, in global order
        k_ranges = [(c, c + 1) for c in range(layout.prefix_chunks(rank))]
    else:
        k_ranges = [r for other in range(layout.world) for r in layout.ranges(other, units)]
    q_bounds = [0]
    for start, stop in q_ranges:
        q_bounds.append(q_bounds[-1] + stop - start)
    k_bounds = [0]
    for start, stop in k_ranges:
        k_bounds.append(k_bounds[-1] + stop - start)

    def kind(q_range, k_range):
        if not causal:
            return FULL
        if k_range[0] >= q_range[1]:
            return SKIP
        if masked or k_range[1] <= q_range[0]:
            return FULL  # a mask decides which of the pair's keys each query sees
        if k_range == q_range:
            return CAUSAL
        raise CPCompileError(f"cp_passes internal error: the layout's key range {k_range} straddles its query "
                             f"range {q_range}; block attention needs them equal or apart")

    kinds = [kind(q_range, k_range) for q_range in q_ranges for k_range in k_ranges]
    if not masked:  # merge runs of whole key pieces every query piece treats alike
        merged_bounds, merged = [0], [[] for _ in q_ranges]
        nk = len(k_ranges)
        for j in range(nk):
            column = [kinds[i * nk + j] for i in range(len(q_ranges))]
            if j and column == [m[-1] for m in merged] and all(c == FULL for c in column):
                merged_bounds[-1] = k_bounds[j + 1]
                continue
            merged_bounds.append(k_bounds[j + 1])
            for m, c in zip(merged, column):
                m.append(c)
        k_bounds, kinds = merged_bounds, [c for m in merged for c in m]
    return q_bounds, k_bounds, kinds


def own_keys_first(layout, rank: int) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """Causal attention without a mask in two calls, so that the first runs while the other ranks' keys travel:
    ``(q_units, own_kinds, k_units, rest_kinds, all_kinds)``. The first call's keys are the rank's own ranges
    (in local order, as its queries: ``q_units`` bound both), each pair's kind ``own_kinds``; the second's are the
    visible prefix (``k_units``, one piece a chunk, global order), computing ``rest_kinds`` (every pair but
    those of the own chunks) and differentiating ``all_kinds``."""
    units = layout.chunks
    q_ranges = list(layout.ranges(rank, units))
    q_units = [0]
    for start, stop in q_ranges:
        q_units.append(q_units[-1] + stop - start)
    k_units = list(range(layout.prefix_chunks(rank) + 1))

    def kind(q_range, chunk):
        if chunk >= q_range[1]:
            return SKIP
        return CAUSAL if chunk == q_range[0] else FULL

    own = {start for start, _ in q_ranges}
    columns = [([kind(q, c) for q in q_ranges], [SKIP if c in own else kind(q, c) for q in q_ranges])
               for c in range(len(k_units) - 1)]
    bounds, merged = [0, 1], [columns[0]] if columns else []
    for c in range(1, len(columns)):  # adjacent pieces each query sees whole or not at all alike: one piece
        if columns[c] == merged[-1] and all(k != CAUSAL for part in columns[c] for k in part):
            bounds[-1] = c + 1
        else:
            bounds.append(c + 1)
            merged.append(columns[c])
    all_kinds = [column[0][i] for i in range(len(q_ranges)) for column in merged]
    rest_kinds = [column[1][i] for i in range(len(q_ranges)) for column in merged]
    own_kinds = [kind(q, start) for q in q_ranges for start, _ in q_ranges]
    return q_units, own_kinds, bounds if columns else [0], rest_kinds, all_kinds
