"""Ops with a dim argument (fine off the sequence axis), sums over it (partial sums) and losses."""

from __future__ import annotations

import torch
import torch.fx

from ..graph.analysis import meta_val, seq_multiple
from ..match.blocks import concat_reads
from ..transports.reductions import GlobalExtreme, GlobalMean, MaskedCount
from ..transports.scan import SCANS, Scan
from ..transports.shift import Diff
from .picks import pick
from .registry import RuleContext, Rewrite, Value, out_of_place, register_rule

aten = torch.ops.aten


_DIM_OPS = {
    aten.mean: "dim", aten.amax: "dim", aten.amin: "dim", aten.max: "dim", aten.min: "dim",
    aten.argmax: "dim", aten.argmin: "dim", aten.var: "dim", aten.std: "dim", aten.var_mean: "dim",
    aten.std_mean: "dim", aten.prod: "dim", aten.any: "dim", aten.all: "dim", aten.logsumexp: "dim",
    aten.norm: "dim", aten.linalg_vector_norm: "dim", aten.count_nonzero: "dim",
    aten.softmax: "dim", aten._softmax: "dim", aten.log_softmax: "dim",
    aten._log_softmax: "dim", aten.sort: "dim", aten.argsort: "dim", aten.topk: "dim",
    aten.kthvalue: "dim", aten.median: "dim", aten.mode: "dim", aten.flip: "dims", aten.roll: "dims",
    aten.select: "dim", aten.narrow: "dim", aten.split: "dim", aten.split_with_sizes: "dim",
    aten.chunk: "dim", aten.unbind: "dim", aten.index_select: "dim", aten.gather: "dim",
    aten.scatter: "dim", aten.scatter_add: "dim", aten.scatter_reduce: "dim", aten.index_add: "dim",
    aten.index_copy: "dim", aten.index_fill: "dim", aten.tensor_split: "dim",
    aten.cat: "dim", aten.concatenate: "dim", aten.concat: "dim",
}

_DIM_FIXES = {
    "flip": "reversing the sequence needs the whole sequence; flip outside the compiled module",
    "roll": "rolling the sequence moves positions across ranks; shift before sharding instead",
    "cat": "concatenating along the sequence changes every rank's positions; concatenate before sharding",
    "concatenate": "concatenating along the sequence changes every rank's positions; concatenate before sharding",
    "concat": "concatenating along the sequence changes every rank's positions; concatenate before sharding",
    **dict.fromkeys(("max", "min", "amax", "amin"), "a max or min of floating values over the sequence has no rule "
                    "(integer and boolean ones are all-reduced); compute it outside the compiled module"),
    "mean": "a mean over the sequence needs the global count: use sum (a per-rank partial sum) and divide "
    "by the global number of tokens, e.g. Hugging Face's num_items_in_batch=",
}


_EXTREMES = {aten.max.default: "max", aten.amax.default: "max", aten.any.default: "max", aten.any.dim: "max",
             aten.any.dims: "max", aten.min.default: "min", aten.amin.default: "min", aten.all.default: "min",
             aten.all.dim: "min", aten.all.dims: "min"}


def _global_extreme(ctx: RuleContext, src, dims) -> Rewrite | None:
    """A max, min, any or all of integer or boolean metadata over every sequence dim (longrope's
    ``torch.max(position_ids) + 1``): its value over the ranks, one all-reduce without autograd."""
    op = _EXTREMES.get(out_of_place(ctx.node.target) or ctx.node.target)
    if op is None or not isinstance(src, torch.fx.Node) or not ctx.is_seq(src):
        return None
    if meta_val(src).is_floating_point() or meta_val(src).is_complex():
        return None
    if not set(ctx.seq_dims(src)) <= ctx.dims(dims, ctx.ndim(src)):
        return None
    return Rewrite(f"global_{op}", "reductions", GlobalExtreme(ctx.node, op),
                   note=f"this rank's {ctx.node.target.overloadpacket.__name__} -> all_reduce {op} over the ranks "
                        f"(no autograd)")


