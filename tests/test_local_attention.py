"""Attention at one rank's rows, without processes: the block attention op against SDPA, and masks evaluated
at picked rows and keys against the whole mask cut afterwards."""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from cp_passes.graph.selection import Selector
from cp_passes.key_plan import CAUSAL, FULL, SKIP, attention_pieces
from cp_passes.layout import Layout
from cp_passes.transports.block_attention import TILE_ROWS, block_attention_op, pair_shapes


def _documents(positions: torch.Tensor) -> torch.Tensor:
    """Documents of 5, 4, 7, 2, ... tokens (the pattern repeats), one spanning three of the key pieces."""
    return torch.bucketize(positions, torch.tensor([5, 9, 16, 18, 23, 27, 34]), right=True)


@pytest.mark.parametrize("math,gqa,masked", list(itertools.product([False, True], repeat=3)))
def test_block_attention_matches_sdpa_forward_and_gradients(math, gqa, masked):
    """Rank 2 of 3 (6 queries, 18 keys): earlier keys whole and its own causally, or a document mask cut into
    three key pieces (a document spans all three; the first query of a document sees one key). fp64, so the
    only difference is summation order."""
    torch.manual_seed(0)
    batch, heads, local, dim, rank = 2, 4, 6, 8, 2
    kv_heads = 2 if gqa else heads
    q = torch.randn(batch, heads, local, dim, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(batch, kv_heads, (rank + 1) * local, dim, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    q_pos, k_pos = torch.arange(rank * local, (rank + 1) * local), torch.arange((rank + 1) * local)
    allowed = q_pos[:, None] >= k_pos[None, :]
    if masked:
        allowed = allowed & (_documents(q_pos)[:, None] == _documents(k_pos)[None, :])
        mask, k_bounds, kinds = allowed[None, None].expand(batch, 1, -1, -1), [0, 6, 12, 18], [FULL] * 3
    else:
        mask, k_bounds, kinds = None, [0, 12, 18], [FULL, CAUSAL]
    out, lse = block_attention_op(q, k, v, mask, [0, local], k_bounds, kinds, dim ** -0.5, math)
    rep = heads // kv_heads
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                          attn_mask=allowed)
    grad = torch.randn_like(want)
    got_grads = torch.autograd.grad(out, (q, k, v), grad)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp((q @ k.repeat_interleave(rep, 1).transpose(-1, -2) * dim ** -0.5)
                                                    .masked_fill(~allowed, float("-inf")), -1), rtol=0, atol=1e-12)
    for got, expected in zip(got_grads, want_grads):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_rows_that_see_no_key_are_zero_and_carry_no_gradient():
    """A row the mask hides everywhere gets output 0 and no gradient (SDPA's flash kernel on CPU does the
    same); a key piece no row sees is skipped."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.ones(4, 4, dtype=torch.bool).tril()
    mask[1] = False
    mask[:, 2:] = False
    out, lse = block_attention_op(q, k, v, mask, [0, 4], [0, 2, 4], [FULL, FULL], 8 ** -0.5)
    assert torch.equal(out[:, :, 1], torch.zeros(1, 2, 8, dtype=torch.float64))
    assert bool(torch.isneginf(lse[:, :, 1]).all()) and not out.isnan().any()
    out.sum().backward()
    assert torch.equal(q.grad[:, :, 1], torch.zeros(1, 2, 8, dtype=torch.float64))
    assert torch.equal(k.grad[:, :, 2:], torch.zeros(1, 2, 2, 8, dtype=torch.float64))
    assert not any(t.grad.isnan().any() for t in (q, k, v))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_causal_pieces_of_the_contiguous_layout(world):
    """Rank r of a contiguous layout: one call over the earlier ranks' keys and one causal call over its own
    (rank 0 only the causal one); with a mask, one piece per rank, the mask deciding; full attention: one."""
    layout = Layout(world)
    for rank in range(world):
        q_bounds, k_bounds, kinds = attention_pieces(layout, rank, causal=True, masked=False)
        assert q_bounds == [0, 1]
        assert (k_bounds, kinds) == (([0, 1], [CAUSAL]) if rank == 0 else ([0, rank, rank + 1], [FULL, CAUSAL]))
        assert attention_pieces(layout, rank, causal=True, masked=True) == (
            [0, 1], list(range(rank + 2)), [FULL] * (rank + 1))
        assert attention_pieces(layout, rank, causal=False, masked=False) == ([0, 1], [0, world], [FULL])
    assert SKIP not in attention_pieces(layout, world - 1, causal=True, masked=True)[2]


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_balanced_pieces_skip_every_key_block_after_the_queries(world):
    """Rank r of a balanced layout holds chunks r and 2P-1-r and is brought chunks 0..2P-1-r in global order: its
    head sees r earlier chunks whole and itself causally, its tail 2P-1-r chunks whole (its own head among them)
    and itself causally; every later chunk is skipped, so each rank computes 2P + 1 chunk-sized pieces (counting
    a causal one whole)."""
    layout = Layout(world, "balanced")
    for rank in range(world):
        brought = layout.prefix_chunks(rank)
        assert brought == 2 * world - rank
        q_bounds, k_bounds, kinds = attention_pieces(layout, rank, causal=True, masked=True)
        assert q_bounds == [0, 1, 2] and k_bounds == list(range(brought + 1))
        for i, mine in enumerate(layout.chunk_indices(rank)):
            row = kinds[i * brought:(i + 1) * brought]
            assert row == [FULL if c <= mine else SKIP for c in range(brought)], (rank, i)
        q_bounds, k_bounds, kinds = attention_pieces(layout, rank, causal=True, masked=False)
        sizes = [b - a for a, b in zip(k_bounds, k_bounds[1:])]
        computed = sum(sizes[j] for i in range(2) for j in range(len(sizes)) if kinds[i * len(sizes) + j] != SKIP)
        assert computed == 2 * world + 1, (rank, k_bounds, kinds)


@pytest.mark.parametrize("masked", [False, True])
def test_balanced_rank_attention_matches_one_device(masked):
    """Every rank of a balanced layout at P = 4 (two chunks of 3), its causal prefix brought in global order: block
    attention over its pieces gives one device's rows at its positions, causal or with documents (one spans
    three ranks), forward and gradients (fp64)."""
    torch.manual_seed(0)
    world, local, heads, dim = 4, 6, 2, 8
    layout = Layout(world, "balanced")
    q, k, v = (torch.randn(1, heads, world * local, dim, dtype=torch.float64, requires_grad=True) for _ in range(3))
    positions = torch.arange(world * local)
    allowed = positions[:, None] >= positions[None, :]
    if masked:
        allowed = allowed & (_documents(positions)[:, None] == _documents(positions)[None, :])
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    grad = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    got_grads = [torch.zeros_like(t) for t in (q, k, v)]
    for rank in range(world):
        rows = layout.positions(rank, local)
        gathered = positions[:layout.visible_prefix(rank, local)]
        q_units, k_units, kinds = attention_pieces(layout, rank, True, masked)
        mask = allowed[rows][:, gathered] if masked else None
        size = layout.chunk_len(local)
        out, _ = block_attention_op(q[:, :, rows], k[:, :, gathered], v[:, :, gathered], mask,
                                    [u * size for u in q_units], [u * size for u in k_units], kinds, dim ** -0.5)
        torch.testing.assert_close(out, want[:, :, rows], rtol=0, atol=1e-12)
        for total, part in zip(got_grads, torch.autograd.grad(out, (q, k, v), grad[:, :, rows])):
            total += part
    for got, expected in zip(got_grads, want_grads):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_a_masked_pair_computes_tiles_of_its_triangle():
    """A document mask's causal triangle over 1024 rows is cut into tiles of query rows, each computing the
    keys up to its last row: about half the square (not all of it), and the same values as SDPA."""
    torch.manual_seed(0)
    n = 1024
    q, k, v = (torch.randn(1, 1, n, 4, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    shapes = pair_shapes(q, k, v, mask, [0, n], [0, n], [FULL])
    computed = sum(a[2] * b[2] for a, b, _ in shapes)
    assert len(shapes) >= n // TILE_ROWS and n * (n + 1) // 2 <= computed <= 0.57 * n * n, (len(shapes),
                                                                                           computed / n / n)
    out, _ = block_attention_op(q, k, v, mask, [0, n], [0, n], [FULL], 0.5)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.5),
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("length", [24, 48, 200])
def test_short_documents_cost_their_own_squares_not_the_tiles(length):
    """Documents about a tile long or shorter (an interleaved row's pieces) sit on the diagonal: the pair computes each
    document's block, about its own square, not every tile's rows by all their keys; values as SDPA's."""
    torch.manual_seed(0)
    n = 1024
    q, k, v = (torch.randn(1, 1, n, 4, dtype=torch.float64) for _ in range(3))
    doc, pos = torch.arange(n) // length, torch.arange(n)
    mask = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    computed = sum(a[2] * b[2] for a, b, _ in pair_shapes(q, k, v, mask, [0, n], [0, n], [FULL]))
    squares = int((torch.bincount(doc) ** 2).sum())
    assert int(mask.sum()) <= computed <= 1.3 * squares, (computed, squares)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, _ = block_attention_op(q, k, v, mask, [0, n], [0, n], [FULL], 0.5)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.5)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    grad = torch.randn_like(want)
    for got, expected in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)


