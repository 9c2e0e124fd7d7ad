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
from .analysis import bind_args, expr_of, meta_val, numel_hint, seq_dims, seq_multiple
from .errors import module_path
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


PROBE_MAX_LEN = 4100
"""Longest single-device sequence at which a model-built attention mask is evaluated to read its window
(just over 4096, so that power-of-two windows up to 4096 show as bands). Wider windows are declared in the
spec and checked for consistency up to this length."""


def _run_positional_subgraph(ctx: RuleContext, out: torch.fx.Node, length: int) -> torch.Tensor:
    """Evaluate the subgraph producing ``out`` as the single-device model would at sequence ``length``.

    Only shape arithmetic, constants and ops on them may feed it: a mask that reads data (token ids,
    document ids, padding masks) is not a pure function of positions and is refused.
    """
    env: dict[torch.fx.Node, object] = {}
    order: list[torch.fx.Node] = []
    stack, seen = [out], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        order.append(n)
        if not isinstance(meta_val(n), (torch.SymInt, torch.SymFloat, int, float)):
            stack.extend(n.all_input_nodes)
    position = {n: i for i, n in enumerate(ctx.node.graph.nodes)}
    for n in sorted(order, key=position.__getitem__):
        val = meta_val(n)
        if isinstance(val, (torch.SymInt, torch.SymFloat)):
            value = val.node.expr.subs(ctx.sym, length)
            env[n] = int(value) if isinstance(val, torch.SymInt) else float(value)
        elif isinstance(val, (int, float)):
            env[n] = val
        elif n.op == "get_attr":
            env[n] = getattr(n.graph.owning_module, n.target)
        elif n.op == "call_function":
            args, kwargs = torch.fx.map_arg((n.args, n.kwargs), env.__getitem__)
            env[n] = n.target(*args, **kwargs)
        else:
            ctx.refuse(
                f"its attention mask reads {n.op} '{n.name}' (data, not positions); masks built from data "
                f"(document ids, padding) need the packed-documents transport",
                "pass is_causal=True, or a mask built only from positions (arange comparisons)",
            )
    return env[out]


@dataclass
class DataMask:
    """An attention mask built from sequence-sharded data (doc ids, position ids) as well as positions.

    It is evaluated over the whole sequence from gathered metadata, exactly as the single device does,
    and each rank keeps its rows; the ops that only build it are claimed by the attention rule."""

    nodes: list[torch.fx.Node]
    tensor_leaves: list[torch.fx.Node]
    size_leaves: list[torch.fx.Node]


def data_mask(mask: torch.fx.Node, sym) -> DataMask | str | None:
    """The subgraph behind ``mask`` if it reads sequence data; ``None`` for a mask of positions only; a
    reason string when it reads something that cannot be gathered as metadata."""
    nodes, tensor_leaves, size_leaves, seen, stack = [], [], [], set(), [mask]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        val = meta_val(n)
        if isinstance(val, (torch.SymInt, torch.SymFloat)):
            if sym in val.node.expr.free_symbols:
                if seq_multiple(val, sym) is None:
                    return f"its mask uses the length expression {val}, which cp_passes cannot rescale"
                size_leaves.append(n)
            else:
                nodes.append(n)
                stack.extend(n.all_input_nodes)
        elif n.op == "placeholder":
            if not isinstance(val, torch.Tensor) or not seq_dims(n, sym) or val.is_floating_point() or val.requires_grad:
                return (f"its mask reads input '{n.name}' {tuple(getattr(val, 'shape', ()))}, which is not integer "
                        f"sequence metadata (doc ids, positions)")
            tensor_leaves.append(n)
        elif n.op in ("call_function", "get_attr"):
            if isinstance(val, torch.Tensor) and val.requires_grad:
                return f"its mask depends on '{n.name}', a value with gradients (activations are not metadata)"
            nodes.append(n)
            stack.extend(n.all_input_nodes)
        else:
            return f"its mask reads {n.op} '{n.name}'"
    if not tensor_leaves:
        return None
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    nodes.sort(key=order.__getitem__)
    return DataMask(nodes, sorted(tensor_leaves, key=order.__getitem__), sorted(size_leaves, key=order.__getitem__))


def _mask_module(gm: torch.fx.GraphModule, dm: DataMask, mask: torch.fx.Node) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    env = {leaf: graph.placeholder(leaf.name) for leaf in dm.tensor_leaves + dm.size_leaves}
    for n in dm.nodes:
        env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(env[mask])
    return torch.fx.GraphModule(gm, graph)


