"""A sliding window over a halo, tile by tile: ``cp_passes::window_attention``.

After a halo (:mod:`.halo`) each of the rank's ranges has its keys as one segment ``[left padding, before
rows, the range, after rows]``. A query at global position ``p`` sees the keys at ``p - before .. p + after``
that lie in the sequence, all inside its own segment. The op cuts each range's queries into tiles of rows;
a tile's keys are the contiguous run of its segment its rows can see, its mask the band between them, made
from the layout's positions inside the op: the window is structure, never a ``[queries, keys]`` tensor of
the graph. Each query row lies in exactly one tile; the pairs then run through :mod:`.block_attention`'s
forward and backward (autograd saves the inputs, the output and the logsumexp).
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

from ..layout import Layout
from .block_attention import TILE_ROWS, backward_pairs, call_shapes, forward_pairs, lse_dtype, span


def tile_rows(before: int, after: int) -> int:
    """Query rows per tile: half the band's width (a tile then computes at most 1.5x the band's scores), at
    least ``TILE_ROWS``."""
    return max(TILE_ROWS, -(-(before + after) // 2))


def _window_pairs(q, k, rank: int, world: int, kind: str, before: int, after: int):
    """Every tile ``(rows, keys, mask, False)`` of the window, rows and keys as slices of ``q`` and ``k``."""
    layout = Layout(world, kind)
    local, keys_len = q.shape[-2], k.shape[-2]
    size, segment = local // layout.chunks, keys_len // layout.chunks
    left_padding = segment - size - before - after
    q_pos = layout.positions(rank, local, q.device)
    k_pos = layout.halo_positions(before, rank, local, q.device, left_padding, after)
    step = tile_rows(before, after)
    for i in range(layout.chunks):
        for first in range(0, size, step):
            rows = slice(i * size + first, i * size + min(size, first + step))
            start = i * segment + left_padding + first  # the key at the tile's first query's position - before
            stop = i * segment + left_padding + rows.stop - i * size + before + after
            positions = k_pos[start:stop]
            valid = span(positions >= 0)  # rows outside the sequence are zeros, never seen
            if valid is None:
                continue
            keys = slice(start + valid[0], start + valid[1])
            distance = q_pos[rows, None] - k_pos[None, keys]
            yield rows, keys, (distance <= before) & (distance >= -after) & (k_pos[None, keys] >= 0), False


@torch.library.custom_op("cp_passes::window_attention", mutates_args=())
def window_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int, world: int, kind: str,
                        before: int, after: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of this rank's queries over its halo's keys, each query seeing ``before`` earlier and
    ``after`` later positions of the sequence: ``(output, logsumexp)``."""
    return forward_pairs(q, k, v, _window_pairs(q, k, rank, world, kind, before, after), scale, False)


@window_attention_op.register_fake
def _(q, k, v, rank, world, kind, before, after, scale):
    return q.new_empty(*q.shape[:-1], v.shape[-1]), q.new_empty(q.shape[:-1], dtype=lse_dtype(q))


@torch.library.custom_op("cp_passes::window_attention_backward", mutates_args=())
def window_attention_backward_op(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 out: torch.Tensor, lse: torch.Tensor, rank: int, world: int, kind: str,
                                 before: int, after: int, scale: float
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    pairs = _window_pairs(q, k, rank, world, kind, before, after)
    return backward_pairs(grad, q, k, v, out, lse, pairs, scale, False)


@window_attention_backward_op.register_fake
def _(grad, q, k, v, out, lse, rank, world, kind, before, after, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, *ctx.options = inputs
    ctx.save_for_backward(q, k, v, *output)


def _backward(ctx, grad, _grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = window_attention_backward_op(grad.contiguous(), q, k, v, out, lse, *ctx.options)
    return dq, dk, dv, None, None, None, None, None, None


window_attention_op.register_autograd(_backward, setup_context=_setup_context)


@register_flop_formula(torch.ops.cp_passes.window_attention, get_raw=True)
def _window_attention_flop(q, k, v, rank, world, kind, before, after, *args, **kwargs) -> int:
    return sum(sdpa_flop_count(*s) for s in call_shapes(q, k, v, _window_pairs(q, k, rank, world, kind, before, after)))


@register_flop_formula(torch.ops.cp_passes.window_attention_backward, get_raw=True)
def _window_attention_backward_flop(grad, q, k, v, out, lse, rank, world, kind, before, after, *args, **kwargs) -> int:
    return sum(sdpa_backward_flop_count(s[0][:-1] + (v.shape[-1],), *s)
               for s in call_shapes(q, k, v, _window_pairs(q, k, rank, world, kind, before, after)))