_SCATTERS = {aten.index_add, aten.index_copy, aten.index_fill, aten.scatter, aten.scatter_add, aten.scatter_reduce}


def _dim_rule(ctx: RuleContext):
    target = out_of_place(ctx.node.target) or ctx.node.target  # index_add_ takes index_add's rule
    name = _DIM_OPS[target.overloadpacket]
    if target.overloadpacket in _SCATTERS and not ctx.is_seq(ctx.node) and ctx.seq_inputs():
        ctx.refuse(
            "it scatters per-position values into a tensor without the sequence axis: each rank holds only its "
            "own positions' contributions, not the single-device result",
            "compute it outside the compiled module, or return this rank's tensor and sum it over the ranks "
            "(dist.all_reduce)",
        )
    tensors = ctx.arg("tensors") if "tensors" in ctx.args else [ctx.args.get("self", ctx.args.get("input"))]
    dims = ctx.args.get(name)
    if target.overloadpacket in (aten.max, aten.min) and name not in ctx.args:
        dims = None
    if target.overloadpacket is aten.roll and not dims:
        dims = None
    packet = target.overloadpacket.__name__
    if "other" in ctx.args:  # binary max/min are elementwise
        return None
    extreme = _global_extreme(ctx, tensors[0], dims) or pick(ctx)
    if extreme is not None:
        return extreme
    if packet == "cat":
        if ctx.node in ctx.matches.blocks.concats:  # keys of positions and windows, brought part by part
            why = concat_reads(ctx.node, ctx.matches.blocks.keys)
            if why is not None:
                ctx.refuse(f"it concatenates positions and windows of them along the key axis, whose local value "
                           f"is no shard of the whole, and {why}",
                           "read the concatenated keys only as attention's K and V (no scaling, slicing or "
                           "other use of the concatenation itself)")
            return None
        # Concatenating onto empty tensors (a KV cache's first update) is the identity.
        tensors = [t for t in tensors if not any(isinstance(n, int) and n == 0 for n in meta_val(t).shape)]
        if len(tensors) == 1:
            return None
    for t in tensors:
        if isinstance(t, torch.fx.Node) and ctx.is_seq(t):
            ctx.require_not_along_sequence(
                t, dims, f"applies {packet} along", _DIM_FIXES.get(packet.lstrip("_").replace("log_", ""))
            )
    return None


register_rule(*_DIM_OPS)(_dim_rule)


@register_rule(*SCANS)
def _scan(ctx: RuleContext):
    """A running op along the sequence: a local scan plus a carry from the preceding ranks (the scan
    transport)."""
    src = ctx.arg("self")
    dim = ctx.arg("dim") % max(ctx.ndim(src), 1)
    if dim not in ctx.seq_dims(src):
        return None
    op = SCANS[(out_of_place(ctx.node.target) or ctx.node.target).overloadpacket]
    if seq_multiple(meta_val(src).shape[dim], ctx.sym) != 1 or len(ctx.seq_dims(src)) != 1:
        ctx.refuse(f"it takes a {op} along dim {dim}, where the sequence is merged with other dims "
                   f"({meta_val(src).shape[dim]}); the running value would cross from one row into the next",
                   "take it along the sequence axis alone ([batch, seq, ...] layout)")
    return Rewrite(f"{op}_scan", "scan", Scan(ctx.node, src, dim, op),
                   note=f"local {op} combined with the carry from the preceding ranks' last values")


@register_rule(aten.diff)
def _diff(ctx: RuleContext):
    """``diff`` along the sequence reads the previous position: a shift by one (the shift transport), with the
    prepended row at the sequence's first position."""
    src, prepend, append = ctx.arg("self"), ctx.arg("prepend"), ctx.arg("append")
    dim = ctx.arg("dim") % max(ctx.ndim(src), 1)
    if dim not in ctx.seq_dims(src):
        return None
    fix = ("write it as x - shifted x (F.pad(x, (..., 1, 0))[..., :-1, ...] along the sequence), or diff outside "
           "the model")
    if ctx.arg("n") != 1 or append is not None:
        ctx.refuse(f"it takes diff n={ctx.arg('n')} along the sequence{' with append' if append is not None else ''}; "
                   f"only n=1 with a prepended row has a rule (the length stays the sequence's)", fix)
    if prepend is None or ctx.is_seq(prepend) or meta_val(prepend).shape[dim] != 1:
        ctx.refuse("it takes diff along the sequence without prepending one row: the result is one position "
                   "shorter than the sequence, so it cannot be sharded like it", fix)
    return Rewrite("diff_shift", "shift", Diff(ctx.node, src, dim, -1, 0.0, prepend=prepend),
                   note="x - x shifted by one position; the prepended row at the sequence's first position")