def test_flop_counter_counts_the_calls_block_attention_makes():
    """FlopCounterMode counts cp_passes::block_attention and its backward as the attention calls they make,
    each dense (as it counts SDPA): skipped key blocks cost nothing. Rank 3 of 4 (L queries), in units of
    L x L: contiguous 4 (every key); balanced 2P + 1 = 9 pieces of L/2 x L/2, 2.25. One device's causal
    pairs / P are 2."""
    from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

    world, local, shape = 4, 8, (1, 2, 1, 16)
    per_pair = sdpa_flop_count(shape, shape, shape) + sdpa_backward_flop_count(shape, shape, shape, shape)
    for kind, blocks in (("contiguous", 4), ("balanced", 2.25)):
        layout = Layout(world, kind)
        q = torch.randn(1, 2, local, 16, requires_grad=True)
        k, v = (torch.randn(1, 2, world * local, 16, requires_grad=True) for _ in range(2))
        q_units, k_units, kinds = attention_pieces(layout, 3, True, False)
        size = layout.chunk_len(local)
        with FlopCounterMode(display=False) as counter:
            out, _ = block_attention_op(q, k, v, None, [u * size for u in q_units], [u * size for u in k_units],
                                        kinds, 0.25)
            out.sum().backward()
        assert counter.get_total_flops() == blocks * local * local * per_pair, kind


