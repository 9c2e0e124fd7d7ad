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

import math

import torch

from ..errors import module_path, node_ref, source_line
from ..graph.analysis import INPUT_NAME, meta_val, seq_multiple
from ..match import (FailedMatch, MetadataMask, NotPositional, PositionMask, evaluate_position_mask, one_document,
                     same_size)
from ..match.mask_bands import SymbolicReach, symbolic_reach
from ..key_plan import (CAUSAL_REACH, EVERY_KEY_REACH, PROBE_MAX_LEN, KeyPlan, Move, Reach, evaluated_at_rows,
                        mask_reach, probe_lengths, read_reach, sized_by_data)
from ..transports.attention import AttentionKV
from ..transports.attention_kernels import describe as describe_kernels
from .registry import Rewrite, RuleContext, register_rule

aten = torch.ops.aten
INF = math.inf

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
            f"its attention mask reads {n.op} {node_ref(n)} (data, not positions); masks built from data "
            f"(document ids, padding) need the packed-documents transport",
            "pass is_causal=True, or a mask built only from positions (arange comparisons)",
        )


def _probe_length(ctx: RuleContext) -> int:
    """The longer of the two lengths masks are read at: the compile-time global length, capped."""
    return min(ctx.layout.global_len(ctx.local_len()), PROBE_MAX_LEN)


def read_window(ctx: RuleContext, found: PositionMask, declared: int | None) -> int | None:
    """The window ``w`` of a model-built band mask (key ``j`` visible to query ``i`` iff ``0 <= i - j < w``),
    or ``None`` when it is plain causal, evaluated over the whole (short) sequence: for a mask whose structure
    is not exactly a band (:func:`_attention_reach`). Anything else is refused."""
    longer = _probe_length(ctx)

    def read(length: int) -> Reach:
        allowed = _allowed(_evaluate(ctx, found, length), ctx)
        if tuple(allowed.shape) != (length, length):
            ctx.refuse(f"its attention mask has shape {tuple(allowed.shape)} at sequence length {length}",
                       "build the mask as [.., seq, seq]")
        reach = mask_reach(allowed)
        if isinstance(reach, str) or not reach.causal:
            ctx.refuse(f"its attention mask is neither causal nor a causal sliding window (checked at sequence "
                       f"length {length})",
                       "use is_causal=True or a band mask (0 <= i - j < window); register a rule for other masks")
        return reach

    reach = read_reach(read, longer)
    if isinstance(reach, str):
        ctx.refuse(f"its attention mask is neither causal nor a causal sliding window: {reach}",
                   "use is_causal=True or a band mask (0 <= i - j < window); register a rule for other masks")
    if reach.window is None and declared is not None and declared >= longer:
        return declared  # a band as wide as the sequence: the spec says how wide, the mask agrees
    bool(ctx.layout.global_len(ctx.length) <= longer)  # a guard (symbolic): a longer sequence is read again
    return reach.window


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


def banded_reach(ctx: RuleContext, evaluate) -> Reach | None:
    """The band a mask shows at both probe lengths, with each side narrower than the shorter one
    (``evaluate(length)``: the ``[length, length]`` mask for one document, or None); None where it shows no
    such band (causal, something else, or it reads other data): then no halo can bring its keys."""
    longer = _probe_length(ctx)

    def read(length: int) -> Reach | str:
        allowed = evaluate(length)
        return "unreadable" if allowed is None else mask_reach(allowed)

    reach = read_reach(read, longer)
    shorter = probe_lengths(longer)[1]
    if isinstance(reach, str) or not reach.banded or reach.before < 0 or reach.at(shorter) != reach:
        return None
    return reach


def document_sees_later_keys(ctx: RuleContext, found: MetadataMask) -> bool:
    """Whether a mask built from metadata lets a query see a later key for one unpadded document at the
    compile-time length (an encoder's padding mask, a bidirectional window): then every key is brought."""
    allowed = _one_document(ctx, found, _probe_length(ctx), padding=True)
    return allowed is not None and bool(allowed.triu(1).any())


def _causal_band(ctx: RuleContext, found: PositionMask) -> bool:
    """Whether a mask from positions is causal attention or a causal band at the probe length."""
    reach = mask_reach(_allowed(_evaluate(ctx, found, _probe_length(ctx)), ctx))
    return not isinstance(reach, str) and reach.causal


def sees_later_keys(ctx: RuleContext, found: PositionMask) -> bool:
    """Whether a mask built from positions alone lets a query see a later key (bidirectional attention)."""
    return bool(_allowed(_evaluate(ctx, found, _probe_length(ctx)), ctx).triu(1).any())


