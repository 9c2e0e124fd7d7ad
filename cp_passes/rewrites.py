"""Rules that rewrite the graph: attention K/V gathers and sequence positions.

Each rule finds its pattern into a small match, computes what the transport moves, and returns a
:class:`~cp_passes.rules.Rewrite` whose ``apply`` edits the graph in the pass for its transport.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx

from . import transports
from .analysis import expr_of, meta_val, numel_hint, seq_multiple
from .rules import Rewrite, RuleContext, register_rule

aten = torch.ops.aten


def insert_node(graph: torch.fx.Graph, before: torch.fx.Node, target, args, kwargs=None, *, name: str,
                origin: torch.fx.Node, pass_name: str, rule: str) -> torch.fx.Node:
    """Create a node before ``before`` that records which pass and rule made it, for ``origin``."""
    with graph.inserting_before(before):
        node = graph.create_node("call_function", target, tuple(args), kwargs or {}, name=name)
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in origin.meta:
            node.meta[key] = origin.meta[key]
    node.meta["cp_pass"] = pass_name
    node.meta["cp_rule"] = rule
    return node


# ---------------------------------------------------------------------------------------------
# K/V head repetition: gather before it, let SDPA's enable_gqa repeat after the gather.


@dataclass
class HeadRepeat:
    """``expanded = repeat_interleave(small, n_rep, dim=-3)``, however the model spelled it."""

    small: torch.fx.Node
    n_rep: int


def _same(a, b) -> bool:
    return expr_of(a) == expr_of(b)


def match_head_repeat(node: torch.fx.Node) -> HeadRepeat | None:
    """Match ``repeat_interleave(x, n, dim=1)`` or ``x[:, :, None].expand(...).reshape(...)`` on [B, H, S, D]."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    if node.target is aten.repeat_interleave.self_int:
        x, reps = node.args[0], node.args[1]
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        if isinstance(reps, int) and dim is not None and meta_val(x).dim() == 4 and dim % 4 == 1:
            return HeadRepeat(x, reps)
        return None
    if node.target not in (aten.reshape.default, aten.view.default, aten._unsafe_view.default):
        return None
    cur = node.args[0]
    while isinstance(cur, torch.fx.Node) and cur.target in (aten.clone.default, aten.contiguous.default):
        cur = cur.args[0]
    if not (isinstance(cur, torch.fx.Node) and cur.target is aten.expand.default):
        return None
    expanded = cur
    unsq = expanded.args[0]
    if not (isinstance(unsq, torch.fx.Node) and unsq.target is aten.unsqueeze.default and unsq.args[1] % 5 == 2):
        return None
    x = unsq.args[0]
    xs, es, out = meta_val(x).shape, meta_val(expanded).shape, meta_val(node).shape
    if len(xs) != 4 or len(es) != 5 or len(out) != 4 or not isinstance(es[2], int):
        return None
    n_rep = es[2]
    if not (_same(es[0], xs[0]) and _same(es[1], xs[1]) and _same(es[3], xs[2]) and _same(es[4], xs[3])):
        return None
    if not (_same(out[0], xs[0]) and _same(out[2], xs[2]) and _same(out[3], xs[3]) and _same(out[1], xs[1] * n_rep)):
        return None
    return HeadRepeat(x, n_rep)


# ---------------------------------------------------------------------------------------------
# scaled_dot_product_attention: gather K/V along the sequence, mask causally at the rank's offset.


