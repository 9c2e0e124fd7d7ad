"""Sequence-axis analysis.

The wrapper marks the sequence dim of every sharded input dynamic (and nothing else), so in the
captured graph the local sequence length is one symbol ``s``. A tensor dimension is a sequence
dimension exactly when its size expression contains ``s``: views, transposes, broadcasts and
merges ([batch * s, vocab]) are followed by the shape arithmetic itself, and a size that merely
equals the local length (a head dim of 16 with 16 tokens per rank) is never mistaken for it.
A shape that needs ``s`` without coming from a sharded input (``arange(s)``) shows where
positions are created.
"""

from __future__ import annotations

import inspect

from fractions import Fraction

import sympy
import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import optimization_hint

aten = torch.ops.aten

INPUT_NAME = "cp_passes_input"
"""Placeholder meta: the name of the sharded input (the model's argument or batch key) it holds."""

SHAPE_ONLY = {aten.new_zeros.default, aten.new_ones.default, aten.new_full.default, aten.new_empty.default,
              aten.zeros_like.default, aten.ones_like.default, aten.full_like.default, aten.empty_like.default}
"""Ops that read only their input's shape, dtype and device: no gradient flows back through them, and no
rows of it need to move."""


def meta_val(value):
    """The fake value of an FX argument (Node -> meta['val']), or the argument itself."""
    if isinstance(value, torch.fx.Node):
        return value.meta.get("val", value.meta.get("example_value"))
    return value


def expr_of(size):
    """A size's expression, simplified with what the shape environment knows (a size such as
    ``s // (s // 4)`` is 4 once the length is known to be a multiple of 4)."""
    if isinstance(size, torch.SymInt):
        env = size.node.shape_env
        return env.simplify(size.node.expr) if env is not None else size.node.expr
    return sympy.Integer(int(size))


def has_symbol(value, sym) -> bool:
    """Whether a SymInt, SymFloat or SymBool (or a Node holding one) depends on the sequence symbol."""
    value = meta_val(value)
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return sym in value.node.expr.free_symbols
    return False


def seq_dims(value, sym) -> tuple[int, ...]:
    """Dims of a tensor (or Node holding one) whose size depends on the sequence symbol."""
    value = meta_val(value)
    if not isinstance(value, torch.Tensor):
        return ()
    return tuple(d for d, size in enumerate(value.shape) if sym in expr_of(size).free_symbols)


def seq_multiple(size, sym) -> int | None:
    """``k`` when a dim's size is exactly ``k * s`` (an unsplit, possibly merged, sequence axis)."""
    ratio = sympy.simplify(expr_of(size) / sym)
    if ratio.is_Integer and int(ratio) > 0:
        return int(ratio)
    return None


def _whole_windows(expr, sym, multiple: int):
    """``expr`` with the local length written ``multiple * t``: sizes such as ``(s // m) * m`` then simplify,
    because every shard holds a multiple of ``multiple`` positions."""
    if multiple == 1:
        return expr
    return sympy.expand(expr.subs(sym, multiple * _UNITS))


_UNITS = sympy.Symbol("cp_units", integer=True, positive=True)


def seq_ratio(size, sym, multiple: int = 1) -> Fraction | None:
    """``r`` when a dim's size is exactly ``r * s`` with ``r`` a positive rational: 1 for the sequence axis,
    ``k`` when merged with ``k`` batch rows, ``1 / m`` for windows of ``m`` positions (``s // m``), which is
    exact when every shard holds a multiple of ``m`` positions (``multiple``, the spec's ``pad_multiple``)."""
    expr = _whole_windows(expr_of(size), sym, multiple)
    ratio = sympy.simplify(expr / _whole_windows(sym, sym, multiple))
    if ratio.is_Rational and ratio > 0:
        return Fraction(int(ratio.p), int(ratio.q))
    return None


def window(size, sym, multiple: int = 1) -> int | None:
    """How many positions a row of a dim of ``size`` covers: 1 for the sequence axis, ``m`` for its windows
    (``s // m``); None for anything else (a merge with batch rows, no sequence). A gather or a shift along
    such a dim moves whole rows in global order."""
    ratio = seq_ratio(size, sym, multiple)
    return ratio.denominator if ratio is not None and ratio.numerator == 1 else None


def sizes_equal(a, b, sym, multiple: int = 1) -> bool:
    """Whether two sizes are equal for every local length that is a multiple of ``multiple``."""
    return sympy.simplify(_whole_windows(expr_of(a), sym, multiple) - _whole_windows(expr_of(b), sym, multiple)) == 0


def static_int(value, sym=None, multiple: int = 1) -> int | None:
    """An int argument's value: a Python int, or a node computing a size whose value is known (``(64 - s % 64)
    % 64`` is 0 when every shard holds a multiple of 64: ``sym``, the local length, a multiple of ``multiple``);
    None for one that varies with the length. Args of ATen calls may be either: never compare a node to an int."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    val = meta_val(value) if isinstance(value, torch.fx.Node) else value
    if not isinstance(val, torch.SymInt):
        return None
    expr = expr_of(val)
    if not expr.is_Integer and sym is not None:
        expr = sympy.simplify(_whole_windows(expr, sym, multiple))
    return int(expr) if expr.is_Integer else None


def hint(value) -> int:
    """The concrete value of a (possibly symbolic) int at compile time, without adding guards."""
    return optimization_hint(value) if isinstance(value, torch.SymInt) else int(value)


def numel_hint(value) -> int:
    value = meta_val(value)
    n = 1
    for size in value.shape:
        n *= hint(size)
    return n


def bind_args(node: torch.fx.Node) -> dict:
    """Arguments of an ATen call by schema name (of a Python function's call, by parameter name), defaults
    filled in."""
    if not hasattr(node.target, "_schema"):
        bound = inspect.signature(node.target).bind(*node.args, **node.kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)
    schema = node.target._schema
    bound = {}
    positional = list(node.args)
    for arg in schema.arguments:
        if not arg.kwarg_only and positional:
            bound[arg.name] = positional.pop(0)
        elif arg.name in node.kwargs:
            bound[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
        else:
            bound[arg.name] = None
    return bound


def sequence_symbol(placeholders: list[torch.fx.Node]) -> set:
    """Every size symbol the graph inputs carry: exactly one (the local sequence length) when the
    sharded inputs agree and nothing else was left dynamic."""
    symbols = set()
    for node in placeholders:
        val = meta_val(node)
        if isinstance(val, torch.Tensor):
            for size in val.shape:
                symbols |= expr_of(size).free_symbols
    return symbols