def _check_inputs(ctx: RuleContext, q, k, v) -> None:
    """Refuse sharded keys with unsharded queries, and any input without the sequence on dim -2."""
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


def _metadata_reach(ctx: RuleContext, mask, metadata: MetadataMask, declared) -> Reach:
    """The envelope (causal, the declared window, or a two-sided window) that plans the transport for a mask
    built from metadata; the model's own mask, evaluated from gathered metadata, is checked against it at run
    time."""
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
    if declared or not document_sees_later_keys(ctx, metadata):
        band = (Reach(declared.window - 1) if declared.window else None) if declared else \
            _document_band(ctx, metadata)
        return band if band is not None and band.causal else CAUSAL_REACH
    band = _document_band(ctx, metadata, padding=True)
    return band if band is not None and not band.causal else EVERY_KEY_REACH


def _document_band(ctx: RuleContext, metadata: MetadataMask, padding: bool = False) -> Reach | None:
    """The band one document's mask lies in (:func:`_one_document`): read from the mask's structure, at every
    length, and checked against the mask evaluated at the probe length; where the structure bounds no band, read
    from the mask evaluated at the probe lengths (:func:`banded_reach`). None: no band (or one as long as the
    sequence, which the causal envelope holds as well; the mask is checked at run time either way)."""
    read = symbolic_reach(metadata, ctx.spec, padding)
    if not (isinstance(read, SymbolicReach) and -INF < read.lo <= 0 <= read.hi < INF):
        return banded_reach(ctx, lambda n: _one_document(ctx, metadata, n, padding))
    _cross_check(ctx, metadata.mask, read, _one_document(ctx, metadata, _probe_length(ctx), padding))
    band = read.reach
    return band if band.before < ctx.layout.global_len(ctx.local_len()) - 1 else None


def _bidirectional_reach(ctx: RuleContext, found_mask: PositionMask, reach: Reach, declared,
                         halo_allowed: bool, band: Reach | None = None) -> tuple[Reach, MetadataMask | None]:
    """An encoder's mask from positions alone that lets queries see later keys: a two-sided band (``band``, read
    from its structure, or else from the mask evaluated) becomes a halo from both sides and a mask made here; any
    other mask is evaluated at this rank's rows (the metadata mask returned), ``reach`` (from ``is_causal``) kept
    and every key brought."""
    if declared is not None:
        said = f"window {declared.window}" if declared.window else "causal attention"
        ctx.refuse(f"the spec declares {said} for modules '{declared.modules}', but the model's mask lets "
                   f"queries see later keys (bidirectional attention)",
                   "remove the AttentionRule: a bidirectional mask is read from the model")
    if band is None and halo_allowed:
        band = banded_reach(ctx, lambda n: _allowed(_evaluate(ctx, found_mask, n), ctx))
    if band is None or band.causal or not halo_allowed:
        return reach, _at_rows_mask(found_mask)
    return band, None


def _cross_check(ctx: RuleContext, mask: torch.fx.Node, read: SymbolicReach, shown: torch.Tensor | None) -> None:
    """Refuse where the mask evaluated at the probe length (``shown``, ``[n, n]``; None: not evaluable) does not
    hold the reading of its structure: a flaw in cp_passes's reading, never a plan built on it."""
    if shown is not None and not read.holds(shown):
        ctx.refuse(f"cp_passes read its mask (built at {source_line(mask, code=False)}) as {read.describe()} from "
                   f"its structure, but the mask evaluated at {shown.shape[-1]} positions disagrees (a bug in "
                   f"cp_passes)",
                   "report it with the model; meanwhile declare the window in the spec (AttentionRule), or pass "
                   "is_causal=True where the mask is causal")


def _exact_reach(ctx: RuleContext, found_mask: PositionMask, read: SymbolicReach, reach: Reach, declared,
                 halo_allowed: bool) -> tuple[Reach, MetadataMask | None]:
    """A mask from positions whose structure is exactly a band around each query (at every length): causal, a
    window, or a two-sided window (an encoder's), attended as that band with no mask; any other bidirectional
    mask is evaluated at this rank's rows (:func:`_bidirectional_reach`). A declaration must agree with the
    structure; a window as long as the sequence is attended as causal attention at this length."""
    band = read.reach
    if not band.causal:
        return _bidirectional_reach(ctx, found_mask, reach, declared, halo_allowed and band.banded, band)
    _check_declared(ctx, declared, band, f"a band mask of window {band.window}" if band.window else "a causal mask")
    if band.window is not None and band.window >= ctx.layout.global_len(ctx.local_len()):
        bool(ctx.layout.global_len(ctx.length) <= band.window)  # a guard (symbolic): a longer one reads again
        return CAUSAL_REACH, None
    return band, None


