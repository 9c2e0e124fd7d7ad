"""Views, reshapes, copies, slices and pads: they must keep the sequence axis whole, or split it into
windows of consecutive positions that every shard holds whole (``CPSpec.pad_multiple``)."""

from __future__ import annotations

import math
from fractions import Fraction

import sympy
import torch
import torch.fx
from torch.utils._sympy.functions import FloorDiv

from ..errors import kernel_call, op_name, source_line
from ..graph.analysis import expr_of, hint, meta_val, seq_ratio, sizes_equal, static_int, window
from ..spec import shipped_spec_declaring
from .picks import pick
from .reductions import masked_count
from ..transports.positions import TableRows
from .registry import NO_RULE_FIX, Rewrite, RuleContext, register_rule

aten = torch.ops.aten


VIEW_OPS = (
    aten.view,
    aten._unsafe_view,
    aten.reshape,
    aten.expand,
    aten.expand_as,
    aten.broadcast_to,
    aten.broadcast_tensors,
    aten.unsqueeze,
    aten.squeeze,
    aten.transpose,
    aten.permute,
    aten.t,
    aten.clone,
    aten.contiguous,
    aten.alias,
    aten.detach,
    aten.detach_,
    aten._to_copy,
    aten.to,
    aten.type_as,
    aten.view_as,
    aten.lift_fresh_copy,
    aten.flatten,
    aten.unflatten,
    aten.movedim,
    aten.squeeze_,
    aten.unsqueeze_,
    aten.view_as_complex,
    aten.view_as_real,
    aten.view_as_complex_copy,
    aten.view_as_real_copy,
)


@register_rule(*VIEW_OPS)
def _layout(ctx: RuleContext):
    out = meta_val(ctx.node)
    if not isinstance(out, torch.Tensor):
        return None
    multiple = ctx.spec.pad_multiple
    for d in ctx.seq_dims(ctx.node):
        if seq_ratio(out.shape[d], ctx.sym, multiple) is None:
            needed = _windows_multiple(out.shape[d], ctx.sym, multiple)
            ctx.refuse(
                f"it reshapes the sequence axis into size {out.shape[d]} (local length {ctx.sym}), splitting it "
                f"into chunks; positions inside a chunk would straddle rank boundaries",
                f"declare CPSpec(pad_multiple={needed}) so that every shard holds whole windows (shard_batch then "
                f"pads to a multiple of P * {needed})" if needed else
                "keep the sequence axis whole in reshapes (merging it with batch dims is fine), or shard "
                "a length that is a multiple of the chunk and register a rule for the chunked op",
            )
    n_in = max((len(ctx.seq_dims(a)) for a in ctx.tensor_inputs()), default=0)
    if len(ctx.seq_dims(ctx.node)) > max(n_in, 1):
        ctx.refuse("it creates a second sequence axis", NO_RULE_FIX)
    if ctx.node.target in _VIEWS and ctx.is_seq(ctx.node):
        _check_windows_outer(ctx)
    return None


def _windows_multiple(size, sym, multiple: int) -> int | None:
    """The ``pad_multiple`` that makes a size of windows exact (``s // m`` needs shards of whole windows)."""
    divisors = [int(a.args[1]) for a in expr_of(size).atoms(FloorDiv) if a.args[1].is_Integer]
    needed = math.lcm(multiple, *divisors)
    return needed if divisors and seq_ratio(size, sym, needed) is not None else None