@register_rule(aten.scaled_dot_product_attention)
def sdpa_rule(ctx: RuleContext):
    q, k, v = ctx.arg("query"), ctx.arg("key"), ctx.arg("value")
    mask, causal = ctx.arg("attn_mask"), bool(ctx.arg("is_causal"))
    if not ctx.is_seq(k) and not ctx.is_seq(v):
        return None  # attending to memory that is not sharded: nothing to move
    if not ctx.is_seq(q):
        ctx.refuse(
            "its keys are sharded along the sequence but its queries are not",
            "register a rule for this attention (e.g. pooling queries over the sequence), or run it outside "
            "the compiled module",
        )
    if mask is not None:
        ctx.refuse(
            "it takes an attention mask built by the model over the sequence; a mask made on a shard "
            "covers only local keys",
            "pass is_causal=True instead of a causal mask; window and document masks are planned with the "
            "halo and packed-document transports",
        )
    for name, t in (("query", q), ("key", k), ("value", v)):
        nd = ctx.ndim(t)
        if ctx.seq_dims(t) != (nd - 2,) or seq_multiple(meta_val(t).shape[nd - 2], ctx.sym) != 1:
            ctx.refuse(
                f"its {name} {tuple(meta_val(t).shape)} does not carry the sequence (length {ctx.sym}) on dim -2",
                "lay attention inputs out as [batch, heads, seq, head_dim]",
            )

    gqa = bool(ctx.arg("enable_gqa"))
    k_src, v_src = k, v
    kr, vr = match_head_repeat(k), match_head_repeat(v)
    if kr and vr and kr.n_rep == vr.n_rep and not gqa and _same(meta_val(kr.small).shape[1], meta_val(vr.small).shape[1]):
        k_src, v_src, gqa = kr.small, vr.small, True

    world, rank, group = ctx.world, ctx.rank, ctx.group_name
    dim = ctx.ndim(k_src) - 2
    together = (
        ctx.spec.gather_kv_together
        and meta_val(k_src).dtype == meta_val(v_src).dtype
        and all(_same(a, b) for a, b in zip(meta_val(k_src).shape[:-1], meta_val(v_src).shape[:-1]))
    )
    elements = numel_hint(k_src) + numel_hint(v_src)
    itemsize = meta_val(k_src).dtype.itemsize
    rule = "sdpa_causal" if causal else "sdpa_full"
    node = ctx.node
    dropout_p, scale = ctx.arg("dropout_p"), ctx.arg("scale")

    def apply(gm: torch.fx.GraphModule, pass_name: str):
        g = gm.graph

        def make(target, args, name, kwargs=None):
            return insert_node(g, node, target, args, kwargs, name=name, origin=node, pass_name=pass_name, rule=rule)

        if together:
            dk = meta_val(k_src).shape[-1]
            kv = make(aten.cat.default, ([k_src, v_src], -1), "cp_kv")
            kv_all = make(transports.sequence_all_gather, (kv, dim, group), "cp_kv_gathered")
            parts = make(aten.split_with_sizes.default, (kv_all, [dk, meta_val(v_src).shape[-1]], -1), "cp_kv_split")
            keys = make(operator.getitem, (parts, 0), "cp_k_gathered")
            values = make(operator.getitem, (parts, 1), "cp_v_gathered")
        else:
            keys = make(transports.sequence_all_gather, (k_src, dim, group), "cp_k_gathered")
            values = make(transports.sequence_all_gather, (v_src, dim, group), "cp_v_gathered")
        mask_node = None
        if causal:
            keys = make(transports.causal_key_prefix, (keys, dim, rank, q), "cp_k_visible")
            values = make(transports.causal_key_prefix, (values, dim, rank, q), "cp_v_visible")
            if rank > 0:
                mask_node = make(transports.causal_mask_at_offset, (q, rank), "cp_causal_mask")
        # Rank 0 sees only its own keys: plain causal attention. Later ranks get an explicit mask.
        node.args = (q, keys, values, mask_node, dropout_p)
        node.kwargs = {"is_causal": causal and rank == 0, "scale": scale, "enable_gqa": gqa}
        node.meta["cp_pass"], node.meta["cp_rule"] = pass_name, rule

    received = (world - 1) * elements * itemsize
    needed = (rank if causal else world - 1) * elements * itemsize
    return Rewrite(
        rule=rule,
        transport="sequence_gather",
        apply=apply,
        collective=("all_gather K+V" if together else "all_gather K, all_gather V") + " | bw reduce_scatter",
        elements=(world - 1) * elements,
        bytes=received,
        lower_bound_bytes=needed,
        note=("gathered before the head repeat (enable_gqa)" if k_src is not k else ""),
    )


# ---------------------------------------------------------------------------------------------
# arange over the sequence: the local slice of global positions.


@register_rule(aten.arange)
def arange_rule(ctx: RuleContext):
    node = ctx.node
    if not ctx.is_seq(node):
        for value in ctx.args.values():
            if isinstance(value, torch.fx.Node) and ctx.sym in getattr(expr_of_value(value), "free_symbols", ()):
                ctx.refuse("it uses the local sequence length as a value", _LENGTH_FIX)
        return None
    start, step = ctx.args.get("start", 0), ctx.args.get("step", 1)
    end = ctx.args["end"]
    if start != 0 or step != 1 or seq_multiple(meta_val(node).shape[0], ctx.sym) != 1:
        ctx.refuse(
            f"it is an arange over the sequence with start={start}, step={step}, length {meta_val(node).shape[0]}; "
            f"only arange(seq_len) (positions 0..seq_len-1) has a rule",
            "build positions as torch.arange(seq_len) (cp_passes offsets it) or pass position_ids",
        )
    rank = ctx.rank

    def apply(gm: torch.fx.GraphModule, pass_name: str):
        g = gm.graph
        first = insert_node(g, node, operator.mul, (end, rank), name="cp_first_position", origin=node,
                            pass_name=pass_name, rule="arange_positions")
        stop = insert_node(g, node, operator.mul, (end, rank + 1), name="cp_stop_position", origin=node,
                           pass_name=pass_name, rule="arange_positions")
        kwargs = {k: v for k, v in node.kwargs.items() if k in ("dtype", "layout", "device", "pin_memory")}
        if "dtype" not in kwargs:
            kwargs["dtype"] = meta_val(node).dtype
        node.target = aten.arange.start
        node.args = (first, stop)
        node.kwargs = kwargs
        node.meta["cp_pass"], node.meta["cp_rule"] = pass_name, "arange_positions"

    return Rewrite(rule="arange_positions", transport="positions", apply=apply,
                   note=f"positions start at rank * local_len = {rank} * {ctx.local_len()}")


def expr_of_value(node: torch.fx.Node):
    val = meta_val(node)
    return val.node.expr if isinstance(val, (torch.SymInt, torch.SymFloat)) else None


_LENGTH_FIX = (
    "the local sequence length differs from the global one under CP; compute with shapes only, or pass the "
    "global value in as an input"
)
