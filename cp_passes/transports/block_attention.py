"""Attention over key blocks, merged by logsumexp: ``cp_passes::block_attention``.

The gather transport's edit calls it in place of ``scaled_dot_product_attention`` once K/V are gathered. The
local queries and the keys they may see come in pieces (``q_bounds``, ``k_bounds``: row offsets of each
piece, in the tensors as given); ``kinds`` (:func:`~cp_passes.key_plan.attention_pieces`) says for every
(query piece, key piece) pair, row-major, what the pair computes: ``SKIP`` nothing, ``FULL`` every score,
``CAUSAL`` the causal triangle of two pieces that start at the same position. Each computed pair is one
attention call returning its output and logsumexp; the outputs merge with weights ``exp(lse_pair - lse)``.
So causal attention needs no mask (the pieces before this rank's own are seen whole, its own is causal), and
no key block a query cannot see is computed.

A mask the model builds (packed documents) is passed as booleans ``[.., queries, keys]``, or as the
per-position terms and program of :mod:`.mask_program`, evaluated a tile at a time; each pair then
computes, per tile of query rows, only the rectangle of rows and keys its mask block lets anything through (a
document that ended before a key block costs nothing there, a causal triangle about half its square).

Autograd saves the inputs, the output and the logsumexp (``[.., queries]``): nothing ``[queries, keys]``.
The backward calls each pair's attention backward with the merged output and logsumexp, which is exactly
that pair's share of the gradient (what ring attention does). Each pair runs the fused kernel one table picks by
device, dtype, head dims and mask kind (:mod:`.attention_kernels`: CPU flash attention; on CUDA flash attention
for unmasked pairs in fp16 and bf16, memory-efficient attention with an additive bias otherwise); where none
applies, an exact matmul-softmax of the pair in blocks of query rows, so that no more than ``MATH_BLOCK`` scores
exist at once. On CUDA a masked pair reads nothing back to the host: each tile of ``CUDA_TILE_ROWS`` rows runs
whole against the pair's keys with its mask block as the bias, where the CPU cuts the rectangles the mask lets
through (which reads the mask on the host, tile by tile).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils.flop_counter import register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

from ..key_plan import CAUSAL, SKIP
from . import attention_kernels as kernels
from .attention_kernels import MATH, fold_heads, kernel_for, repeat_heads
from .mask_program import evaluate

aten = torch.ops.aten

TILE_ROWS = KEY_GAP = 128
"""A masked pair is cut into tiles of ``TILE_ROWS`` query rows, and in each tile every run of keys the mask lets
anything through (runs ``KEY_GAP`` or more masked keys apart) is computed as the rectangle of that run and the
rows that see it, as a block-sparse kernel computes the blocks a block mask keeps: a document's causal triangle
costs about half its square, and the many short documents of an interleaved row
(``shard_batch(..., balance="documents")``) a block diagonal, not one rectangle (:func:`rectangles`)."""
CUDA_TILE_ROWS = 512
"""Query rows per tile of a masked pair on CUDA, each tile one kernel call over all the pair's keys (its bias is
``CUDA_TILE_ROWS`` x keys): no rectangles, so no host reads."""
MIN_ROWS = 16
"""The fewest rows :func:`rectangles` halves a sparse rectangle into."""

MATH_BLOCK = 1 << 26
"""Most scores (fp32 or fp64 elements) the matmul-softmax path holds at once: a pair is split into blocks of
query rows below this."""


def cut(t: torch.Tensor, part: slice, dim: int = -2, broadcast: bool = False) -> torch.Tensor:
    """Rows (or, with ``dim``, another axis) ``part`` of ``t``: a view by ``narrow``, which fake CUDA tensors take on
    a machine without CUDA (indexing them with a slice does not). ``broadcast``: a size-1 axis stands for every
    row and stays whole."""
    if broadcast and t.shape[dim] == 1:
        return t
    return t.narrow(dim, part.start, part.stop - part.start)


def assign(target: torch.Tensor, values: torch.Tensor) -> None:
    """``target.copy_(values)`` by the ATen op: the method's Python binding refuses fake CUDA tensors on a machine
    without CUDA."""
    aten.copy_.default(target, values)


def lse_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _math_scores(q, k, mask, causal, scale, first_row: int = 0):
    """Scores of rows ``first_row..`` of a pair (causal: key ``j`` visible to row ``i`` iff ``j <= i``)."""
    scores = (q.to(lse_dtype(q)) @ repeat_heads(k, q.shape[-3]).to(lse_dtype(q)).transpose(-1, -2)) * scale
    if causal:
        visible = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril(first_row)
        scores = scores.masked_fill(visible.logical_not(), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(mask.logical_not(), float("-inf"))
    return scores


def _row_blocks(q, k):
    """Query-row ranges for the matmul-softmax path: ``(start, stop)`` with at most ``MATH_BLOCK`` scores each."""
    rows = q.shape[-2]
    per_row = max(1, q[..., :1, :1].numel() * k.shape[-2])  # a score per (batch, head) and key
    step = max(1, min(rows, MATH_BLOCK // per_row))
    return [(start, min(rows, start + step)) for start in range(0, rows, step)]


def _math_forward(q, k, v, mask, causal, scale, first_row):
    scores = _math_scores(q, k, mask, causal, scale, first_row)
    lse = torch.logsumexp(scores, -1)
    weights = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0)[..., None])
    return (weights @ repeat_heads(v, q.shape[-3]).to(weights.dtype)).to(q.dtype), lse


def attend(q, k, v, mask, causal: bool, scale: float, math: bool = False):
    """One pair's ``(output, logsumexp)`` by the kernel :func:`~.attention_kernels.kernel_for` picks; rows that see no
    key get logsumexp ``-inf``."""
    kernel = kernel_for(q, k, v, mask is not None, causal, math)
    if kernel != MATH:
        out, lse = kernels.forward(kernel, q, k, v, mask, causal, scale)
    else:
        parts = [_math_forward(q[..., a:b, :], k, v, None if mask is None else mask[..., a:b, :], causal, scale, a)
                 for a, b in _row_blocks(q, k)]
        out, lse = torch.cat([p[0] for p in parts], -2), torch.cat([p[1] for p in parts], -1)
    if mask is not None:  # the fused kernels report a finite logsumexp for a row that sees nothing
        lse = lse.masked_fill(mask.any(-1).logical_not().expand(lse.shape), float("-inf"))
    return out, lse


def _math_backward(grad, q, k, v, mask, out, lse, causal, scale, first_row):
    wide = lse_dtype(q)
    weights = torch.exp(_math_scores(q, k, mask, causal, scale, first_row) - lse[..., None])
    g = grad.to(wide)
    dv = weights.transpose(-1, -2) @ g
    dp = g @ repeat_heads(v, q.shape[-3]).to(wide).transpose(-1, -2)
    ds = weights * (dp - (g * out.to(wide)).sum(-1, keepdim=True))
    dq = (ds @ repeat_heads(k, q.shape[-3]).to(wide)) * scale
    dk = (ds.transpose(-1, -2) @ q.to(wide)) * scale
    return dq, dk, dv


def attend_backward(grad, q, k, v, mask, out, lse, causal: bool, scale: float, math: bool = False):
    """One pair's ``(dq, dk, dv)`` given the merged ``out`` and ``lse`` of its rows."""
    lse = lse.masked_fill(lse == float("-inf"), 0)  # rows that see nothing anywhere: every weight is 0 anyway
    kernel = kernel_for(q, k, v, mask is not None, causal, math)
    if kernel != MATH:
        return kernels.backward(kernel, grad, q, k, v, mask, out, lse, causal, scale)
    heads, dq, dk, dv = k.shape[-3], [], 0, 0
    for a, b in _row_blocks(q, k):
        part = _math_backward(grad[..., a:b, :], q[..., a:b, :], k, v, None if mask is None else mask[..., a:b, :],
                              out[..., a:b, :], lse[..., a:b], causal, scale, a)
        dq.append(part[0])
        dk, dv = dk + part[1], dv + part[2]
    return torch.cat(dq, -2).to(q.dtype), fold_heads(dk, heads).to(k.dtype), fold_heads(dv, heads).to(v.dtype)