def _hf_like_mask(position_ids, length: int):
    """transformers' packed-sequence mask: documents from position resets, indexed by query and key
    positions, causal, expanded over the batch."""
    first = position_ids[:, :1] - 1
    documents = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
    batch = torch.arange(position_ids.shape[0])[:, None, None, None]
    q_idx = torch.arange(length)[None, None, :, None]
    kv_idx = torch.arange(length)[None, None, None, :]
    causal = kv_idx <= q_idx
    same = documents[batch, q_idx] == documents[batch, kv_idx]
    return (torch.ones((), dtype=torch.bool) & causal & same).expand(position_ids.shape[0], -1, length, length)


def _toy_mask(doc_ids, length: int):
    pos = torch.arange(length)
    distance = pos[:, None] - pos[None, :]
    return ((distance >= 0) & (doc_ids[:, :, None] == doc_ids[:, None, :]))[:, None]


class _Shapes(torch.fx.Interpreter):
    """Runs a graph and records every tensor shape it computes."""

    def run_node(self, n):
        value = super().run_node(n)
        if isinstance(value, torch.Tensor):
            self.shapes.append(tuple(value.shape))
        return value


@pytest.mark.parametrize("build", [_hf_like_mask, _toy_mask])
def test_picked_mask_equals_the_whole_mask_cut_and_computes_nothing_square(build):
    """The picks move back to the per-position terms: the picked graph's value is the whole mask's rows and
    keys, and nothing it computes is larger than that (2 x 3 x 8 here; the whole mask is 2 x 12 x 12)."""
    length = 12
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2]])
    data = position_ids if build is _hf_like_mask else torch.cumsum(position_ids == 0, -1)
    rows, keys = torch.tensor([6, 7, 8]), torch.arange(8)
    gm = make_fx(lambda x, picked_rows, picked_keys: build(x, length))(data, rows, keys)
    (output,) = gm.graph.find_nodes(op="output")
    _, row_node, key_node = gm.graph.find_nodes(op="placeholder")
    with gm.graph.inserting_before(output):
        output.args = (Selector(gm.graph)(output.args[0], ((2, row_node), (3, key_node))),)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    run = _Shapes(gm)
    run.shapes = []
    got = run.run(data, rows, keys)
    assert torch.equal(got, build(data, length)[:, :, rows][:, :, :, keys])
    assert max(math.prod(shape) for shape in run.shapes) == 2 * 3 * 8, run.shapes  # batch x rows x keys


