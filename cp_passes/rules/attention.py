"""Attention: which keys each local query needs, hence which transport brings K/V.

``scaled_dot_product_attention`` over sharded K/V is causal (``is_causal``, or a causal mask the model
builds), a causal sliding window (a band mask the model builds, or an ``AttentionRule`` in the spec),
bidirectional (an encoder's mask), a two-sided window (a bidirectional band, ``|i - j| <= w``), or full. A
window takes the halo transport (``spec.window_transport``; a two-sided one from both sides); the rest a
sequence gather.
Masks the model builds from metadata (doc ids) are evaluated at the rank's query rows and the keys brought
(over the whole sequence where a window or sizes that depend on data need it).
"""

from __future__ import annotations

import torch

from ..errors import module_path, source_line
from ..graph.analysis import INPUT_NAME, meta_val, seq_multiple
from ..match import MetadataMask, NotPositional, PositionMask, evaluate_position_mask, one_document, same_size
from ..transports.attention import AttentionKV, evaluated_locally
from ..transports.masks import band, band_sides
from .registry import Rewrite, RuleContext, register_rule

aten = torch.ops.aten

PROBE_MAX_LEN = 4100
"""Longest single-device sequence at which a model-built attention mask is evaluated to read its window
(just over 4096, so that power-of-two windows up to 4096 show as bands). Wider windows are declared in the
spec and checked for consistency up to this length."""


def _allowed(mask: torch.Tensor, ctx: RuleContext) -> torch.Tensor:
    if mask.dtype != torch.bool:
        if not bool(((mask == 0) | (mask == float("-inf")) | (mask <= torch.finfo(mask.dtype).min)).all()):
            ctx.refuse("its attention mask adds a bias (not only 0 / -inf)", "use a boolean or 0/-inf mask")
        mask = mask == 0
    flat = mask.reshape(-1, *mask.shape[-2:])
    if not bool((flat == flat[:1]).all()):
        ctx.refuse("its attention mask differs across batch or heads", "use one mask for every batch row and head")
    return flat[0]


def _evaluate(ctx: RuleContext, found: PositionMask, length: int) -> torch.Tensor:
    try:
        return evaluate_position_mask(found, ctx.sym, length)
    except NotPositional as error:
        (n,) = error.args
        ctx.refuse(
            f"its attention mask reads {n.op} '{n.name}' (data, not positions); masks built from data "
            f"(document ids, padding) need the packed-documents transport",
            "pass is_causal=True, or a mask built only from positions (arange comparisons)",
        )