def _at_rows_mask(found_mask: PositionMask) -> MetadataMask:
    """A mask from positions, to be evaluated at this rank's rows and the keys brought (it reads no metadata)."""
    return MetadataMask(found_mask.mask, found_mask.nodes, [], found_mask.size_leaves, [])


def _at_rows(ctx: RuleContext, found_mask: PositionMask, read: SymbolicReach | FailedMatch, declared) -> Reach:
    """The envelope a mask from positions whose structure is not exactly a band is evaluated in, at this rank's
    rows (a sequence too long to evaluate the whole mask): the spec's window where it declares one, else the band
    its structure bounds it by, causal when it shows no later key, else every key; checked at run time."""
    if declared is not None:
        return Reach(declared.window - 1) if declared.window else CAUSAL_REACH
    if not isinstance(read, SymbolicReach):
        return EVERY_KEY_REACH if sees_later_keys(ctx, found_mask) else CAUSAL_REACH
    if read.empty:
        return CAUSAL_REACH  # it hides every key: the run-time check says so on every rank
    if read.lo >= 0:
        return Reach(None if read.hi == INF else int(read.hi))
    return read.reach if read.reach.banded else EVERY_KEY_REACH


def _check_declared(ctx: RuleContext, declared, reach: Reach, found: str) -> None:
    """Refuse a spec's AttentionRule that disagrees with what the model computes (``found``, in words)."""
    if declared is not None and (declared.window != reach.window or not reach.causal):
        said = f"window {declared.window}" if declared.window else "causal attention"
        ctx.refuse(
            f"the spec declares {said} for modules '{declared.modules}', but the model computes {found}; "
            f"training would not match the single-device model",
            "make the spec's AttentionRule agree with the model (or fix the model's mask)",
        )


def _attention_reach(ctx: RuleContext, mask, causal: bool, declared,
                     halo_allowed: bool) -> tuple[Reach, MetadataMask | None]:
    """Which keys each query reaches, from ``is_causal``, the model's mask (its matcher's reading) and the spec;
    and the mask to evaluate from gathered metadata, if any."""
    found_mask = ctx.matches.masks.get(ctx.node) if mask is not None else None
    if isinstance(found_mask, FailedMatch):
        ctx.refuse(found_mask.reason + "; masks are evaluated from positions and gathered metadata only",
                   "build the mask from position ids or document ids passed as inputs (cp_passes.shard_batch makes "
                   "doc_ids), or pass is_causal=True")
    reach = CAUSAL_REACH if causal else EVERY_KEY_REACH
    if isinstance(found_mask, MetadataMask):
        return _metadata_reach(ctx, mask, found_mask, declared), found_mask
    if isinstance(found_mask, PositionMask):
        read = symbolic_reach(found_mask, ctx.spec)
        if isinstance(read, SymbolicReach):
            _cross_check(ctx, found_mask.mask, read, _allowed(_evaluate(ctx, found_mask, _probe_length(ctx)), ctx))
        if isinstance(read, SymbolicReach) and read.exact and read.lo <= 0 <= read.hi:
            return _exact_reach(ctx, found_mask, read, reach, declared, halo_allowed)
        if ctx.layout.global_len(ctx.local_len()) > PROBE_MAX_LEN:
            return _at_rows(ctx, found_mask, read, declared), _at_rows_mask(found_mask)
    if isinstance(found_mask, PositionMask) and sees_later_keys(ctx, found_mask):
        return _bidirectional_reach(ctx, found_mask, reach, declared, halo_allowed)
    if isinstance(found_mask, PositionMask) and not _causal_band(ctx, found_mask):
        # Causal but no band (Llama 4's chunks, i // c == j // c): the band its structure bounds it by, or the causal
        # envelope, with the mask evaluated at this rank's rows, as for a long sequence.
        return _at_rows(ctx, found_mask, read, declared), _at_rows_mask(found_mask)
    if isinstance(found_mask, PositionMask):
        window = read_window(ctx, found_mask, declared.window if declared else None)
        reach = Reach(None if window is None else window - 1)
        found = f"a band mask of window {window}" if window else "a causal mask"
    elif mask is not None:
        ctx.refuse(f"cp_passes found no reading of its attention mask '{getattr(mask, 'name', mask)}'",
                   "build the mask from positions or sequence metadata, or pass is_causal=True")
    else:
        found = "is_causal=True (no window)" if causal else "full attention (no mask, not causal)"
    _check_declared(ctx, declared, reach, found)
    return reach, None


