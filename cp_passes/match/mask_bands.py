"""The keys a model-built mask shows, read from its formula (:mod:`.mask_replay`) for every length at once.

The formula of a ``[.., queries, keys]`` mask is read as a band of ``d = i - j`` (query ``i``, key ``j``): a
comparison of ``i - j`` with a constant bounds ``d`` on one side (``j <= i``: ``d >= 0``; ``j > i - w``:
``d <= w - 1``); a comparison of one index with the length holds everywhere or nowhere; a chunk
(``i // c == j // c``) bounds ``d`` by ``c - 1`` on either side, not exactly; an absolute value bounds it on both
sides; anything else (document ids, data, an op the replay does not model) bounds it nowhere. ``and`` intersects,
``or`` joins, ``not`` complements an exact band. The answer, :class:`SymbolicReach`, is the smallest band holding
every key the mask shows and whether the mask shows exactly that band. Nothing is evaluated at a length, so no
length limits it; :mod:`cp_passes.rules.attention` still evaluates the mask at a short length, as a cross-check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import sympy
import torch

from ..graph.analysis import INPUT_NAME, meta_val
from ..key_plan import Reach
from .failed import FailedMatch
from .mask_replay import Sym, constant, positions, replay, substitute

INF = math.inf


@dataclass(frozen=True)
class SymbolicReach:
    """The keys a mask shows as a band of ``d = i - j``: ``lo <= d <= hi`` holds every key it shows (``lo > hi``:
    none), and ``exact``: the mask shows exactly those keys."""

    lo: float
    hi: float
    exact: bool

    @property
    def empty(self) -> bool:
        return self.lo > self.hi

    @property
    def reach(self) -> Reach:
        """As a :class:`~cp_passes.key_plan.Reach` (``before = hi``, ``after = -lo``; unbounded: None)."""
        return Reach(None if self.hi == INF else int(self.hi), None if self.lo == -INF else -int(self.lo))

    def holds(self, shown: torch.Tensor) -> bool:
        """Whether ``shown`` (``[n, n]``, True: the query sees the key) is this band at ``n`` where exact, and within
        it otherwise: the cross-check of a reading against the mask evaluated."""
        n = shown.shape[-1]
        d = torch.arange(n)[:, None] - torch.arange(n)[None, :]
        band = (d >= max(self.lo, -n)) & (d <= min(self.hi, n))
        return bool(torch.equal(shown, band)) if self.exact else not bool((shown & ~band).any())

    def describe(self) -> str:
        if self.empty:
            return "no key"
        return ("exactly " if self.exact else "within ") + self.reach.describe()


EVERYWHERE = SymbolicReach(-INF, INF, False)
"""Nothing known: any key may show."""
EVERY_KEY, NO_KEY = SymbolicReach(-INF, INF, True), SymbolicReach(INF, -INF, True)


def _relation(rel, i, j, ranges: dict) -> SymbolicReach:
    """A comparison of affine index expressions as a band of ``d = i - j``."""
    diff = sympy.expand(rel.lhs - rel.rhs)
    others = diff.free_symbols - {i, j} - set(ranges) - _lengths(ranges)
    if others:
        return EVERYWHERE
    try:
        poly = sympy.Poly(diff, i, j)
    except sympy.PolynomialError:
        return EVERYWHERE
    if poly.total_degree() > 1:
        return EVERYWHERE
    a, b = (int(poly.coeff_monomial(s)) if poly.coeff_monomial(s).is_integer else None for s in (i, j))
    c = poly.coeff_monomial(1)
    if a is None or b is None:
        return EVERYWHERE
    if a == -b and a != 0 and c.is_number:
        return _solve(type(rel), a, c)
    truth = _everywhere(type(rel), diff, ranges)
    if truth is None:
        return EVERYWHERE
    return EVERY_KEY if truth else NO_KEY


def _lengths(ranges: dict) -> set:
    return set().union(*(sympy.sympify(n).free_symbols for n in ranges.values())) if ranges else set()


def _solve(kind, a: int, c) -> SymbolicReach:
    """``a * d + c (kind) 0`` as an interval of ``d``."""
    bound = -sympy.Rational(c) / a
    flip = a < 0
    if kind is sympy.Eq:
        return SymbolicReach(float(bound), float(bound), True) if bound.is_integer else NO_KEY
    if kind is sympy.Ne:
        return SymbolicReach(-INF, INF, not bound.is_integer)
    strict = kind in (sympy.Lt, sympy.Gt)
    below = (kind in (sympy.Lt, sympy.Le)) != flip  # d below the bound
    if below:
        hi = sympy.ceiling(bound) - 1 if strict else sympy.floor(bound)
        return SymbolicReach(-INF, float(hi), True)
    lo = sympy.floor(bound) + 1 if strict else sympy.ceiling(bound)
    return SymbolicReach(float(lo), INF, True)


def _everywhere(kind, diff, ranges: dict) -> bool | None:
    """Whether ``diff (kind) 0`` holds at every index in ``ranges`` (symbol -> its extent), fails at every one,
    or (None) neither or cannot tell. ``diff`` is affine in the indices."""
    low, high = diff, diff
    for s, extent in ranges.items():
        coeff = diff.coeff(s)
        if coeff == 0:
            continue
        top = extent - 1
        low, high = low.subs(s, 0), high.subs(s, 0)
        if coeff.is_positive:
            high = high + coeff * top
        elif coeff.is_negative:
            low = low + coeff * top
        else:
            return None
    low, high = sympy.expand(low), sympy.expand(high)
    tests = {sympy.Lt: (high.is_negative, low.is_nonnegative), sympy.Le: (high.is_nonpositive, low.is_positive),
             sympy.Gt: (low.is_positive, high.is_nonpositive), sympy.Ge: (low.is_nonnegative, high.is_negative),
             sympy.Eq: (low.is_zero and high.is_zero, low.is_positive or high.is_negative),
             sympy.Ne: (low.is_positive or high.is_negative, low.is_zero and high.is_zero)}
    always, never = tests[kind]
    return True if always else False if never else None


def _chunk(rel, i, j) -> SymbolicReach | None:
    """``(i + a) // c == (j + b) // c``: the same chunk of ``c`` positions, so ``|i - j + a - b| < c``."""
    left, right = rel.lhs, rel.rhs
    if not (isinstance(left, sympy.floor) and isinstance(right, sympy.floor)):
        return None
    (x,), (y,) = left.args, right.args
    c = sympy.fraction(sympy.together(x))[1]
    if c != sympy.fraction(sympy.together(y))[1] or not (c.is_integer and c.is_positive):
        return None
    shift = sympy.expand((x - y) * c)  # (i - j) + s, or -(i - j) + s: |d + s| < c, or |d - s| < c
    for sign in (1, -1):
        rest = sympy.expand(shift - sign * (i - j))
        if rest.is_number:
            centre = -sign * rest
            return SymbolicReach(float(centre - (c - 1)), float(centre + (c - 1)), False)
    return None