def _allowed(mask: torch.Tensor, ctx: RuleContext) -> torch.Tensor:
    if mask.dtype != torch.bool:
        if not bool(((mask == 0) | (mask == float("-inf")) | (mask <= torch.finfo(mask.dtype).min)).all()):
            ctx.refuse("its attention mask adds a bias (not only 0 / -inf)", "use a boolean or 0/-inf mask")
        mask = mask == 0
    flat = mask.reshape(-1, *mask.shape[-2:])
    if not bool((flat == flat[:1]).all()):
        ctx.refuse("its attention mask differs across batch or heads", "use one mask for every batch row and head")
    return flat[0]


def read_window(ctx: RuleContext, mask: torch.fx.Node, global_len: int, declared: int | None) -> int | None:
    """The window ``w`` of a model-built band mask (key ``j`` visible to query ``i`` iff ``0 <= i - j < w``),
    or ``None`` when it is plain causal up to the length cp_passes checked. Anything else is refused."""
    lengths = sorted({min(global_len, PROBE_MAX_LEN), max(2, min(global_len, PROBE_MAX_LEN) // 2 + 1)}, reverse=True)
    window = None
    for length in lengths:
        allowed = _allowed(_run_positional_subgraph(ctx, mask, length), ctx)
        if tuple(allowed.shape) != (length, length):
            ctx.refuse(f"its attention mask has shape {tuple(allowed.shape)} at sequence length {length}",
                       "build the mask as [.., seq, seq]")
        seen = int(allowed[-1].sum())
        width = window if window is not None else (seen if seen < length else None)
        band = torch.ones(length, length, dtype=torch.bool).tril()
        if width is not None:
            band &= ~torch.ones(length, length, dtype=torch.bool).tril(-width)
        if not torch.equal(allowed, band):
            ctx.refuse(
                f"its attention mask is neither causal nor a causal sliding window (checked at sequence length "
                f"{length})",
                "use is_causal=True or a band mask (0 <= i - j < window); register a rule for other masks",
            )
        window = width
    if window is None and declared is not None and declared >= lengths[0]:
        return declared  # a band wider than what was evaluated: the spec says how wide, the mask agrees so far
    if window is None and global_len > lengths[0]:
        ctx.refuse(
            f"its attention mask is causal up to {lengths[0]} positions, the longest cp_passes evaluates; a "
            f"window wider than that cannot be told from causal",
            "declare the window in the spec (AttentionRule) if there is one, or use is_causal=True",
        )
    if window is None:
        bool(ctx.length * ctx.world <= lengths[0])  # a guard: longer sequences recompile and re-check
    return window


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
    for name, t in (("query", q), ("key", k), ("value", v)):
        nd = ctx.ndim(t)
        if ctx.seq_dims(t) != (nd - 2,) or seq_multiple(meta_val(t).shape[nd - 2], ctx.sym) != 1:
            ctx.refuse(
                f"its {name} {tuple(meta_val(t).shape)} does not carry the sequence (length {ctx.sym}) on dim -2",
                "lay attention inputs out as [batch, heads, seq, head_dim]",
            )

    window = None
    declared = ctx.spec.attention_for(module_path(ctx.node))
    dm = data_mask(mask, ctx.sym) if mask is not None else None
    if isinstance(dm, str):
        ctx.refuse(dm + "; masks are evaluated from positions and gathered metadata only",
                   "build the mask from position ids or document ids passed as inputs (cp_passes.shard_batch makes "
                   "doc_ids), or pass is_causal=True")
    if dm is not None:
        # The envelope (causal, or the declared window) plans the transport; the model's own mask, evaluated
        # from gathered metadata, is checked against it at run time.
        if meta_val(mask).dtype != torch.bool:
            ctx.refuse("its mask reads data and is not boolean", "build a boolean mask (True = attend)")
        window, causal = (declared.window if declared else None), True
    elif mask is not None:
        window = read_window(ctx, mask, ctx.local_len() * ctx.world, declared.window if declared else None)
        causal = True
        found = f"a band mask of window {window}" if window else "a causal mask"
    else:
        found = "is_causal=True (no window)" if causal else "full attention (no mask, not causal)"
    if dm is None and declared is not None and (declared.window != window or not causal):
        said = f"window {declared.window}" if declared.window else "causal attention"
        ctx.refuse(
            f"the spec declares {said} for modules '{declared.modules}', but the model computes {found}; "
            f"training would not match the single-device model",
            "make the spec's AttentionRule agree with the model (or fix the model's mask)",
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
    local_len = ctx.local_len()
    halo = bool(window) and ctx.spec.window_transport == "halo"
    rule = "sdpa_data_mask" if dm else "sdpa_window" if window else ("sdpa_causal" if causal else "sdpa_full")
    node = ctx.node
    dropout_p, scale = ctx.arg("dropout_p"), ctx.arg("scale")
    leaf_dims = [seq_dims(leaf, ctx.sym)[0] for leaf in dm.tensor_leaves] if dm else []

    def apply(gm: torch.fx.GraphModule, pass_name: str):
        g = gm.graph

        def make(target, args, name, kwargs=None):
            return insert_node(g, node, target, args, kwargs, name=name, origin=node, pass_name=pass_name, rule=rule)

        def transport(x, name):
            if halo:
                return make(transports.halo_exchange, (x, dim, window - 1, rank, world, group), f"{name}_halo")
            return make(transports.sequence_all_gather, (x, dim, group), f"{name}_gathered")

        if together:
            dk = meta_val(k_src).shape[-1]
            moved = transport(make(aten.cat.default, ([k_src, v_src], -1), "cp_kv"), "cp_kv")
            parts = make(aten.split_with_sizes.default, (moved, [dk, meta_val(v_src).shape[-1]], -1), "cp_kv_split")
            keys = make(operator.getitem, (parts, 0), "cp_k")
            values = make(operator.getitem, (parts, 1), "cp_v")
        else:
            keys, values = transport(k_src, "cp_k"), transport(v_src, "cp_v")
        mask_node = None
        if dm:
            mask_node = make(transports.mask_block_for_keys, (_global_mask(gm, make, node, dm, mask, leaf_dims, world,
                                                                           group), q, rank, window, halo), "cp_mask_block")
        elif halo:
            mask_node = make(transports.window_mask_with_halo, (q, window, rank), "cp_window_mask")
        if causal and not halo:
            keys = make(transports.causal_key_prefix, (keys, dim, rank, q), "cp_k_visible")
            values = make(transports.causal_key_prefix, (values, dim, rank, q), "cp_v_visible")
            if mask_node is None and (rank > 0 or window):
                mask_node = make(transports.causal_mask_at_offset, (q, rank, window), "cp_causal_mask")
        # Rank 0 of a causal attention sees only its own keys: plain causal attention, no mask.
        node.args = (q, keys, values, mask_node, dropout_p)
        node.kwargs = {"is_causal": mask_node is None and causal, "scale": scale, "enable_gqa": gqa}
        node.meta["cp_pass"], node.meta["cp_rule"] = pass_name, rule

    notes = ["K/V moved before the head repeat (enable_gqa)"] if k_src is not k else []
    kv = "K+V" if together else "K, V"
    if halo:
        send, recv, _ = transports.halo_counts(window - 1, local_len, rank, world)  # what the transport moves
        row_bytes = elements // local_len * itemsize
        moved = Rewrite(rule=rule, transport="halo", apply=apply,
                        collective=f"all_to_all {window - 1} rows of {kv} | bw all_to_all",
                        elements=sum(recv) * elements // local_len, bytes=sum(recv) * row_bytes,
                        lower_bound_bytes=min(window - 1, rank * local_len) * row_bytes, sent_bytes=sum(send) * row_bytes)
    else:
        needed = (rank if causal else world - 1) * elements * itemsize
        if window:
            needed = min(window - 1, rank * local_len) * elements // local_len * itemsize
            notes.append("the spec asks for a gather")
        moved = Rewrite(rule=rule, transport="sequence_gather", apply=apply,
                        collective=f"all_gather {kv} | bw reduce_scatter", elements=(world - 1) * elements,
                        bytes=(world - 1) * elements * itemsize, lower_bound_bytes=needed,
                        sent_bytes=(world - 1) * elements * itemsize)
    if dm:
        names = ", ".join(leaf.name for leaf in dm.tensor_leaves)
        meta_bytes = sum(numel_hint(leaf) * meta_val(leaf).dtype.itemsize for leaf in dm.tensor_leaves) * (world - 1)
        moved.collective += f" + all_gather {names} (no grad)"
        for field_name in ("bytes", "lower_bound_bytes", "sent_bytes"):
            setattr(moved, field_name, getattr(moved, field_name) + meta_bytes)
        notes.append(f"the model's mask from {names}, evaluated over the whole sequence; "
                     + (f"window {window} (spec)" if window else "causal envelope, checked at run time"))
    elif window:
        notes.append(f"window {window} read from the model's mask")
    moved.note = "; ".join(notes)
    return moved


def _global_mask(gm: torch.fx.GraphModule, make, node: torch.fx.Node, dm: DataMask, mask: torch.fx.Node,
                 leaf_dims: list[int], world: int, group: str) -> torch.fx.Node:
    """The model's mask over the whole sequence: its subgraph as a submodule, fed gathered metadata and
    global lengths."""
    leaves = [make(transports.metadata_all_gather, (leaf, d, group), f"cp_{leaf.name}_gathered")
              for leaf, d in zip(dm.tensor_leaves, leaf_dims)]
    leaves += [make(operator.mul, (leaf, world), f"cp_{leaf.name}_global") for leaf in dm.size_leaves]
    name = f"cp_mask_fn_{node.name}"
    gm.add_submodule(name, _mask_module(gm, dm, mask))
    with gm.graph.inserting_before(node):
        global_mask = gm.graph.call_module(name, tuple(leaves))
    made = leaves[0].meta  # created by ``make``: it knows the pass, the rule and the source
    global_mask.meta.update({key: made[key] for key in ("cp_pass", "cp_rule", "stack_trace") if key in made})
    return global_mask


# ---------------------------------------------------------------------------------------------
# Causal convolutions along the sequence: a halo of (k - 1) * dilation rows replaces the left pad.


@dataclass
class CausalConv:
    """``conv(pad(x, (halo, 0)))`` or ``conv(x, padding=halo)[..., :seq]``: output t reads x[t - halo .. t]."""

    conv: torch.fx.Node
    source: torch.fx.Node
    halo: int
    form: str
    pad: torch.fx.Node | None = None
    slice: torch.fx.Node | None = None


_CONVS = (aten.conv1d.default, aten.convolution.default)


def match_causal_conv(conv: torch.fx.Node, sym) -> CausalConv | str:
    """The causal form of a 1-D convolution over [batch, channels, seq], or why it is not one."""
    if conv.target not in _CONVS:
        return f"{conv.target} is not a 1-D convolution cp_passes reads"
    args = bind_args(conv)
    x, weight = args["input"], args["weight"]
    if args.get("transposed"):
        return "it is a transposed convolution"
    padded = isinstance(x, torch.fx.Node) and x.target in (aten.constant_pad_nd.default, aten.pad.default)
    src = bind_args(x)["self"] if padded else x
    if meta_val(src).dim() != 3 or seq_dims(src, sym) != (2,) or seq_multiple(meta_val(src).shape[2], sym) != 1:
        return f"its input {tuple(meta_val(src).shape)} is not [batch, channels, seq] with the sequence last"
    kernel = meta_val(weight).shape[-1]
    stride, padding, dilation = list(args["stride"]), args["padding"], list(args["dilation"])
    if isinstance(padding, str) or stride != [1]:
        return f"stride {stride}, padding {padding!r}: only stride 1 with numeric padding has a causal form"
    halo = (kernel - 1) * dilation[0]
    padding = list(padding)
    found = f"kernel {kernel}, dilation {dilation[0]}, padding {padding}"
    if padding == [0] and padded:
        pad_args = bind_args(x)
        pad = list(pad_args["pad"])
        value = pad_args.get("value") or 0
        if pad_args.get("mode", "constant") != "constant" or value != 0 or len(x.users) != 1:
            return f"{found}, input padded with mode {pad_args.get('mode')!r} value {value}"
        if pad == [halo, 0]:
            return CausalConv(conv, pad_args["self"], halo, "pad", pad=x)
        return f"{found}, input padded by {pad} along the sequence; causal needs [{halo}, 0]"
    if padding == [halo] and len(conv.users) == 1:
        (user,) = conv.users
        if user.target is aten.slice.Tensor:
            sl = bind_args(user)
            same_len = expr_of(meta_val(user).shape[2]) == expr_of(meta_val(x).shape[2])
            if sl["dim"] % 3 == 2 and sl["start"] in (None, 0) and sl["step"] == 1 and same_len:
                return CausalConv(conv, x, halo, "slice", slice=user)
    return f"{found}: neither pad(x, ({halo}, 0)) then conv, nor conv(padding={halo})[..., :seq]"


def conv_for_pad(pad: torch.fx.Node, sym) -> CausalConv | None:
    if len(pad.users) == 1:
        (user,) = pad.users
        match = match_causal_conv(user, sym) if user.target in _CONVS else None
        if isinstance(match, CausalConv) and match.pad is pad:
            return match
    return None


def conv_for_slice(sl: torch.fx.Node, sym) -> CausalConv | None:
    src = sl.args[0]
    if isinstance(src, torch.fx.Node) and src.target in _CONVS:
        match = match_causal_conv(src, sym)
        if isinstance(match, CausalConv) and match.slice is sl:
            return match
    return None


@register_rule(aten.conv1d, aten.convolution, aten.conv2d, aten.conv3d, aten._convolution,
               aten.conv_transpose1d, aten.conv_transpose2d)
def conv_rule(ctx: RuleContext):
    if not ctx.is_seq(ctx.arg("input")):
        return None
    match = match_causal_conv(ctx.node, ctx.sym)
    module = module_path(ctx.node)
    declared = ctx.spec.conv_declared(module)
    if not isinstance(match, CausalConv):
        said = (f"the spec declares modules '{declared}' causal, but the graph shows {match}" if declared
                else f"it convolves along the sequence and is not causal in a form cp_passes reads ({match})")
        ctx.refuse(
            said,
            "write the causal convolution as F.pad(x, ((k-1)*dilation, 0)) then conv1d(padding=0), or "
            "conv1d(padding=(k-1)*dilation)[..., :seq]; a non-causal convolution needs both neighbours (not "
            "supported)",
        )
    rank, world, group, node = ctx.rank, ctx.world, ctx.group_name, ctx.node
    rule = f"causal_conv_{match.form}"

    def apply(gm: torch.fx.GraphModule, pass_name: str):
        before = match.pad if match.form == "pad" else node
        halo = insert_node(gm.graph, before, transports.halo_exchange,
                           (match.source, 2, match.halo, rank, world, group), name="cp_conv_halo", origin=node,
                           pass_name=pass_name, rule=rule)
        if match.form == "pad":
            match.pad.replace_all_uses_with(halo)
        else:
            args = bind_args(node)
            args["input"], args["padding"] = halo, [0]
            node.args, node.kwargs = (), args
            match.slice.replace_all_uses_with(node)
        node.meta["cp_pass"], node.meta["cp_rule"] = pass_name, rule

    local_len = ctx.local_len()
    send, recv, _ = transports.halo_counts(match.halo, local_len, rank, world)  # what the transport moves
    row_bytes = numel_hint(match.source) // local_len * meta_val(match.source).dtype.itemsize
    return Rewrite(rule=rule, transport="halo", apply=apply, collective=f"all_to_all {match.halo} rows | bw all_to_all",
                   elements=sum(recv) * row_bytes // meta_val(match.source).dtype.itemsize, bytes=sum(recv) * row_bytes,
                   lower_bound_bytes=min(match.halo, rank * local_len) * row_bytes, sent_bytes=sum(send) * row_bytes,
                   note=f"halo (k-1)*dilation = {match.halo}" + (f"; declared by '{declared}'" if declared else
                                                                 "; causal form read from the graph"))


# ---------------------------------------------------------------------------------------------
# A mean over the sequence (a loss with reduction="mean"): this rank's sum over the global count.


def global_mean_rewrite(ctx: RuleContext) -> Rewrite:
    """``loss(reduction=mean)`` -> ``loss(reduction=sum) / global_count``: a per-rank partial sum whose ranks
    add up to the single-device mean, so summed gradients match too."""
    node, group = ctx.node, ctx.group_name
    target_name = "target" if "target" in ctx.args else "other"
    ignore_index = ctx.args.get("ignore_index")

    def apply(gm: torch.fx.GraphModule, pass_name: str):
        args = bind_args(node)
        args["reduction"] = 2
        node.args, node.kwargs = (), args
        users = list(node.users)
        count = insert_node(gm.graph, node.next, transports.global_count, (args[target_name], ignore_index, group),
                            name="cp_global_count", origin=node, pass_name=pass_name, rule="global_mean")
        mean = insert_node(gm.graph, count.next, aten.div.Tensor, (node, count), name="cp_global_mean",
                           origin=node, pass_name=pass_name, rule="global_mean")
        for user in users:
            user.replace_input_with(node, mean)
        node.meta["cp_pass"], node.meta["cp_rule"] = pass_name, "global_mean"

    counted = "targets != ignore_index" if ignore_index is not None else "elements"
    return Rewrite(rule="global_mean", transport="reductions", apply=apply,
                   collective="all_reduce of one count (no autograd)", elements=1, bytes=8 * (ctx.world - 1),
                   lower_bound_bytes=8 * (ctx.world - 1), sent_bytes=8 * (ctx.world - 1),
                   note=f"mean -> this rank's sum / global count of {counted}; ranks add up to the global mean")


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