def _kv_before_head_repeat(ctx: RuleContext, k, v, gqa: bool, notes: list) -> tuple:
    """``(K, V, enable_gqa)`` to move: where K and V come from head repeats by the same factor, the tensors before
    them (attended with GQA; ``notes`` says so), else K and V as given."""
    kr, vr = ctx.matches.head_repeats.get(k), ctx.matches.head_repeats.get(v)
    if kr and vr and kr.n_rep == vr.n_rep and not gqa and same_size(meta_val(kr.small).shape[1],
                                                                    meta_val(vr.small).shape[1]):
        notes.append("K/V moved before the head repeat (enable_gqa)")
        return kr.small, vr.small, True
    return k, v, gqa


def _gather_together(ctx: RuleContext, k_src, v_src) -> bool:
    """Whether K and V travel as one tensor: the spec asks so, and they share a dtype and all but the last dim."""
    return (
        ctx.spec.gather_kv_together
        and meta_val(k_src).dtype == meta_val(v_src).dtype
        and all(same_size(a, b) for a, b in zip(meta_val(k_src).shape[:-1], meta_val(v_src).shape[:-1]))
    )


def _metadata_note(metadata: MetadataMask, reach: Reach, plan: KeyPlan, declared, dropout) -> str:
    """The table's note on a mask built from metadata: what it reads, where it is evaluated, its envelope."""
    names = ", ".join(leaf.meta.get(INPUT_NAME, leaf.name) for leaf in metadata.tensor_leaves) or "positions"
    envelope = (f"window {reach.window} (spec)" if declared and declared.window else
                f"{reach.describe()} read from the model's mask for one document" if reach.banded else
                "causal envelope" if reach.causal else "bidirectional: every key")
    where = ("at this rank's rows and the keys brought"
             if evaluated_at_rows(metadata, plan.reach, plan.move, dropout) else
             "over the whole sequence" if sized_by_data(metadata) else
             "at this rank's rows and the keys brought where it is elementwise in per-position terms (else over "
             "the whole sequence)")
    return (f"the model's mask from {names}, evaluated {where}; {envelope}"
            + (", checked at run time" if reach.causal or reach.banded else ""))


def _rule_name(reach: Reach, metadata: MetadataMask | None) -> str:
    return ("sdpa_bidirectional_window" if reach.banded and not reach.causal else
            "sdpa_bidirectional" if metadata and not reach.causal else "sdpa_data_mask" if metadata else
            "sdpa_window" if reach.banded else "sdpa_causal" if reach.causal else "sdpa_full")


@register_rule(aten.scaled_dot_product_attention)
def sdpa_rule(ctx: RuleContext):
    q, k, v = ctx.arg("query"), ctx.arg("key"), ctx.arg("value")
    mask, causal = ctx.arg("attn_mask"), bool(ctx.arg("is_causal"))
    if not ctx.is_seq(k) and not ctx.is_seq(v):
        return None  # attending to memory that is not sharded: nothing to move
    _check_inputs(ctx, q, k, v)
    declared = ctx.spec.attention_for(module_path(ctx.node))
    halo_allowed = ctx.spec.window_transport == "halo"
    reach, metadata = _attention_reach(ctx, mask, causal, declared, halo_allowed)

    notes = []
    k_src, v_src, gqa = _kv_before_head_repeat(ctx, k, v, bool(ctx.arg("enable_gqa")), notes)
    together = _gather_together(ctx, k_src, v_src)
    dropout = ctx.arg("dropout_p")
    local = metadata is not None and evaluated_at_rows(metadata, reach, None, dropout)
    plan = KeyPlan.decide(reach, halo_allowed, first_keys=local)
    if reach.banded and plan.move != Move.HALO:
        notes.append("the spec asks for a gather")
    if metadata is not None:
        notes.append(_metadata_note(metadata, reach, plan, declared, dropout))
    elif reach.banded:
        notes.append(f"{reach.describe()} read from the model's mask")
    left_padding = declared.left_padding if declared is not None and plan.move == Move.HALO else 0
    if left_padding:
        notes.append(f"{left_padding} zero rows in front of the halo (made here, hidden by the mask)")
    notes.append(describe_kernels(meta_val(q), meta_val(k_src), meta_val(v_src),
                                  masked=metadata is not None or reach.banded))
    request = AttentionKV(ctx.node, q, k_src, v_src, ctx.ndim(k_src) - 2, plan, together, gqa, dropout,
                          ctx.arg("scale"), metadata, notes, left_padding)
    rule = _rule_name(reach, metadata)
    return Rewrite(rule, "halo" if plan.move == Move.HALO else "sequence_gather", request, note="; ".join(notes))