def span(flags: torch.Tensor) -> tuple[int, int] | None:
    """``[first, last + 1)`` of the True entries of a 1-D boolean tensor, None if there are none."""
    where = flags.nonzero()
    return None if where.numel() == 0 else (int(where[0]), int(where[-1]) + 1)


def runs(flags: torch.Tensor, gap: int) -> list[tuple[int, int]]:
    """``[first, last + 1)`` of each run of True entries of a 1-D boolean tensor, runs less than ``gap`` False
    entries apart merged."""
    where = flags.nonzero().flatten()
    if where.numel() == 0:
        return []
    cuts = (where.diff() > gap).nonzero().flatten().tolist()
    starts, stops = [0] + [c + 1 for c in cuts], cuts + [where.numel() - 1]
    return [(int(where[a]), int(where[b]) + 1) for a, b in zip(starts, stops)]


def rectangles(seen: torch.Tensor, first: int = 0) -> list[tuple[int, int, int, int]]:
    """``(row start, row stop, key start, key stop)`` rectangles covering every True entry of ``seen`` (``[rows,
    keys]``, rows counted from ``first``): each run of keys (:func:`runs`) with the rows that see it, and a
    rectangle less than three quarters full (the block diagonal of documents shorter than a tile, a causal
    triangle) halved along its rows again, down to ``MIN_ROWS``: a triangle becomes steps of ``MIN_ROWS``."""
    found = []
    for c, d in runs(seen.any(0), KEY_GAP):
        a, b = span(seen[:, c:d].any(-1))
        block = seen[a:b, c:d]
        if b - a > MIN_ROWS and 4 * int(block.sum()) < 3 * block.numel():
            middle = (b - a) // 2
            found += [(r0, r1, c + k0, c + k1) for half in ((0, middle), (middle, b - a))
                      for r0, r1, k0, k1 in rectangles(block[half[0]:half[1]], first + a + half[0])]
        else:
            found.append((first + a, first + b, c, d))
    return found


