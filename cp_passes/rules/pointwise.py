"""Ops that never mix sequence positions."""

from __future__ import annotations

import torch
import torch.fx

from ..functions import function_op  # noqa: F401  (registers cp_passes::function)
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
    return None


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