def classify(expr, i, j, ranges: dict) -> SymbolicReach:
    """The band of ``d = i - j`` holding every ``(i, j)`` where the boolean formula ``expr`` holds (query ``i``,
    key ``j``; ``ranges``: every index symbol's extent), and whether it is exactly that band."""
    if expr == sympy.true:
        return EVERY_KEY
    if expr == sympy.false:
        return NO_KEY
    if isinstance(expr, sympy.And):
        parts = [classify(a, i, j, ranges) for a in expr.args]
        lo, hi = max(p.lo for p in parts), min(p.hi for p in parts)
        return SymbolicReach(lo, hi, all(p.exact for p in parts))
    if isinstance(expr, sympy.Or):
        parts = [p for p in (classify(a, i, j, ranges) for a in expr.args) if not (p.empty and p.exact)]
        if not parts:
            return NO_KEY
        parts.sort(key=lambda p: p.lo)
        joined = all(p.exact for p in parts) and all(b.lo <= a.hi + 1 for a, b in zip(parts, parts[1:]))
        return SymbolicReach(parts[0].lo, max(p.hi for p in parts), joined)
    if isinstance(expr, sympy.Not):
        inner = classify(expr.args[0], i, j, ranges)
        if not inner.exact:
            return EVERYWHERE
        if inner.empty:
            return EVERY_KEY
        if inner.lo == -INF and inner.hi == INF:
            return NO_KEY
        if inner.lo == -INF:
            return SymbolicReach(inner.hi + 1, INF, True)
        if inner.hi == INF:
            return SymbolicReach(-INF, inner.lo - 1, True)
        return EVERYWHERE
    if isinstance(expr, sympy.Eq):
        chunk = _chunk(expr, i, j)
        if chunk is not None:
            return chunk
    if isinstance(expr, (sympy.Lt, sympy.Le, sympy.Gt, sympy.Ge, sympy.Eq, sympy.Ne)):
        if any(isinstance(a, (sympy.floor, sympy.Abs)) for a in sympy.preorder_traversal(expr)):
            return _abs_band(expr, i, j, ranges)
        return _relation(expr, i, j, ranges)
    return EVERYWHERE