def _pairs(q, mask, q_bounds, k_bounds, kinds, leaves=(), program: str = ""):
    """Every pair to compute: ``(rows, keys, mask block, causal)``, rows and keys as slices of the tensors. The
    mask is a tensor, or ``program`` over ``leaves`` (:mod:`.mask_program`), evaluated a tile at a time."""
    nk = len(k_bounds) - 1
    for i in range(len(q_bounds) - 1):
        for j in range(nk):
            kind = kinds[i * nk + j]
            if kind == SKIP:
                continue
            rows, keys = slice(q_bounds[i], q_bounds[i + 1]), slice(k_bounds[j], k_bounds[j + 1])
            if mask is None and not program:
                yield rows, keys, None, kind == CAUSAL
                continue
            n, m = rows.stop - rows.start, keys.stop - keys.start
            on_host = q.device.type == "cpu"
            step = TILE_ROWS if on_host else CUDA_TILE_ROWS
            for first in range(0, n, step):
                part = slice(rows.start + first, rows.start + min(n, first + step))
                # a mask broadcast over queries or keys (size 1 there) is read as the rows and keys it stands for
                block = (evaluate(program, leaves, part, keys) if program
                         else cut(cut(mask, part, -2, broadcast=True), keys, -1, broadcast=True))
                block = block.expand(*block.shape[:-2], part.stop - part.start, m)
                if not on_host:
                    yield part, keys, block, False
                    continue
                seen = block.reshape(-1, *block.shape[-2:]).any(0)  # what any head or batch row sees
                for a, b, c, d in rectangles(seen):
                    yield (slice(part.start + a, part.start + b), slice(keys.start + c, keys.start + d),
                           block[..., a:b, c:d], False)


def _merge(acc_out, acc_lse, out, lse, rows):
    """Fold one pair's rows into the running output and logsumexp (in place)."""
    old_lse, old_out = cut(acc_lse, rows, -1), cut(acc_out, rows)
    new = torch.logaddexp(old_lse, lse)
    finite = new != float("-inf")
    keep = torch.where(finite, torch.exp(old_lse - new.masked_fill(finite.logical_not(), 0)), 0)
    take = torch.where(finite, torch.exp(lse - new.masked_fill(finite.logical_not(), 0)), 0)
    old_out.mul_(keep.unsqueeze(-1)).add_(out.to(acc_out.dtype) * take.unsqueeze(-1))
    assign(old_lse, new)


def forward_pairs(q, k, v, pairs, scale: float, math: bool):
    """``(output, logsumexp)`` of the pairs ``(rows, keys, mask block, causal)``, merged by logsumexp."""
    wide = lse_dtype(q)
    acc_out = q.new_zeros(*q.shape[:-1], v.shape[-1], dtype=wide)
    acc_lse = q.new_full(q.shape[:-1], float("-inf"), dtype=wide)
    for rows, keys, block, causal in pairs:
        out, lse = attend(cut(q, rows), cut(k, keys), cut(v, keys), block, causal, scale, math)
        _merge(acc_out, acc_lse, out, lse, rows)
    return acc_out.to(q.dtype), acc_lse