def _check_windows_outer(ctx: RuleContext) -> None:
    """A view that regroups the sequence into windows must keep the window axis outermost in its group:
    ``[.., S, ..] -> [.., S / m, m, ..]`` (windows of consecutive positions), coarser windows, or back to
    positions. ``[m, S / m]`` would put positions ``i * S / m + j`` of the local shard together, and a factor
    merged in front of a window axis may be a window's own positions moved there (by a transpose), so both
    are refused. Views without windows (batch rows merged with the sequence or split off it) pass."""
    src = next(iter(ctx.tensor_inputs()), None)
    if src is None or len(ctx.seq_dims(src)) != 1 or len(ctx.seq_dims(ctx.node)) != 1:
        return
    (d,), (e,) = ctx.seq_dims(src), ctx.seq_dims(ctx.node)
    shape_in, shape_out = meta_val(src).shape, meta_val(ctx.node).shape
    multiple = ctx.spec.pad_multiple
    ratio_in, ratio_out = seq_ratio(shape_in[d], ctx.sym, multiple), seq_ratio(shape_out[e], ctx.sym, multiple)
    if ratio_in is None or ratio_out is None or (ratio_in.denominator == 1 and ratio_out.denominator == 1):
        return
    # Positions per row of the sequence dim grow by exactly what its inner dims grow by: nothing merged in.
    unit = Fraction(math.prod(hint(x) for x in shape_out[e + 1:]), math.prod(hint(x) for x in shape_in[d + 1:]))
    if ratio_in == ratio_out and unit == 1:
        return  # the sequence dim and everything inside it unchanged: dims in front merged or split
    if ratio_in.numerator != 1 or ratio_out.numerator != 1 or ratio_in / ratio_out != unit:
        ctx.refuse(f"it regroups the sequence axis into {tuple(shape_out)} (from {tuple(shape_in)}) other than as "
                   f"windows of consecutive positions; under sharding a group would mix this rank's positions "
                   f"with no counterpart on one device",
                   "split the sequence as [..., S / m, m, ...] (windows of consecutive positions, the window "
                   "axis outer), with no other dim merged into the window axis")


@register_rule(aten.slice)
def _slice(ctx: RuleContext):
    shift = ctx.matches.shifts.get(ctx.node)
    if shift is not None:
        rows = window(meta_val(shift.source).shape[shift.dim], ctx.sym, ctx.spec.pad_multiple)
        row = "position t" if rows == 1 else f"the window (of {rows} positions) w"
        return Rewrite("shift_stencil", "shift", shift,
                       note=f"reads {row}{shift.offset:+d} (pad value {shift.fill} outside the sequence)")
    src = ctx.arg("self")
    dim = ctx.arg("dim") % ctx.ndim(src)
    out = meta_val(ctx.node)
    in_seq, out_seq = dim in ctx.seq_dims(src), dim in ctx.seq_dims(ctx.node)
    if not in_seq and not out_seq:
        return None
    full = out.shape[dim] is meta_val(src).shape[dim] or (
        sizes_equal(out.shape[dim], meta_val(src).shape[dim], ctx.sym, ctx.spec.pad_multiple)
        and (ctx.arg("step") in (None, 1))
    )
    if in_seq and full:
        return None
    if in_seq:
        ctx.refuse(
            f"it slices the sequence axis (dim {dim}) from {meta_val(src).shape[dim]} to {out.shape[dim]} "
            f"positions; on a shard the slice would be taken from this rank's positions, not the sequence's",
            "a shift is read as pad(x, (a, b))[..., start:start + seq] along the sequence (the length kept); "
            "otherwise pass the sliced tensor in pre-sliced, or slice outside the compiled module",
        )
    start = table_start(ctx, src, dim)
    if start is None:
        ctx.refuse(
            f"it slices a non-sharded tensor to the local sequence length, giving local positions "
            f"0..{out.shape[dim]}-1 on every rank (an absolute position table?), from a start that is neither a "
            f"constant nor a constant minus the length",
            "index the table with position ids (embedding(position_ids)) or an arange over the sequence, "
            "which cp_passes offsets to global positions",
        )
    first, per_length = start
    where = "its first rows" if start == (0, 0) else f"rows from {first} {per_length:+d} x the global length"
    return Rewrite("table_positions", "positions", TableRows(ctx.node, src, dim, first, per_length),
                   note=f"a table sliced to the sequence length: this rank's positions of {where}")