def _abs_band(rel, i, j, ranges) -> SymbolicReach:
    """``|e| <= w`` (and the like) as ``-w <= e <= w``; any other comparison of a floor or an absolute value
    bounds nothing."""
    kind, lhs, rhs = type(rel), rel.lhs, rel.rhs
    if isinstance(rhs, sympy.Abs) and kind in (sympy.Ge, sympy.Gt):
        kind, lhs, rhs = {sympy.Ge: sympy.Le, sympy.Gt: sympy.Lt}[kind], rhs, lhs
    if not (isinstance(lhs, sympy.Abs) and kind in (sympy.Le, sympy.Lt) and rhs.is_number):
        return EVERYWHERE
    (inner,) = lhs.args
    below = classify(kind(inner, rhs, evaluate=False), i, j, ranges)
    above = classify(kind(-inner, rhs, evaluate=False), i, j, ranges)
    return SymbolicReach(max(below.lo, above.lo), min(below.hi, above.hi), below.exact and above.exact)


def read_formula(mask: Sym | None) -> SymbolicReach | FailedMatch:
    """The band of ``d = i - j`` a ``[.., queries, keys]`` mask (boolean, or additive: 0 where a key shows) shows."""
    if mask is None or len(mask.shape) < 2 or not (mask.boolean or mask.hidden is not None):
        return FailedMatch("cp_passes could not follow how the mask is computed from positions")
    i = sympy.Symbol("cp_query", integer=True, nonnegative=True)
    j = sympy.Symbol("cp_key", integer=True, nonnegative=True)
    formula = substitute(mask.expr, {v: s for v, s in ((mask.dims[-2], i), (mask.dims[-1], j)) if v is not None})
    if {d for d in mask.dims[:-2] if d is not None} & formula.free_symbols:
        return FailedMatch("its mask differs across batch rows or heads")
    return classify(formula, i, j, {i: mask.shape[-2], j: mask.shape[-1]})


def document_leaf(leaf: torch.fx.Node, dim: int, spec, padding: bool = False) -> Sym | None:
    """A sharded input as one unpadded document (:func:`~.masks.one_document`'s roles, symbolically): positions
    ``0..S-1`` along ``dim``, doc ids one document, with ``padding`` an ``attention_mask`` of ones; None for an
    input of another role (unknown)."""
    val, name = meta_val(leaf), leaf.meta.get(INPUT_NAME)
    if name in spec.position_keys:
        return positions(val.shape, dim)
    if name == spec.doc_key:
        return constant(0, val.shape)
    if padding and name == "attention_mask":
        return constant(True if val.dtype == torch.bool else 1, val.shape)
    return None


def symbolic_reach(found, spec, padding: bool = False) -> SymbolicReach | FailedMatch:
    """The keys ``found`` (a :class:`~.masks.PositionMask`, or a
    :class:`~cp_passes.transports.masks.MetadataMask` for one unpadded document, :func:`document_leaf`) shows,
    at every length."""
    leaves = {leaf: document_leaf(leaf, dim, spec, padding)
              for leaf, dim in zip(getattr(found, "tensor_leaves", ()), getattr(found, "leaf_dims", ()))}
    return read_formula(replay(found.mask, leaves))