def backward_pairs(grad, q, k, v, out, lse, pairs, scale: float, math: bool):
    """``(dq, dk, dv)``: each pair's share of the gradient given the merged ``out`` and ``lse``."""
    wide = lse_dtype(q)
    dq, dk, dv = (torch.zeros(t.shape, dtype=wide, device=t.device) for t in (q, k, v))
    for rows, keys, block, causal in pairs:
        pq, pk, pv = attend_backward(cut(grad, rows), cut(q, rows), cut(k, keys), cut(v, keys), block,
                                     cut(out, rows), cut(lse, rows, -1), causal, scale, math)
        cut(dq, rows).add_(pq)
        cut(dk, keys).add_(pk)
        cut(dv, keys).add_(pv)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@torch.library.custom_op("cp_passes::block_attention", mutates_args=(), schema=(
    "(Tensor q, Tensor k, Tensor v, Tensor? mask, SymInt[] q_bounds, SymInt[] k_bounds, SymInt[] kinds, "
    "float scale, bool math=False, str program='', Tensor[]? leaves=None) -> (Tensor, Tensor)"))
def block_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                       q_bounds: list[int], k_bounds: list[int], kinds: list[int], scale: float,
                       math: bool = False, program: str = "",
                       leaves: Optional[list[torch.Tensor]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``mask`` (booleans ``[.., queries, keys]``), or ``program`` over ``leaves`` (:mod:`.mask_program`)."""
    return forward_pairs(q, k, v, _pairs(q, mask, q_bounds, k_bounds, kinds, leaves, program), scale, math)


@block_attention_op.register_fake
def _(q, k, v, mask, q_bounds, k_bounds, kinds, scale, math=False, program="", leaves=None):
    return q.new_empty(*q.shape[:-1], v.shape[-1]), q.new_empty(q.shape[:-1], dtype=lse_dtype(q))


@torch.library.custom_op("cp_passes::block_attention_backward", mutates_args=(), schema=(
    "(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor out, Tensor lse, SymInt[] q_bounds, "
    "SymInt[] k_bounds, SymInt[] kinds, float scale, bool math=False, str program='', Tensor[]? leaves=None) "
    "-> (Tensor, Tensor, Tensor)"))
def block_attention_backward_op(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                mask: Optional[torch.Tensor], out: torch.Tensor, lse: torch.Tensor,
                                q_bounds: list[int], k_bounds: list[int], kinds: list[int], scale: float,
                                math: bool = False, program: str = "",
                                leaves: Optional[list[torch.Tensor]] = None
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return backward_pairs(grad, q, k, v, out, lse, _pairs(q, mask, q_bounds, k_bounds, kinds, leaves, program), scale,
                          math)


@block_attention_backward_op.register_fake
def _(grad, q, k, v, mask, out, lse, q_bounds, k_bounds, kinds, scale, math=False, program="", leaves=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as the kernel's


_DEFAULTS = (False, "", None)
"""``math``, ``program`` and ``leaves`` where a call leaves them out."""


def _setup_context(ctx, inputs, output):
    q, k, v, mask, *options, leaves = tuple(inputs) + _DEFAULTS[len(inputs) - 8:]
    ctx.options, ctx.leaves = options, leaves
    ctx.save_for_backward(q, k, v, mask, *output, *(leaves or ()))


def _backward(ctx, grad, _grad_lse):
    q, k, v, mask, out, lse, *leaves = ctx.saved_tensors
    dq, dk, dv = block_attention_backward_op(grad.contiguous(), q, k, v, mask, out, lse, *ctx.options,
                                             None if ctx.leaves is None else leaves)
    # one for each input the dispatcher passed (it leaves out trailing defaults), a list for the leaves
    grads = [dq, dk, dv] + [None] * (len(ctx.needs_input_grad) - 3)
    if len(grads) == 8 + len(_DEFAULTS) and ctx.leaves is not None:
        grads[-1] = [None] * len(ctx.leaves)
    return tuple(grads)


block_attention_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("cp_passes::block_attention_rest", mutates_args=(), schema=(
    "(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, SymInt[] q_bounds, SymInt[] k_bounds, SymInt[] kinds, "
    "SymInt[] all_kinds, float scale, bool math=False) -> (Tensor, Tensor)"))
def block_attention_rest_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                            q_bounds: list[int], k_bounds: list[int], kinds: list[int], all_kinds: list[int],
                            scale: float, math: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs ``kinds`` merged into ``(out, lse)``, which another call computed for the other pairs of
    ``all_kinds`` (a rank's own keys, while the rest travelled): attention over every pair of ``all_kinds``.
    Its gradient is every pair's of ``all_kinds``, each with the merged output (as :func:`block_attention_op`'s);
    ``out`` and ``lse`` get none, since the pairs that made them are differentiated here."""
    acc_out, acc_lse = out.to(lse_dtype(q), copy=True), lse.clone()
    for rows, keys, block, causal in _pairs(q, None, q_bounds, k_bounds, kinds):
        part, part_lse = attend(cut(q, rows), cut(k, keys), cut(v, keys), block, causal, scale, math)
        _merge(acc_out, acc_lse, part, part_lse, rows)
    return acc_out.to(q.dtype), acc_lse


@block_attention_rest_op.register_fake
def _(q, k, v, out, lse, q_bounds, k_bounds, kinds, all_kinds, scale, math=False):
    return q.new_empty(*q.shape[:-1], v.shape[-1]), q.new_empty(q.shape[:-1], dtype=lse_dtype(q))


def _setup_rest(ctx, inputs, output):
    q, k, v, _, _, q_bounds, k_bounds, _, all_kinds, scale, *math = inputs
    ctx.options = (q_bounds, k_bounds, all_kinds, scale, *math)
    ctx.save_for_backward(q, k, v, *output)


def _backward_rest(ctx, grad, _grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = block_attention_backward_op(grad.contiguous(), q, k, v, None, out, lse, *ctx.options)
    return (dq, dk, dv) + (None,) * (len(ctx.needs_input_grad) - 3)


block_attention_rest_op.register_autograd(_backward_rest, setup_context=_setup_rest)


def pair_shapes(q, k, v, mask, q_bounds, k_bounds, kinds, program: str = "",
                leaves=None) -> list[tuple[tuple, tuple, tuple]]:
    """The ``(query, key, value)`` shapes (4-D) of every attention call the op makes: a mask's rectangles where
    its values are known, every unskipped piece whole where they are not (fake tensors)."""
    fake = [t for t in [mask, *(leaves or ())] if isinstance(t, torch._subclasses.FakeTensor)]
    if fake or (mask is None and not program):
        return call_shapes(q, k, v, _pairs(q, None, q_bounds, k_bounds, kinds))
    return call_shapes(q, k, v, _pairs(q, mask, q_bounds, k_bounds, kinds, leaves, program))


def _mask_args(args: tuple, kwargs: dict) -> tuple[str, list | None]:
    """``(program, leaves)`` of the op's arguments after ``kinds`` (``scale, math, program, leaves``)."""
    rest = list(args) + [None] * (4 - len(args))
    return kwargs.get("program", rest[2] or ""), kwargs.get("leaves", rest[3])


def call_shapes(q, k, v, pairs) -> list[tuple[tuple, tuple, tuple]]:
    """The 4-D ``(query, key, value)`` shapes of the attention calls of ``pairs``."""
    shapes = []
    for rows, keys, _, _ in pairs:
        lead = tuple(q.shape[:-2]) if q.dim() == 4 else (1,) * (4 - q.dim() + 1) + tuple(q.shape[:-2])
        kv_lead = tuple(k.shape[:-2]) if k.dim() == 4 else lead[:-1] + (1,)
        n, m = rows.stop - rows.start, keys.stop - keys.start
        shapes.append(((*lead, n, q.shape[-1]), (*kv_lead, m, k.shape[-1]), (*kv_lead, m, v.shape[-1])))
    return shapes


@register_flop_formula(torch.ops.cp_passes.block_attention, get_raw=True)
def _block_attention_flop(q, k, v, mask, q_bounds, k_bounds, kinds, *args, **kwargs) -> int:
    """What :class:`torch.utils.flop_counter.FlopCounterMode` counts: every call the op makes, dense (as it
    counts SDPA), so a piece the layout skips costs nothing."""
    return sum(sdpa_flop_count(*shapes)
               for shapes in pair_shapes(q, k, v, mask, q_bounds, k_bounds, kinds, *_mask_args(args, kwargs)))


@register_flop_formula(torch.ops.cp_passes.block_attention_rest, get_raw=True)
def _block_attention_rest_flop(q, k, v, out, lse, q_bounds, k_bounds, kinds, *args, **kwargs) -> int:
    return sum(sdpa_flop_count(*shapes) for shapes in call_shapes(q, k, v, _pairs(q, None, q_bounds, k_bounds, kinds)))


@register_flop_formula(torch.ops.cp_passes.block_attention_backward, get_raw=True)
def _block_attention_backward_flop(grad, q, k, v, mask, out, lse, q_bounds, k_bounds, kinds, *args, **kwargs) -> int:
    return sum(sdpa_backward_flop_count(s[0][:-1] + (v.shape[-1],), *s)
               for s in pair_shapes(q, k, v, mask, q_bounds, k_bounds, kinds, *_mask_args(args, kwargs)))