def table_start(ctx: RuleContext, src, dim: int) -> tuple[int, int] | None:
    """``(a, b)`` when ``src[dim]`` is sliced from ``a + b * s`` for ``s`` positions, ``b`` 0 or -1
    (``table[:s]``, ``table[a:a + s]``, ``table[n - s:]``, ``table[max(0, n - s):]`` while ``s <= n``) with step 1,
    else None."""
    start, step = ctx.args.get("start"), ctx.args.get("step")
    size = static_int(meta_val(src).shape[dim])
    expr = 0 if start is None else expr_of(meta_val(start)) if isinstance(start, torch.fx.Node) else start
    if step not in (None, 1) or size is None or not isinstance(expr, (int, sympy.Expr)):
        return None
    out = sympy.sympify(expr_of(meta_val(ctx.node).shape[dim]))
    lengths = range(1, min(size, 64) + 1)
    if any(out.subs(ctx.sym, n) != n for n in lengths):  # s rows (a min() with the table's size aside)
        return None
    values = [int(sympy.sympify(expr).subs(ctx.sym, n)) for n in lengths]
    first, per_length = values[0] - (values[1] - values[0] if len(values) > 1 else 0), (
        values[1] - values[0] if len(values) > 1 else 0)
    if any(v != first + per_length * n for n, v in enumerate(values, 1)) or per_length not in (0, -1):
        return None
    return first, per_length


@register_rule(aten.slice_scatter, aten.select_scatter)
def _write_slice(ctx: RuleContext):
    """``x[..., a:b] = y`` out of place: position-wise unless it writes part of the sequence axis."""
    dim = ctx.arg("dim") % ctx.ndim(ctx.node)
    whole = ctx.node.target is aten.slice_scatter.default and sizes_equal(
        meta_val(ctx.arg("src")).shape[dim], meta_val(ctx.node).shape[dim], ctx.sym, ctx.spec.pad_multiple)
    if dim in ctx.seq_dims(ctx.node) and not whole:
        ctx.refuse(f"it writes a slice of the sequence axis (dim {dim}); on a shard that would be this rank's "
                   f"positions, not the sequence's", NO_RULE_FIX)
    return None


@register_rule(aten.repeat)
def _repeat(ctx: RuleContext):
    """``x.repeat(n, ..)`` along the sequence axis lays ``n`` copies of the rows end to end (Llama 4's MoE: every
    token once per expert, ``[E * tokens, D]``): output row ``c * X + i`` is row ``i`` on one device as on a shard,
    as long as the copies stay the outer factor wherever a view splits the axis (``[E, tokens, D]``)."""
    src = ctx.arg("self")
    repeats = list(ctx.arg("repeats"))
    lead = len(repeats) - ctx.ndim(src)
    for d in ctx.seq_dims(src):
        n = repeats[d + lead]
        if n == 1:
            continue
        if lead or not isinstance(n, int):
            ctx.refuse("it repeats along the sequence axis and adds dims in front (or repeats a number of times "
                       "that depends on the length)", NO_RULE_FIX)
        split = _split_with_copies(ctx.node, d, n, inner=False)
        if split is not None:
            ctx.refuse(f"it repeats the rows {n} times along the sequence axis (copies end to end), and "
                       f"{op_name(split)} at {source_line(split)} splits that axis with the copies as the inner "
                       f"factor; on a shard the copies of different ranks' positions would be mixed",
                       f"split the repeated axis as [{n}, ..., seq] (copies outer), or repeat along a new dim")
    return None


@register_rule(aten.repeat_interleave)
def _repeat_interleave(ctx: RuleContext):
    if "self" not in ctx.args or not ctx.is_seq(ctx.arg("self")):
        if ctx.is_seq(ctx.node):
            ctx.refuse("it builds a sequence-length index", NO_RULE_FIX)
        return None
    n, dim = ctx.arg("repeats"), ctx.arg("dim")
    if isinstance(n, int) and dim is not None and dim % ctx.ndim(ctx.arg("self")) in ctx.seq_dims(ctx.arg("self")):
        # Every position repeated n times in place (MoE dispatch): output row i reads row i // n. Correct as
        # long as the n copies stay the inner factor of the axis wherever a view splits it.
        split = _split_with_copies(ctx.node, dim % ctx.ndim(ctx.node), n, inner=True)
        if split is not None:
            ctx.refuse(
                f"it repeats each position {n} times along the sequence axis, and {op_name(split)} at "
                f"{source_line(split)} splits that axis with the copies as the outer factor; on a shard the "
                f"copies of different ranks' positions would be mixed",
                f"split the repeated axis as [..., seq, {n}] (copies inner), or repeat along a new dim",
            )
        return None
    ctx.require_not_along_sequence(ctx.arg("self"), ctx.arg("dim"), "repeats along")
    return None