def test_document_mask_computes_only_the_rectangles_its_documents_reach(monkeypatch):
    """Rank 2 of 3 at 6 tokens (queries 12..17, keys 0..17), documents [0, 10), [10, 14), [14, 18): no local
    query sees keys 0..5, so that key piece costs nothing; of 6..11 only keys 10..11 for queries 12..13; of its
    own piece the rows all, keys 12..17."""
    from cp_passes.transports import block_attention

    calls = []
    attend = block_attention.attend

    def counted(q, k, v, mask, causal, scale, math=False):
        calls.append((q.shape[-2], k.shape[-2]))
        return attend(q, k, v, mask, causal, scale, math)

    monkeypatch.setattr(block_attention, "attend", counted)
    q_pos, k_pos = torch.arange(12, 18), torch.arange(18)
    doc = torch.bucketize(torch.arange(18), torch.tensor([10, 14]), right=True)
    mask = (q_pos[:, None] >= k_pos[None, :]) & (doc[q_pos][:, None] == doc[k_pos][None, :])
    q, k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 18, 8), torch.randn(1, 2, 18, 8)
    block_attention_op(q, k, v, mask, [0, 6], [0, 6, 12, 18], [FULL] * 3, 8 ** -0.5)
    assert calls == [(2, 2), (6, 6)]