@register_rule(aten.histc, aten.bincount)
def _histogram(ctx: RuleContext):
    """Counts of values over the rank's rows (a router's tokens per expert): a per-rank partial sum. (Counts of a
    sort's keys that group the same sort's reordered rows stay the rank's own: ``rules.permutations``.)"""
    return Value.PARTIAL if ctx.seq_inputs() else None


@register_rule(aten.sum, aten.nansum)
def _sum(ctx: RuleContext):
    src = ctx.arg("self")
    dims = ctx.args.get("dim")
    if ctx.dims(dims, ctx.ndim(src)) & set(ctx.seq_dims(src)):
        return Value.PARTIAL
    return None


_SIZES = {aten.sym_size.int, aten.sym_numel.default}


def masked_count(ctx: RuleContext) -> Rewrite | None:
    """``x[mask]`` with a boolean mask over the sequence whose result is only measured (a count check such
    as ``inputs_embeds[image_mask].numel() == features.numel()``): its length becomes the global count of
    the mask's elements. None for any other index."""
    if ctx.node.target is not aten.index.Tensor:
        return None
    x, indices = ctx.arg("self"), ctx.arg("indices")
    if len(indices) != 1 or not isinstance(indices[0], torch.fx.Node):
        return None
    mask = indices[0]
    if meta_val(mask).dtype != torch.bool or not ctx.is_seq(mask) or not ctx.node.users:
        return None
    if not all(u.target in _SIZES and (u.target is aten.sym_numel.default or u.args[1] == 0) for u in ctx.node.users):
        return None
    rest = meta_val(x).shape[meta_val(mask).dim():]
    if any(not isinstance(size, int) for size in rest):
        return None
    return Rewrite("masked_count", "reductions", MaskedCount(ctx.node, x, mask, tuple(rest)),
                   note="x[mask] only measured: sized by the global count of the mask (all-reduced, no autograd)")


_LOSSES = (
    aten.cross_entropy_loss, aten.nll_loss, aten.nll_loss_nd, aten.nll_loss2d, aten.mse_loss,
    aten.l1_loss, aten.smooth_l1_loss, aten.huber_loss, aten.binary_cross_entropy,
    aten.binary_cross_entropy_with_logits, aten.kl_div,
)


@register_rule(*_LOSSES)
def _loss(ctx: RuleContext):
    src = ctx.arg("self")
    if not ctx.seq_inputs():
        return None
    if ctx.node.target.overloadpacket in (aten.cross_entropy_loss, aten.nll_loss, aten.nll_loss_nd, aten.nll_loss2d):
        ctx.require_not_along_sequence(src, 1 if ctx.ndim(src) > 1 else 0, "takes its classes along")
    reduction = ctx.args.get("reduction", 1)
    if reduction == 2:
        return Value.PARTIAL
    if reduction == 1:
        if ctx.args.get("weight") is not None:
            ctx.refuse(
                "it averages over the sequence with class weights; the global weighted mean has no rule yet",
                "use reduction='sum' and divide by the global sum of weights outside the compiled module",
            )
        ignore_index = ctx.args.get("ignore_index")
        counted = "targets != ignore_index" if ignore_index is not None else "elements"
        target = "target" if "target" in ctx.args else "other"
        return Rewrite("global_mean", "reductions", GlobalMean(ctx.node, target, ignore_index), output=Value.PARTIAL,
                       note=f"mean -> this rank's sum / global count of {counted}; ranks add up to the global mean")
    return None