def _split_with_copies(node: torch.fx.Node, dim: int, n: int, inner: bool) -> torch.fx.Node | None:
    """The first view downstream of ``node`` that splits its repeated axis (size ``n * X``) other than as
    ``[.., X, n, ..]`` (``inner``: each position's copies together) or ``[.., n, X, ..]`` (copies end to end); the
    walk follows every value that still carries the axis whole."""
    total = expr_of(meta_val(node).shape[dim])
    stack, seen = [node], {node}
    while stack:
        for user in stack.pop().users:
            val = meta_val(user)
            if user in seen or not isinstance(val, torch.Tensor):
                continue
            seen.add(user)
            sizes = [expr_of(s) for s in val.shape]
            if total in sizes:
                stack.append(user)
            elif user.target in _VIEWS and not any(
                    sympy.simplify(rows * n - total) == 0 and copies == n
                    for rows, copies in (zip(sizes, sizes[1:]) if inner else zip(sizes[1:], sizes))):
                return user
    return None


_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unflatten.int,
          aten.flatten.using_ints, aten.view_as.default)


@register_rule(aten.constant_pad_nd, aten.pad, aten.reflection_pad1d, aten.replication_pad1d)
def _pad(ctx: RuleContext):
    src = ctx.arg("self")
    pad = list(ctx.arg("pad") if "pad" in ctx.args else ctx.arg("padding"))
    nd = ctx.ndim(src)
    for i in range(len(pad) // 2):
        d = nd - 1 - i
        if d not in ctx.seq_dims(src):
            continue
        widths = pad[2 * i:2 * i + 2]
        known = [static_int(w, ctx.sym, ctx.spec.pad_multiple) for w in widths]
        if None in known:  # a width the graph computes from the length: S // 2, or up to a multiple
            _refuse_length_dependent_pad(ctx, d, widths)
        if known != [0, 0]:
            ctx.refuse(
                f"it pads the sequence axis (dim {d}) by {known}; on a shard the padding lands at "
                f"the shard's edge instead of the sequence's",
                "a pad is handled when every use is a slice keeping the sequence length (a shift, such as a label "
                "shift) or when it feeds a causal conv1d directly; otherwise pad before sharding",
            )
    return None


def _refuse_length_dependent_pad(ctx: RuleContext, d: int, widths: list) -> None:
    shown = ", ".join(str(expr_of(meta_val(w))) if isinstance(w, torch.fx.Node) else str(w) for w in widths)
    chunk = _chunk_padding(widths, ctx.sym)
    if chunk is None:
        ctx.refuse(
            f"it pads the sequence axis (dim {d}) by [{shown}] positions, computed from the sequence length "
            f"{ctx.sym} (on a shard the local length, 1/{ctx.world} of the global one); cp_passes reads a pad "
            f"followed by a slice as a shift by a constant number of positions only",
            "pad by a constant (a Python int, e.g. from the config: pad(x, (0, 0, k, 0))[:, :S] is a shift by "
            "k), or build the shifted tensor outside the compiled module and pass it in",
        )
    kernel = kernel_call(ctx.node)
    where = f"{kernel[0].split(':')[1]} (called at {kernel[1]})" if kernel else "the model"
    ctx.refuse(
        f"it pads the sequence axis (dim {d}) up to a multiple of {chunk} ([{shown}]): {where} cuts the sequence "
        f"into chunks of {chunk} positions, as a chunked scan or recurrence does; on a shard it would chunk this "
        f"rank's positions alone, and a state carried from chunk to chunk would not reach the next rank",
        (f"declare the kernel so that it runs as one op whose state is handed from rank to rank; "
         f"{_recurrence_declaration(kernel)} (README, 'Recurrent kernels')") if kernel else
        ("run the recurrence as one function the model calls and declare it in the spec "
         "(CPSpec(recurrences=(Recurrence(\"package.module:function\", ...),)), README 'Recurrent kernels')"),
    )


def _chunk_padding(widths: list, sym) -> int | None:
    """``m`` when ``widths`` pad the end of the sequence up to a multiple of ``m`` (``[0, (m - s % m) % m]``,
    how chunked kernels make whole chunks), else None."""
    if static_int(widths[0]) != 0 or not isinstance(widths[1], torch.fx.Node):
        return None
    expr = expr_of(meta_val(widths[1]))
    moduli = sorted({int(a.args[1]) for a in expr.atoms(sympy.Function)
                     if type(a).__name__ in ("Mod", "PythonMod") and a.args[1].is_Integer and int(a.args[1]) > 1})
    for m in moduli:
        if all(expr.subs(sym, n) == (-n) % m for n in range(1, 2 * m + 1)):
            return m
    return None


def _recurrence_declaration(kernel: tuple) -> str:
    """The spec line declaring ``kernel`` (:func:`kernel_call`) a recurrence, its state arguments named as its
    signature names them."""
    path, _, signature = kernel
    shipped = shipped_spec_declaring(path)
    if shipped:
        return (f"use the spec shipped for it, model_specs/{shipped}.py: cp_compile(model) picks it by the "
                f"config's model_type, or pass spec={shipped!r}")
    params = list(signature.parameters.values()) if signature is not None else []
    names = [p.name for p in params]
    required = [p.name for p in params
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                and p.annotation not in (int, float, bool, "int", "float", "bool")]
    candidates = f"those of {', '.join(map(repr, required))} that" if required else "its arguments that"
    extra = ""
    state = next((n for n in names if "initial_state" in n), None)
    final = next((n for n in names if "final_state" in n), None)
    if state and state != "initial_state":
        extra += f", initial_state={state!r}"
    if final and final != "output_final_state":
        extra += f", output_final_state={final!r}"
    return (f"CPSpec(recurrences=(Recurrence({path!r}, sequence_args=(<{candidates} carry the sequence>), "
            f"form=\"sequential\"{extra}),))")


@register_rule(aten.tril, aten.triu, aten.diagonal, aten.diag_embed, aten.trace)
def _triangle(ctx: RuleContext):
    if ctx.seq_inputs() or ctx.is_seq(ctx.node):
        ctx.refuse(
            "it relates positions to each other (a mask or band built by the model)",
            "use scaled_dot_product_attention(..., is_causal=True) instead of a model-built mask; "
            "model-built window masks are planned with the halo transport",
        )
    return None


@register_rule(aten.index, aten.index_put, aten.index_put_, aten.masked_select, aten.nonzero,
               aten.take, aten._local_scalar_dense, aten.item, aten.embedding_bag)
def _data_dependent(ctx: RuleContext):
    count = masked_count(ctx) or pick(ctx)
    if count is not None:
        return count
    # Looking positions up in a table (table[position_ids]) is fine; indexing the sharded tensor is not.
    if ctx.is_seq(ctx.args.get("self", ctx.args.get("weight"))):
        ctx.refuse("it indexes with data-dependent positions or reads a sharded value", NO_RULE_FIX)
    if ctx.node.target.overloadpacket in (aten.index_put, aten.index_put_):
        _refuse_writes_from_positions(ctx, [*ctx.arg("indices"), ctx.arg("values")])
    return None


def _refuse_writes_from_positions(ctx: RuleContext, sources: list) -> None:
    """A write into a tensor without the sequence axis (``bag[b, ids] = 1``, ``counts.index_put_((ids,), ones,
    accumulate=True)``) whose indices or values are sequence-sharded: each rank writes its own positions only."""
    sharded = [s for s in sources if isinstance(s, torch.fx.Node) and ctx.is_seq(s)]
    if not sharded or ctx.is_seq(ctx.node):
        return
    accumulate = ctx.args.get("accumulate", False)
    ctx.refuse(
        f"it writes into a {tuple(meta_val(ctx.node).shape)} tensor without the sequence axis at indices or from "
        f"values that are sequence-sharded ('{sharded[0].name}'): each rank writes only its own positions' "
        f"{'contributions' if accumulate else 'entries'}, not the single-device result",
        "compute it outside the compiled module from the whole sequence, or "
        + ("return this rank's tensor and sum it over the ranks (dist.all_reduce)" if accumulate else
           "build it from the whole batch before sharding and pass it in as a replicated input"),
    )
