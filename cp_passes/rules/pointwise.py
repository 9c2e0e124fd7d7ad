"""Ops that never mix sequence positions."""

from __future__ import annotations

import torch
import torch.fx

from ..functions import function_op  # noqa: F401  (registers cp_passes::function)
from ..functions import split_error
from ..graph.analysis import expr_of, hint, meta_val
from .registry import NO_RULE_FIX, RuleContext, positionwise, register_rule

aten = torch.ops.aten



@register_rule(torch.ops.cp_passes.function.default)
def _declared_function(ctx: RuleContext):
    """A Function the spec declares position-wise (:mod:`cp_passes.functions`): nothing moves."""
    name = ctx.node.args[0]
    if name not in ctx.spec.positionwise_functions:
        ctx.refuse(f"it runs the autograd.Function {name}, which this spec does not declare position-wise (another "
                   f"cp_compile in this process did)", f"declare it in this spec too: "
                   f"CPSpec(positionwise_functions=({name!r},))")
    _check_positionwise(ctx, name)
    return None


def _check_positionwise(ctx: RuleContext, name: str) -> None:
    """Refuse a declared Function that is not position-wise (a cumsum with its own backward): run on random inputs
    cut in two along the sequence, its outputs and gradients must be the whole's. Checked where every sequence
    input and the output hold the sequence on one dim of the local length itself."""
    args = ctx.node.args[1]
    dims = []
    for arg in args:
        seq = ctx.seq_dims(arg) if isinstance(arg, torch.fx.Node) else ()
        if len(seq) > 1 or (seq and expr_of(meta_val(arg).shape[seq[0]]) != ctx.sym):
            return
        dims.append(seq[0] if seq else None)
    out = ctx.seq_dims(ctx.node)
    if len(out) != 1 or expr_of(meta_val(ctx.node).shape[out[0]]) != ctx.sym or all(d is None for d in dims):
        return
    length = 16
    inputs = [([length if i == d else hint(size) for i, size in enumerate(meta_val(a).shape)], meta_val(a).dtype)
              for a, d in zip(args, dims)]
    error = split_error(name, inputs, dims, out[0])
    tolerance = 1e-3 if all(dtype in (torch.float32, torch.float64) or not dtype.is_floating_point
                            for _, dtype in inputs) else 3e-2
    if error is not None and error > tolerance:
        ctx.refuse(f"it runs the autograd.Function {name}, which the spec declares position-wise, but on random inputs "
                   f"cut in two along the sequence its output or gradients differ from the whole's by {error:.2g} of "
                   f"their largest value: it mixes positions",
                   f"remove {name!r} from CPSpec.positionwise_functions and write the op with torch ops (or as a "
                   f"custom op with a rule), or keep it outside the compiled module")


positionwise(
    aten.log_sigmoid,
    aten.log_sigmoid_forward,
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
    aten.floor_divide,
    aten.polar,
    aten.complex,
)


@register_rule(aten.embedding)
def _embedding(ctx: RuleContext):
    if ctx.is_seq(ctx.arg("weight")):
        ctx.refuse("the embedding table itself is sharded along the sequence", NO_RULE_FIX)
    return None


@register_rule(aten.one_hot)
def _one_hot(ctx: RuleContext):
    """``F.one_hot(x, num_classes)`` (a router's expert mask) reads each element alone; without ``num_classes``
    the class count is the largest value, which a shard sees only for its own rows."""
    if ctx.args.get("num_classes", -1) < 0:
        ctx.refuse("it takes F.one_hot without num_classes: the number of classes is counted from the largest value "
                   "in this rank's rows, not the sequence's", "pass num_classes= (the router's number of experts)")
    return None