def read_window(ctx: RuleContext, found: PositionMask, global_len: int, declared: int | None) -> int | None:
    """The window ``w`` of a model-built band mask (key ``j`` visible to query ``i`` iff ``0 <= i - j < w``),
    or ``None`` when it is plain causal up to the length cp_passes checked. Anything else is refused."""
    lengths = sorted({min(global_len, PROBE_MAX_LEN), max(2, min(global_len, PROBE_MAX_LEN) // 2 + 1)}, reverse=True)
    window = None
    for length in lengths:
        allowed = _allowed(_evaluate(ctx, found, length), ctx)
        if tuple(allowed.shape) != (length, length):
            ctx.refuse(f"its attention mask has shape {tuple(allowed.shape)} at sequence length {length}",
                       "build the mask as [.., seq, seq]")
        sides = band_sides(allowed)
        seen = 0 if sides is None else sides[0] + 1
        width = window if window is not None else (seen if seen < length else None)
        if not torch.equal(allowed, band(length, width)):
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
        bool(ctx.layout.global_len(ctx.length) <= lengths[0])  # a guard: longer sequences recompile and re-check
    return window


def _one_document(ctx: RuleContext, found: MetadataMask, length: int, padding: bool = False) -> torch.Tensor | None:
    """``[length, length]``: the mask of a model-built metadata mask for one unpadded document of ``length``
    positions (one batch row and head; with ``padding`` an attention_mask of ones too), or None where it cannot
    be read so (it reads other data, or differs across batch rows and heads)."""
    leaves = {leaf: one_document(leaf, d, ctx.spec, length, padding)
              for leaf, d in zip(found.tensor_leaves, found.leaf_dims)}
    if any(v is None for v in leaves.values()):
        return None
    try:
        value = evaluate_position_mask(PositionMask(found.mask, found.nodes, found.size_leaves), ctx.sym, length,
                                       leaves)
    except NotPositional:
        return None
    flat = value.reshape(-1, *value.shape[-2:])
    if flat.dtype != torch.bool:
        flat = flat == 0
    if tuple(flat.shape[-2:]) != (length, length) or not bool((flat == flat[:1]).all()):
        return None
    return flat[0]


def document_window(ctx: RuleContext, found: MetadataMask) -> int | None:
    """The window of a mask built from positions and doc ids, as it shows for one unpadded document at the
    compile-time length and about half of it (key ``j`` visible to query ``i`` iff ``0 <= i - j < w``), or
    None where it shows none (causal, something else, or it reads other data): the envelope the transport
    is planned for, which the run-time check holds every real mask to."""
    longer = min(ctx.layout.global_len(ctx.local_len()), PROBE_MAX_LEN)
    widths = []
    for length in (longer, max(2, longer // 2 + 1)):
        allowed = _one_document(ctx, found, length)
        if allowed is None:
            return None
        before, after = band_sides(allowed) or (length, 0)
        if after != 0 or before + 1 >= length or not torch.equal(allowed, band(length, before + 1)):
            return None
        widths.append(before + 1)
    return widths[0] if widths[0] == widths[1] else None


def document_sees_later_keys(ctx: RuleContext, found: MetadataMask) -> bool:
    """Whether a mask built from metadata lets a query see a later key for one unpadded document at the
    compile-time length (an encoder's padding mask, a bidirectional window): then every key is brought."""
    allowed = _one_document(ctx, found, min(ctx.layout.global_len(ctx.local_len()), PROBE_MAX_LEN), padding=True)
    return allowed is not None and bool(allowed.triu(1).any())


def sees_later_keys(ctx: RuleContext, found: PositionMask) -> bool:
    """Whether a mask built from positions alone lets a query see a later key (bidirectional attention)."""
    length = min(ctx.layout.global_len(ctx.local_len()), PROBE_MAX_LEN)
    return bool(_allowed(_evaluate(ctx, found, length), ctx).triu(1).any())


def two_sided_band(allowed: torch.Tensor) -> tuple[int, int] | None:
    """``(before, after)`` where ``allowed`` (``[n, n]``) is exactly the two-sided band ``-after <= i - j <=
    before``, with a later key seen and both sides narrower than the sequence; else None."""
    n, sides = allowed.shape[-1], band_sides(allowed)
    if sides is None:
        return None
    before, after = sides
    if not (0 <= before < n - 1 and 0 < after < n - 1) or not torch.equal(allowed, band(n, before + 1, ahead=after)):
        return None
    return before, after


def bidirectional_window(ctx: RuleContext, evaluate) -> tuple[int, int] | None:
    """``(window, ahead)`` of a bidirectional mask that is the same two-sided band at the compile-time length
    and about half of it (``evaluate(length)``: the ``[length, length]`` mask for one document, or None):
    each query sees ``window - 1`` earlier and ``ahead`` later keys. None: no such band (every key is brought)."""
    longer = min(ctx.layout.global_len(ctx.local_len()), PROBE_MAX_LEN)
    sides = []
    for length in (longer, max(2, longer // 2 + 1)):
        allowed = evaluate(length)
        sides.append(None if allowed is None else two_sided_band(allowed))
    if sides[0] is None or sides[0] != sides[1]:
        return None
    before, after = sides[0]
    return before + 1, after


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
    found_mask = ctx.matches.masks.get(ctx.node) if mask is not None else None
    metadata = found_mask if isinstance(found_mask, MetadataMask) else None
    if isinstance(found_mask, str):
        ctx.refuse(found_mask + "; masks are evaluated from positions and gathered metadata only",
                   "build the mask from position ids or document ids passed as inputs (cp_passes.shard_batch makes "
                   "doc_ids), or pass is_causal=True")
    ahead = 0
    halo_allowed = ctx.spec.window_transport == "halo"
    if metadata is not None:
        # The envelope (causal, the declared window, or a two-sided window) plans the transport; the model's own
        # mask, evaluated from gathered metadata, is checked against it at run time.
        if meta_val(mask).dtype != torch.bool:
            read = ", ".join(f"'{leaf.meta.get(INPUT_NAME, leaf.name)}'" for leaf in metadata.tensor_leaves)
            ctx.refuse(
                f"its mask ({meta_val(mask).dtype}, built at {source_line(mask, code=False)}) is "
                f"additive and computed from {read}; cp_passes rebuilds a mask that reads data over the whole "
                f"sequence only as a boolean (which keys each query sees), and an additive one may hold any bias",
                "pass scaled_dot_product_attention a boolean mask (True = attend): for a causal additive mask of 0 "
                "and finfo.min (Hugging Face's padding and causal masks), attn_mask=(additive_mask == 0), or build "
                "it as (input_ids != pad_token_id)[:, None, None, :] & causal (an encoder's: without the "
                "causal term)",
            )
        causal = bool(declared) or not document_sees_later_keys(ctx, metadata)
        if causal:
            window = declared.window if declared else document_window(ctx, metadata)
        else:
            window, ahead = bidirectional_window(
                ctx, lambda n: _one_document(ctx, metadata, n, padding=True)) or (None, 0)
    elif isinstance(found_mask, PositionMask) and sees_later_keys(ctx, found_mask):
        # Bidirectional (an encoder's attention): a two-sided band becomes a halo from both sides and a mask made
        # here; any other mask, a function of positions alone, is evaluated at this rank's rows, every key brought.
        if declared is not None:
            said = f"window {declared.window}" if declared.window else "causal attention"
            ctx.refuse(f"the spec declares {said} for modules '{declared.modules}', but the model's mask lets "
                       f"queries see later keys (bidirectional attention)",
                       "remove the AttentionRule: a bidirectional mask is read from the model")
        causal = False
        sides = bidirectional_window(ctx, lambda n: _allowed(_evaluate(ctx, found_mask, n), ctx)) if halo_allowed \
            else None
        if sides is None:
            metadata = MetadataMask(found_mask.mask, found_mask.nodes, [], found_mask.size_leaves, [])
        else:
            window, ahead = sides
    elif isinstance(found_mask, PositionMask):
        global_len = ctx.layout.global_len(ctx.local_len())
        window = read_window(ctx, found_mask, global_len, declared.window if declared else None)
        causal = True
        found = f"a band mask of window {window}" if window else "a causal mask"
    elif mask is not None:
        ctx.refuse(f"cp_passes found no reading of its attention mask '{getattr(mask, 'name', mask)}'",
                   "build the mask from positions or sequence metadata, or pass is_causal=True")
    else:
        found = "is_causal=True (no window)" if causal else "full attention (no mask, not causal)"
    if metadata is None and declared is not None and (declared.window != window or not causal):
        said = f"window {declared.window}" if declared.window else "causal attention"
        ctx.refuse(
            f"the spec declares {said} for modules '{declared.modules}', but the model computes {found}; "
            f"training would not match the single-device model",
            "make the spec's AttentionRule agree with the model (or fix the model's mask)",
        )

    gqa = bool(ctx.arg("enable_gqa"))
    k_src, v_src, notes = k, v, []
    kr, vr = ctx.matches.head_repeats.get(k), ctx.matches.head_repeats.get(v)
    if kr and vr and kr.n_rep == vr.n_rep and not gqa and same_size(meta_val(kr.small).shape[1],
                                                                    meta_val(vr.small).shape[1]):
        k_src, v_src, gqa = kr.small, vr.small, True
        notes.append("K/V moved before the head repeat (enable_gqa)")
    together = (
        ctx.spec.gather_kv_together
        and meta_val(k_src).dtype == meta_val(v_src).dtype
        and all(same_size(a, b) for a, b in zip(meta_val(k_src).shape[:-1], meta_val(v_src).shape[:-1]))
    )
    halo = bool(window) and halo_allowed
    if window and not halo:
        notes.append("the spec asks for a gather")
    sides = f"two-sided window: {window - 1} keys before and {ahead} after" if ahead else None
    if metadata is not None:
        names = ", ".join(leaf.name for leaf in metadata.tensor_leaves) or "positions"
        envelope = (f"window {window} (spec)" if declared and declared.window else
                    f"{sides} read from the model's mask for one document" if ahead else
                    f"window {window} read from the model's mask for one document" if window else
                    "causal envelope" if causal else "bidirectional: every key")
        where = ("at this rank's rows and the keys brought" if evaluated_locally(metadata, window, halo, ctx.arg("dropout_p"))
                 else "over the whole sequence")
        notes.append(f"the model's mask from {names}, evaluated {where}; {envelope}"
                     + (", checked at run time" if causal or window else ""))
    elif ahead:
        notes.append(f"{sides} read from the model's mask")
    elif window:
        notes.append(f"window {window} read from the model's mask")
    left_padding = declared.left_padding if declared is not None and halo else 0
    if left_padding:
        notes.append(f"{left_padding} zero rows in front of the halo (made here, hidden by the mask)")
    request = AttentionKV(ctx.node, q, k_src, v_src, ctx.ndim(k_src) - 2, causal, window, together, gqa,
                          ctx.arg("dropout_p"), ctx.arg("scale"), metadata, notes, left_padding, ahead)
    rule = ("sdpa_bidirectional_window" if not causal and window else
            "sdpa_bidirectional" if metadata and not causal else "sdpa_data_mask" if metadata else
            "sdpa_window" if window else "sdpa_causal" if causal else "sdpa_full")
    return Rewrite(rule, "halo" if halo else "sequence_gather", request, note="; ".join(notes))
