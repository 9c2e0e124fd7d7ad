"""The rule table: how each ATen op behaves when an input is sharded along the sequence.

A rule is a function ``rule(ctx: RuleContext) -> Rewrite | None`` registered for one or more ops
(an ``OpOverload`` or a whole ``OpOverloadPacket``)::

    @cp_passes.register_rule(torch.ops.mylib.rowwise_gelu)
    def _(ctx):
        ctx.require_not_along_sequence(ctx.arg("dim"))   # refuses if it would mix positions
        return None                                      # position-wise: nothing to rewrite

Returning ``None`` says the op is correct on a local shard as it is. Returning a
:class:`Rewrite` schedules a graph edit for one of the transport passes. ``ctx.refuse(why, fix)``
stops compilation with an error naming the op and its source line. An op with a sharded input
and no rule is refused, never run as if it were position-wise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx

from .analysis import hint, meta_val, seq_dims, seq_multiple
from .errors import Problem

aten = torch.ops.aten

_RULES: dict[object, Callable] = {}


def register_rule(*ops):
    """Register ``fn`` as the rule for each op (an OpOverload, or an OpOverloadPacket for all overloads)."""

    def decorator(fn):
        for op in ops:
            _RULES[op] = fn
        return fn

    return decorator


def positionwise(*ops) -> None:
    """Declare ops that never mix sequence positions (each output position reads only its own)."""
    register_rule(*ops)(_positionwise_rule)


def lookup_rule(target):
    if target in _RULES:
        return _RULES[target]
    packet = getattr(target, "overloadpacket", None)
    if packet is not None and packet in _RULES:
        return _RULES[packet]
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        return _positionwise_rule
    return None


class Refusal(Exception):
    def __init__(self, problem: Problem):
        self.problem = problem


@dataclass
class Transfer:
    """Which rule changed a node, with which transport, and what that moves for this rank per forward."""

    rule: str
    transport: str
    collective: str = ""
    elements: int = 0
    bytes: int = 0
    lower_bound_bytes: int = 0
    sent_bytes: int = 0
    note: str = ""


@dataclass
class Rewrite(Transfer):
    """A planned graph edit: ``apply(gm, pass_name)`` runs in the pass named by ``transport``."""

    apply: Callable | None = None


@dataclass
class RuleContext:
    node: torch.fx.Node
    sym: object
    spec: object
    rank: int
    world: int
    group_name: str
    length: torch.SymInt
    """The local sequence length as the graph carries it (``sym`` is its symbol)."""
    partial: dict = field(default_factory=dict)
    args: dict = field(default_factory=dict)
    out_partial: bool = False

    # -- queries -------------------------------------------------------------------------
    def arg(self, name):
        return self.args[name]

    def seq_dims(self, value) -> tuple[int, ...]:
        return seq_dims(value, self.sym)

    def is_seq(self, value) -> bool:
        return bool(self.seq_dims(value))

    def is_partial(self, value) -> bool:
        return isinstance(value, torch.fx.Node) and value in self.partial

    def tensor_inputs(self) -> list[torch.fx.Node]:
        return [a for a in self.node.all_input_nodes if isinstance(meta_val(a), torch.Tensor)]

    def seq_inputs(self) -> list[torch.fx.Node]:
        return [a for a in self.tensor_inputs() if self.is_seq(a)]

    def ndim(self, value) -> int:
        return meta_val(value).dim()

    def dims(self, dims, ndim: int) -> set[int]:
        """Normalise a dim / dim list argument; ``None`` or ``[]`` mean every dim."""
        if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
            return set(range(ndim))
        if isinstance(dims, int):
            dims = [dims]
        return {d % max(ndim, 1) for d in dims}

    def local_len(self) -> int:
        return hint(self.length)

    # -- verdicts ------------------------------------------------------------------------
    def refuse(self, why: str, fix: str):
        raise Refusal(Problem.at(self.node, why, fix))

    def require_not_along_sequence(self, value, dims, what: str = "operates along", fix: str | None = None):
        along = self.dims(dims, self.ndim(value)) & set(self.seq_dims(value))
        if along:
            self.refuse(
                f"it {what} dim {sorted(along)}, the sequence axis (sharded across {self.world} ranks), and "
                f"cp_passes has no rule for that",
                fix or _NO_RULE_FIX,
            )


_NO_RULE_FIX = (
    "keep this op off the sequence axis, move it outside the compiled module, or register a rule "
    "for it with @cp_passes.register_rule(op) (see README, 'Rules for your own ops')"
)


# ---------------------------------------------------------------------------------------------
# Position-wise ops


def _positionwise_rule(ctx: RuleContext):
    return None


positionwise(
    aten.dropout,
    aten.native_dropout,
    aten.feature_dropout,
    aten.alpha_dropout,
    aten.bernoulli,
    aten.rand_like,
    aten.randn_like,
    aten.zeros_like,
    aten.ones_like,
    aten.full_like,
    aten.empty_like,
    aten.new_zeros,
    aten.new_ones,
    aten.new_full,
    aten.new_empty,
    aten.zeros,
    aten.ones,
    aten.full,
    aten.empty,
    aten.empty_strided,
    aten.scalar_tensor,
    aten.rand,
    aten.randn,
    aten.sym_size,
    aten.sym_numel,
    aten.sym_stride,
    aten._assert_tensor_metadata,
    aten.where,
    aten.masked_fill,
    aten.__and__,
    aten.__or__,
    aten.__xor__,
    aten.silu,
    aten.gelu,
    aten.relu,
    aten.sigmoid,
    aten.tanh,
    aten.softplus,
    aten.stack,
)


@register_rule(aten.embedding)
def _embedding(ctx: RuleContext):
    if ctx.is_seq(ctx.arg("weight")):
        ctx.refuse("the embedding table itself is sharded along the sequence", _NO_RULE_FIX)
    return None


# ---------------------------------------------------------------------------------------------
# Layout: views, reshapes, copies. They never mix positions, but must keep the axis whole.

_LAYOUT = (
    aten.view,
    aten._unsafe_view,
    aten.reshape,
    aten.expand,
    aten.expand_as,
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
)


@register_rule(*_LAYOUT)
def _layout(ctx: RuleContext):
    out = meta_val(ctx.node)
    if not isinstance(out, torch.Tensor):
        return None
    for d in ctx.seq_dims(ctx.node):
        if seq_multiple(out.shape[d], ctx.sym) is None:
            ctx.refuse(
                f"it reshapes the sequence axis into size {out.shape[d]} (local length {ctx.sym}), splitting it "
                f"into chunks; positions inside a chunk would straddle rank boundaries",
                "keep the sequence axis whole in reshapes (merging it with batch dims is fine), or shard "
                "a length that is a multiple of the chunk and register a rule for the chunked op",
            )
    n_in = max((len(ctx.seq_dims(a)) for a in ctx.tensor_inputs()), default=0)
    if len(ctx.seq_dims(ctx.node)) > max(n_in, 1):
        ctx.refuse("it creates a second sequence axis", _NO_RULE_FIX)
    return None


@register_rule(aten.slice)
def _slice(ctx: RuleContext):
    from .rewrites import conv_for_slice

    src = ctx.arg("self")
    if conv_for_slice(ctx.node, ctx.sym) is not None:
        return None  # keeps a causal convolution's first seq outputs: the conv rule drops it
    dim = ctx.arg("dim") % ctx.ndim(src)
    out = meta_val(ctx.node)
    in_seq, out_seq = dim in ctx.seq_dims(src), dim in ctx.seq_dims(ctx.node)
    if not in_seq and not out_seq:
        return None
    full = out.shape[dim] is meta_val(src).shape[dim] or (
        str(out.shape[dim]) == str(meta_val(src).shape[dim]) and (ctx.arg("step") in (None, 1))
    )
    if in_seq and full:
        return None
    if in_seq:
        ctx.refuse(
            f"it slices the sequence axis (dim {dim}) from {meta_val(src).shape[dim]} to {out.shape[dim]} "
            f"positions; on a shard the slice would be taken from this rank's positions, not the sequence's",
            "if this is a label shift, shift labels before sharding and pass them pre-shifted (Hugging Face: "
            "shift_labels=); otherwise slice outside the compiled module",
        )
    ctx.refuse(
        f"it slices a non-sharded tensor to the local sequence length, giving local positions 0..{out.shape[dim]}-1 "
        f"on every rank (an absolute position table?)",
        "index the table with position ids (embedding(position_ids)) or an arange over the sequence, "
        "which cp_passes offsets to global positions",
    )


@register_rule(aten.repeat)
def _repeat(ctx: RuleContext):
    src = ctx.arg("self")
    repeats = list(ctx.arg("repeats"))
    lead = len(repeats) - ctx.ndim(src)
    for d in ctx.seq_dims(src):
        if repeats[d + lead] != 1:
            ctx.refuse("it repeats along the sequence axis", _NO_RULE_FIX)
    return None


@register_rule(aten.repeat_interleave)
def _repeat_interleave(ctx: RuleContext):
    if "self" not in ctx.args or not ctx.is_seq(ctx.arg("self")):
        if ctx.is_seq(ctx.node):
            ctx.refuse("it builds a sequence-length index", _NO_RULE_FIX)
        return None
    ctx.require_not_along_sequence(ctx.arg("self"), ctx.arg("dim"), "repeats along")
    return None


# ---------------------------------------------------------------------------------------------
# Ops with a dim argument: fine off the sequence axis, refused on it (sum becomes a partial sum).

_DIM_OPS = {
    aten.mean: "dim", aten.amax: "dim", aten.amin: "dim", aten.max: "dim", aten.min: "dim",
    aten.argmax: "dim", aten.argmin: "dim", aten.var: "dim", aten.std: "dim", aten.var_mean: "dim",
    aten.std_mean: "dim", aten.prod: "dim", aten.any: "dim", aten.all: "dim", aten.logsumexp: "dim",
    aten.norm: "dim", aten.linalg_vector_norm: "dim", aten.count_nonzero: "dim",
    aten.cumsum: "dim", aten.cumprod: "dim", aten.cummax: "dim", aten.cummin: "dim",
    aten.logcumsumexp: "dim", aten.softmax: "dim", aten._softmax: "dim", aten.log_softmax: "dim",
    aten._log_softmax: "dim", aten.sort: "dim", aten.argsort: "dim", aten.topk: "dim",
    aten.kthvalue: "dim", aten.median: "dim", aten.mode: "dim", aten.flip: "dims", aten.roll: "dims",
    aten.select: "dim", aten.narrow: "dim", aten.split: "dim", aten.split_with_sizes: "dim",
    aten.chunk: "dim", aten.unbind: "dim", aten.index_select: "dim", aten.gather: "dim",
    aten.scatter: "dim", aten.scatter_add: "dim", aten.scatter_reduce: "dim", aten.index_add: "dim",
    aten.index_copy: "dim", aten.index_fill: "dim", aten.tensor_split: "dim", aten.diff: "dim",
    aten.cat: "dim", aten.unfold: "dimension",
}

_DIM_FIXES = {
    "cumsum": "a running sum along the sequence needs a cross-rank prefix (not supported yet); compute it "
    "outside the compiled module or over a non-sequence dim",
    "flip": "reversing the sequence needs the whole sequence; flip outside the compiled module",
    "roll": "rolling the sequence moves positions across ranks; shift before sharding instead",
    "cat": "concatenating along the sequence changes every rank's positions; concatenate before sharding",
    "mean": "a mean over the sequence needs the global count: use sum (a per-rank partial sum) and divide "
    "by the global number of tokens, e.g. Hugging Face's num_items_in_batch=",
}


def _dim_rule(ctx: RuleContext):
    name = _DIM_OPS[ctx.node.target.overloadpacket]
    tensors = ctx.arg("tensors") if "tensors" in ctx.args else [ctx.args.get("self", ctx.args.get("input"))]
    dims = ctx.args.get(name)
    if ctx.node.target.overloadpacket in (aten.max, aten.min) and name not in ctx.args:
        dims = None
    if ctx.node.target.overloadpacket is aten.roll and not dims:
        dims = None
    packet = ctx.node.target.overloadpacket.__name__
    if "other" in ctx.args:  # binary max/min are elementwise
        return None
    if packet == "cat":
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


@register_rule(aten.sum, aten.nansum)
def _sum(ctx: RuleContext):
    src = ctx.arg("self")
    dims = ctx.args.get("dim")
    if ctx.dims(dims, ctx.ndim(src)) & set(ctx.seq_dims(src)):
        ctx.out_partial = True
    return None


# ---------------------------------------------------------------------------------------------
# Contractions, norms, losses


def _contract(ctx: RuleContext, a, a_dim, b, b_dim):
    for t, d in ((a, a_dim), (b, b_dim)):
        if isinstance(t, torch.fx.Node) and (d % max(ctx.ndim(t), 1)) in ctx.seq_dims(t):
            ctx.refuse(
                "it contracts over the sequence axis (a hand-written attention or a sequence-mixing matmul); "
                "each rank holds only its own positions",
                "use torch.nn.functional.scaled_dot_product_attention, whose K/V cp_passes gathers, or register "
                "a rule for this contraction",
            )
    return None


@register_rule(aten.linear)
def _linear(ctx):
    return _contract(ctx, ctx.arg("input"), -1, ctx.arg("weight"), -1)


@register_rule(aten.matmul, aten.mm, aten.bmm)
def _matmul(ctx):
    other = ctx.arg("other") if "other" in ctx.args else ctx.arg("mat2")
    return _contract(ctx, ctx.arg("self"), -1, other, -2 if ctx.ndim(other) > 1 else 0)


@register_rule(aten.addmm, aten.baddbmm, aten.addbmm)
def _addmm(ctx):
    if ctx.is_seq(ctx.arg("self")) and not (ctx.is_seq(ctx.arg("mat1" if "mat1" in ctx.args else "batch1"))):
        ctx.refuse("its bias term is sharded along the sequence but the product is not", _NO_RULE_FIX)
    a = ctx.arg("mat1") if "mat1" in ctx.args else ctx.arg("batch1")
    b = ctx.arg("mat2") if "mat2" in ctx.args else ctx.arg("batch2")
    return _contract(ctx, a, -1, b, -2)


@register_rule(aten.einsum)
def _einsum(ctx: RuleContext):
    equation = ctx.arg("equation").replace(" ", "")
    lhs, _, out = equation.partition("->")
    for t, letters in zip(ctx.arg("tensors"), lhs.split(",")):
        for d in ctx.seq_dims(t):
            if "..." in letters or letters[d] not in out:
                ctx.refuse("it contracts over the sequence axis", _NO_RULE_FIX)
    return None


@register_rule(aten.layer_norm, aten.native_layer_norm, aten.rms_norm, aten._fused_rms_norm)
def _norm(ctx: RuleContext):
    src = ctx.arg("input")
    n = len(ctx.arg("normalized_shape"))
    ctx.require_not_along_sequence(src, list(range(ctx.ndim(src) - n, ctx.ndim(src))), "normalizes over")
    return None


@register_rule(aten.group_norm, aten.batch_norm, aten.instance_norm, aten.native_batch_norm, aten.native_group_norm)
def _spatial_norm(ctx: RuleContext):
    if ctx.seq_inputs():
        ctx.refuse("it normalizes over spatial dims, which include the sequence axis", _NO_RULE_FIX)
    return None


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
        ctx.out_partial = True
    elif reduction == 1:
        from .rewrites import global_mean_rewrite

        if ctx.args.get("weight") is not None:
            ctx.refuse(
                "it averages over the sequence with class weights; the global weighted mean has no rule yet",
                "use reduction='sum' and divide by the global sum of weights outside the compiled module",
            )
        ctx.out_partial = True
        return global_mean_rewrite(ctx)
    return None


# ---------------------------------------------------------------------------------------------
# Ops refused outright when they touch the sequence axis


@register_rule(aten.constant_pad_nd, aten.pad, aten.reflection_pad1d, aten.replication_pad1d)
def _pad(ctx: RuleContext):
    from .rewrites import conv_for_pad

    if conv_for_pad(ctx.node, ctx.sym) is not None:
        return None  # the left pad of a causal convolution: the conv rule replaces it with a halo
    src = ctx.arg("self")
    pad = list(ctx.arg("pad") if "pad" in ctx.args else ctx.arg("padding"))
    nd = ctx.ndim(src)
    for i in range(len(pad) // 2):
        d = nd - 1 - i
        if d in ctx.seq_dims(src) and (pad[2 * i] != 0 or pad[2 * i + 1] != 0):
            ctx.refuse(
                f"it pads the sequence axis (dim {d}) by {pad[2 * i:2 * i + 2]}; on a shard the padding lands at "
                f"the shard's edge instead of the sequence's",
                "pass labels shifted before sharding (Hugging Face: shift_labels=); a causal convolution's left "
                "pad is handled when the pad feeds conv1d directly",
            )
    return None


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
               aten.take, aten.masked_scatter, aten._local_scalar_dense, aten.item, aten.embedding_bag)
def _data_dependent(ctx: RuleContext):
    # Looking positions up in a table (table[position_ids]) is fine; indexing the sharded tensor is not.
    if ctx.is_seq(ctx.args.get("self", ctx.args.get("weight"))):
        ctx.refuse("it indexes with data-dependent positions or reads a sharded value", _NO_RULE_FIX)
    return None