@pytest.mark.parametrize("three_dims", [False, True])
def test_values_wider_than_keys_and_3d_inputs_take_the_math_path_in_row_blocks(monkeypatch, three_dims):
    """The CPU flash kernel takes [batch, heads, seq, dim] with values as wide as keys; MLA-style values (12
    wide against keys of 8) and 3-D inputs go through the matmul-softmax path, here in blocks of one or two
    query rows (a causal pair's triangle shifted with each block)."""
    from cp_passes.transports import block_attention

    monkeypatch.setattr(block_attention, "MATH_BLOCK", 50)
    torch.manual_seed(0)
    lead = (2,) if three_dims else (2, 4)
    q = torch.randn(*lead, 6, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(*lead, 18, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(*lead, 18, 12, dtype=torch.float64, requires_grad=True)
    out, _ = block_attention_op(q, k, v, None, [0, 6], [0, 12, 18], [FULL, CAUSAL], 8 ** -0.5)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.arange(12, 18)[:, None] >= torch.arange(18))
    grad = torch.randn_like(want)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    for got, expected in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_a_mask_broadcast_over_queries_is_read_for_every_row():
    """A mask of shape [.., 1, keys] stands for every query row: each pair computes all of its rows."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, dtype=torch.float64) for _ in range(3))
    keys = torch.tensor([True, False, True, True])
    out, _ = block_attention_op(q, k, v, keys[None, :], [0, 4], [0, 4], [FULL], 8 ** -0.5)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=keys[None, :])
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("world,kind,length,before,after,left_padding", [
    (2, "contiguous", 16, 3, 0, 0),     # a window shorter than a shard
    (4, "balanced", 32, 7, 2, 0),       # two-sided, the halo spans three chunks
    (2, "balanced", 64, 40, 0, 0),      # the window longer than a shard: rows the rank holds come back in a halo
    (4, "contiguous", 600, 300, 10, 2),  # several tiles per range, left padding
])
def test_window_attention_matches_a_banded_sdpa_at_every_rank(world, kind, length, before, after, left_padding):
    """cp_passes::window_attention on each rank's halo (built here from the whole K/V at the layout's halo
    positions, zeros outside the sequence) gives that rank's rows of SDPA with the band mask, forward and every
    gradient (K/V's summed back to their positions), grouped-query heads included. fp64."""
    from cp_passes.transports.window_attention import window_attention_op

    torch.manual_seed(0)
    layout, local, dim = Layout(world, kind), length // world, 8
    q = torch.randn(2, 4, length, dim, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, length, dim, dtype=torch.float64, requires_grad=True) for _ in range(2))
    distance = torch.arange(length)[:, None] - torch.arange(length)[None, :]
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                          attn_mask=(distance <= before) & (distance >= -after))
    grad = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    got_k, got_v = torch.zeros_like(k), torch.zeros_like(v)
    for rank in range(world):
        rows = layout.positions(rank, local)
        keys = layout.halo_positions(before, rank, local, None, left_padding, after)
        inside = keys >= 0
        mine = q.detach()[..., rows, :].requires_grad_()
        halo_k, halo_v = (torch.where(inside[:, None], x.detach()[..., keys.clamp(min=0), :], 0).requires_grad_()
                          for x in (k, v))
        out, _ = window_attention_op(mine, halo_k, halo_v, rank, world, kind, before, after, dim ** -0.5)
        torch.testing.assert_close(out, want[..., rows, :], rtol=0, atol=1e-12)
        dq, dk, dv = torch.autograd.grad(out, (mine, halo_k, halo_v), grad[..., rows, :])
        torch.testing.assert_close(dq, want_grads[0][..., rows, :], rtol=0, atol=1e-12)
        got_k.index_add_(-2, keys[inside], dk[..., inside, :])
        got_v.index_add_(-2, keys[inside], dv[..., inside, :])
    torch.testing.assert_close(got_k, want_grads[1], rtol=0, atol=1e-12)
    torch.testing.assert_close(got_v, want_grads[2], rtol=0, atol=1e-12)


def test_window_attention_computes_at_most_one_and_a_half_bands():
    """FlopCounterMode counts the op's tiles: a window of 512 over 4096 queries costs at most 1.5x the band
    (rows x window scores), against 8x for the whole local square."""
    from torch.utils.flop_counter import FlopCounterMode

    from cp_passes.transports.window_attention import window_attention_op

    local, before, dim = 4096, 511, 16
    q = torch.randn(1, 2, local, dim)
    k, v = (torch.randn(1, 2, local + before, dim) for _ in range(2))
    with FlopCounterMode(display=False) as counter:
        window_attention_op(q, k, v, 1, 2, "contiguous", before, 0, dim ** -0.5)
    band = 4 * 2 * local * (before + 1) * dim  # two matmuls of 2 flops per multiply-add, per head
    assert band < counter.get_total_flops() <= 1.5 * band
