"""Contractions and normalisations: never over the sequence axis."""

from __future__ import annotations

import torch
import torch.fx

from .registry import NO_RULE_FIX, RuleContext, register_rule

aten = torch.ops.aten


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
        ctx.refuse("its bias term is sharded along the sequence but the product is not", NO_RULE_FIX)
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
                ctx.refuse("it contracts over the sequence axis", NO_RULE_FIX)
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
        ctx.refuse("it normalizes over spatial dims, which include the sequence axis", NO_RULE_FIX)
    return None
