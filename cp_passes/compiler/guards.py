"""Guards on the local length: a branch the model takes on ``x.shape[1]`` must be the one the global length takes.

dynamo turns ``if x.shape[1] > 20:`` into a guard on the sequence symbol ``s`` and compiles one branch. Under
CP the model sees the local length ``s`` while one device sees the global ``P * s``, so the compiled branch is
the single-device one only if every guard the model's code put on the length also holds at ``P * s``: for every
local length ``s`` the guard admits (the graph is reused for all of them), it must still be true at ``P * s``. Only
guards from the model's own Python (an ``if``, a conditional expression) are branches; the guards an op's shape
checks add (broadcasting, contiguity, a view's sizes) are not, and an op that reads rows by the length
(``table[S // 8]``) is refused by the planner. One kind an op adds is checked too: ``Eq(f(s), c)`` added where dynamo
runs the op (its argument parser made an int of it, not a meta kernel's size check), an int the op needed
computed from the length (``h[:, h.shape[1] // 2]`` selects the constant row 8 for every local length
with ``s // 2 == 8``), which the global length decides the other way.

A guard that the global length of this call decides as the local one does is accepted and guarded at the global
length too (``P * s <= c`` beside ``s <= c``): the older rotary caches' ``if seq_len > self.max_seq_len_cached``
recompute nothing at any length the cache covers, and a call past it compiles again, where it is refused. Any
other guard is checked at every candidate length: each ``s`` up to ``_DENSE`` and, around every integer ``c`` the
guard's expression names, the lengths near ``c / k`` and ``c`` for every ``k`` up to ``2P`` (where a threshold,
a multiple or a modulus changes its answer). A linear threshold (``s <= c``, ``2 * s > c``) or a divisibility
(``s % m == 0``) is decided exactly by those lengths; any guard that fails at one of them is refused naming the
line dynamo recorded for it.
"""

from __future__ import annotations

import sympy

from ..errors import CPCompileError

_DENSE = 512


def _candidates(expr: sympy.Basic, world: int, lowest: int) -> list[int]:
    lengths = set(range(lowest, _DENSE + 1))
    for c in (abs(int(a)) for a in expr.atoms(sympy.Integer) if abs(int(a)) > 1):
        for k in range(1, 2 * world + 1):
            lengths.update(c // k + d for d in range(-2, 3))
    return sorted(n for n in lengths if n >= lowest)


def _counterexample(expr: sympy.Basic, sym: sympy.Symbol, world: int, lowest: int) -> int | None:
    """A local length from ``lowest`` on that the guard admits and whose global length ``world * s`` it rejects,
    or None."""
    for n in _candidates(expr, world, lowest):
        try:
            if bool(expr.subs(sym, n)) and not bool(expr.subs(sym, world * n)):
                return n
        except ZeroDivisionError:  # a length whose windows (s // m) are none: not one the guard admits
            continue
    return None


def _decided_by_model_code(guard) -> bool:
    """A guard dynamo added while evaluating the model's own Python (``if``, a conditional expression, ``%``), not
    one an op's shape checks added (broadcasting, contiguity, a view's sizes): those hold for every length the
    op accepts and say nothing about which branch the model takes."""
    where = guard.sloc.framework_loc
    filename = where.filename if hasattr(where, "filename") else str(where or "")
    return "_dynamo/variables/" in filename.replace("\\", "/")


def _pins(expr: sympy.Basic, sym: sympy.Symbol) -> bool:
    """``Eq(f(s), c)``: an op that needed an int took one computed from the length (``h[:, h.shape[1] // 2]``
    selects row 8 of every local length 16 or 17), which pins ``f(s)`` to this length's value."""
    return (isinstance(expr, sympy.Eq) and any(side.is_Integer for side in expr.args)
            and any(sym in side.free_symbols for side in expr.args))


def _int_argument(guard) -> bool:
    """A guard dynamo added running an op on an int argument computed from the length (the op's argument parser
    specialised it), not one a meta kernel's shape check added (a copy's sizes: those hold for local shapes)."""
    where = guard.sloc.framework_loc
    filename = where.filename if hasattr(where, "filename") else str(where or "")
    return filename.replace("\\", "/").endswith("_dynamo/utils.py") and getattr(where, "name", "") == "run_node"


def check_length_guards(shape_env, sym: sympy.Symbol, world: int) -> None:
    """Refuse the graph if a guard on the local length could be decided differently by the global length."""
    problems, seen = [], set()
    for guard in shape_env.guards:
        expr = shape_env.replace(guard.expr)
        if expr in seen:  # the same guard added again (by the op the first one's line called)
            continue
        seen.add(expr)
        if not _decided_by_model_code(guard) and not (_pins(expr, sym) and _int_argument(guard)):
            continue
        if sym not in expr.free_symbols or expr.free_symbols != {sym}:
            continue
        n = _counterexample(expr, sym, world, max(int(shape_env.var_to_range[sym].lower), 1))
        now = shape_env.backed_var_to_val.get(sym)
        if n is not None and now is not None and bool(expr.subs(sym, now)) and bool(expr.subs(sym, world * now)):
            # this call's global length decides as its local one does: the graph holds while the global length
            # keeps deciding so, and a length where it would not compiles again (and is refused there)
            shape_env.evaluate_expr(expr.subs(sym, world * sym))
            continue
        if n is not None:
            problems.append(f"the code at {guard.sloc} decides on the sequence length: the graph dynamo compiled "
                            f"holds while {expr} for the local length {sym}, but at a local length of {n} the "
                            f"global length {world * n} decides the other way on one device")
    if problems:
        raise CPCompileError(
            "; ".join(problems) + ". Fix: decide on a length passed in as an input (the global length) or on a "
            "config value, not on x.shape of a sequence-sharded tensor; index tables with position ids, not with "
            "the length. TORCH_LOGS=\"+dynamic\" shows every guard on the length")
