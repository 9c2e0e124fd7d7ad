"""Halo exchange: exactly the preceding positions (and for a two-sided window the following ones), across as
many ranks as the halo spans."""

import pytest
import torch

import cp_passes
from cp_passes.layout import Layout


def halo_counts(halo, local, rank, world):
    return Layout(world).halo_counts(halo, rank, local)


@pytest.mark.parametrize("halo,local,world", [(2, 6, 2), (6, 6, 2), (9, 3, 4), (10, 3, 4), (1, 4, 4), (0, 4, 4)])
def test_every_rank_receives_exactly_the_halo(halo, local, world):
    sends, recvs = [], []
    for rank in range(world):
        send, recv, zeros = halo_counts(halo, local, rank, world)
        sends.append(send)
        recvs.append(recv)
        assert sum(recv) + zeros == halo  # the lower bound: halo rows, of which only real ones move
        assert sum(recv) == min(halo, rank * local)
        assert all(0 <= c <= local for c in send + recv)
    for q in range(world):  # what q sends to r is what r receives from q
        for r in range(world):
            assert sends[q][r] == recvs[r][q]


@pytest.mark.parametrize("halo,after,local,world", [(2, 2, 6, 2), (6, 3, 6, 2), (9, 10, 3, 4), (0, 4, 4, 4)])
def test_a_two_sided_halo_receives_exactly_the_rows_on_both_sides(halo, after, local, world):
    """A bidirectional window: ``halo`` rows before and ``after`` after each rank's, from as many ranks as they
    span; positions outside the sequence are zeros, not moved."""
    layout = Layout(world)
    counts = [layout.halo_counts(halo, rank, local, after) for rank in range(world)]
    for rank, (send, recv, zeros) in enumerate(counts):
        assert sum(recv) + zeros == halo + after
        assert sum(recv) == min(halo, rank * local) + min(after, (world - 1 - rank) * local)
        for q in range(world):
            assert counts[q][0][rank] == recv[q]


@pytest.mark.parametrize("halo,local,world", [(1, 4, 2), (2, 4, 2), (5, 4, 4), (9, 2, 4), (3, 8, 8), (13, 4, 4)])
def test_balanced_halos_move_exactly_the_rows_other_ranks_hold(halo, local, world):
    """Two ranges per rank, each with its own halo: rows held by another rank move, once where the two halos
    overlap (a halo longer than a chunk), a row the rank holds itself (the middle rank's tail follows its head)
    is copied, and send matches receive."""
    layout = Layout(world, "balanced")
    counts = [layout.halo_counts(halo, rank, local) for rank in range(world)]
    for rank, (send, recv, zeros) in enumerate(counts):
        before = [p for start, _ in layout.ranges(rank, local) for p in range(start - halo, start)]
        owned = set(layout.positions(rank, local).tolist())
        assert zeros == sum(p < 0 for p in before)
        assert sum(recv) == len({p for p in before if p >= 0 and p not in owned})
        assert recv[rank] == send[rank] == 0
        for q in range(world):
            assert counts[q][0][rank] == recv[q]


def _padded(seq_len: int, padded: int) -> torch.Tensor:
    """The scenarios' global ``x`` as shard_batch pads it (zeros)."""
    x = torch.arange(2 * seq_len * 3, dtype=torch.float32).view(2, seq_len, 3)
    return torch.cat([x, x.new_zeros(2, padded - seq_len, 3)], 1)


@pytest.mark.parametrize("kind", ["contiguous", "balanced"])
@pytest.mark.parametrize("P,halo,left_padding,after", [(2, 2, 0, 0), (2, 6, 2, 0), (4, 9, 0, 0), (4, 10, 1, 0),
                                                       (4, 4, 0, 9), pytest.param(2, 3, 0, 5, marks=pytest.mark.full)])
def test_gather_halo_matches_global_slices_and_returns_gradients(pool, P, halo, left_padding, after, kind):
    """Each of a rank's ranges gets its own halo (a balanced layout's two: rows from several ranks, and on the
    middle rank the tail's halo from its own head); with ``after``, the rows after each range too (a two-sided
    window), zeros past the end."""
    per_rank = pool.run(halo_roundtrip, P, seq_len=12, halo=halo, left_padding=left_padding, kind=kind, after=after)
    x = _padded(12, per_rank[0]["padded"])
    expected_grad = torch.zeros(x.shape[1])
    for r in per_rank:
        pieces, at = [], 0
        for start, stop in r["ranges"]:
            pieces.append(torch.zeros(2, left_padding, 3))
            at += left_padding
            for p in range(start - halo, stop + after):
                inside = 0 <= p < x.shape[1]
                pieces.append(x[:, p:p + 1] if inside else torch.zeros(2, 1, 3))
                if inside:
                    expected_grad[p] += at
                at += 1
        assert torch.equal(r["out"], torch.cat(pieces, 1)), (kind, r["ranges"])
    for r in per_rank:
        assert torch.equal(r["grad"], expected_grad[r["positions"]][None, :, None].expand_as(r["grad"]))


@pytest.mark.parametrize("kind", ["contiguous", "balanced"])
def test_shift_reads_position_t_plus_offset_across_ranks_and_returns_gradients(pool, kind):
    """cp_passes::shift at P = 4: offsets within a rank, spanning two ranks, past the end; a balanced layout's
    ranges read across its head and tail too."""
    seq_len, P, offsets = 12, 4, [1, -1, 3, 5, -7, 13, 0]
    per_rank = pool.run(shift_roundtrip, P, seq_len=seq_len, offsets=offsets, kind=kind)
    x = _padded(seq_len, per_rank[0][0]["padded"])
    total = x.shape[1]
    for k, offset in enumerate(offsets):
        expected_grad = torch.zeros(total)
        for results in per_rank:
            positions = results[k]["positions"].tolist()
            rows = [x[:, p + offset] if 0 <= p + offset < total else torch.full((2, 3), -1.0) for p in positions]
            assert torch.equal(results[k]["out"], torch.stack(rows, dim=1)), (offset, positions)
            for i, p in enumerate(positions):
                if 0 <= p + offset < total:
                    expected_grad[p + offset] += i + 1
        for results in per_rank:
            want = expected_grad[results[k]["positions"]][None, :, None].expand(2, -1, 3)
            assert torch.equal(results[k]["grad"], want), (offset, kind)


@pytest.mark.parametrize("kind", ["contiguous", "balanced"])
def test_prefix_gather_brings_every_earlier_position_and_returns_gradients(pool, kind):
    """Causal attention's keys at P = 4: every position before the end of the rank's last range, in global order
    (a balanced rank's tail range sees all but the chunks after it), and no other; each row's gradient returns
    to its owner, summed over the ranks that read it."""
    per_rank = pool.run(prefix_roundtrip, 4, seq_len=16, kind=kind)
    x = _padded(16, per_rank[0]["padded"])
    expected_grad = torch.zeros(x.shape[1])
    for r in per_rank:
        last = int(r["positions"].max()) + 1
        assert torch.equal(r["out"], x[:, :last]), (kind, last)
        expected_grad[:last] += torch.arange(last, dtype=torch.float32)
    for r in per_rank:
        assert torch.equal(r["grad"], expected_grad[r["positions"]][None, :, None].expand_as(r["grad"]))


@pytest.mark.parametrize("kind", ["contiguous", "balanced"])
def test_prefix_gather_from_first_keys_brings_each_ranges_documents_only(pool, kind):
    """Packed documents at P = 4, S = 16 (documents 0-6, 7-8, 9-15: the first spans three ranks on either
    layout): from each range's first key its document mask shows to the range's end, the rows are the global
    tensor's and the rest zeros; gradients return only for the rows that came."""
    starts = [0] * 7 + [7] * 2 + [9] * 7
    per_rank = pool.run(prefix_roundtrip, 4, seq_len=16, kind=kind, doc_starts=starts)
    x = _padded(16, per_rank[0]["padded"])
    expected_grad = torch.zeros(x.shape[1])
    for r in per_rank:
        last = int(r["positions"].max()) + 1
        needed = torch.zeros(last, dtype=torch.bool)
        for start, stop in _ranges(r["positions"]):
            needed[starts[start]:stop] = True
        assert torch.equal(r["out"], torch.where(needed[None, :, None], x[:, :last], 0)), (kind, needed)
        expected_grad[:last] += torch.where(needed, torch.arange(last, dtype=torch.float32), 0)
    for r in per_rank:
        assert torch.equal(r["grad"], expected_grad[r["positions"]][None, :, None].expand_as(r["grad"]))


def _ranges(positions: torch.Tensor) -> list[tuple[int, int]]:
    """The runs of consecutive positions a rank holds, ``(start, stop)``."""
    breaks = [0] + [i for i in range(1, len(positions)) if positions[i] != positions[i - 1] + 1] + [len(positions)]
    return [(int(positions[a]), int(positions[b - 1]) + 1) for a, b in zip(breaks, breaks[1:])]


# Tasks the worker pool's ranks run (pool.run(task, P, ...)).


def shift_roundtrip(group, seq_len: int, offsets: list[int], kind: str = "contiguous") -> list[dict]:
    """cp_passes::shift against reading the global tensor at t + offset; gradients go back to the owners."""
    from cp_passes.group import resolve_group
    from cp_passes.transports.shift import shift_op

    cp = resolve_group(group)
    x_global = torch.arange(2 * seq_len * 3, dtype=torch.float32).view(2, seq_len, 3)
    local, shard = cp_passes.shard_batch({"x": x_global}, group, cp_passes.CPSpec(seq_inputs=("x",), layout=kind))
    results = []
    for offset in offsets:
        x = local["x"].clone().requires_grad_()
        out = shift_op(x, 1, offset, -1.0, cp.rank, cp.size, cp.name, shard.layout.kind)
        (out * torch.arange(1, out.shape[1] + 1, dtype=torch.float32)[None, :, None]).sum().backward()
        results.append({"out": out.detach(), "grad": x.grad, "positions": shard.positions,
                        "padded": shard.padded_len})
    return results


def halo_roundtrip(group, seq_len: int, halo: int, left_padding: int, kind: str = "contiguous", after: int = 0) -> dict:
    """gather_halo against slicing the global tensor; gradients go back to the owners."""
    x_global = torch.arange(2 * seq_len * 3, dtype=torch.float32).view(2, seq_len, 3)
    local, shard = cp_passes.shard_batch({"x": x_global}, group, cp_passes.CPSpec(seq_inputs=("x",), layout=kind))
    x = local["x"].requires_grad_()
    out = cp_passes.gather_halo(x, group, halo, dim=1, left_padding=left_padding, layout=shard, after=after)
    (out * torch.arange(out.shape[1], dtype=torch.float32)[None, :, None]).sum().backward()
    return {"out": out.detach(), "grad": x.grad, "ranges": shard.slices[shard.rank], "positions": shard.positions,
            "padded": shard.padded_len}


def prefix_roundtrip(group, seq_len: int, kind: str, doc_starts: list | None = None) -> dict:
    """cp_passes::prefix_gather against slicing the global tensor; gradients go back to the owners. With
    ``doc_starts`` (each position's document start), the first keys a document mask shows are passed too."""
    from cp_passes.transports.prefix_exchange import prefix_gather_op
    from cp_passes.transports.masks import first_keys

    x_global = torch.arange(2 * seq_len * 3, dtype=torch.float32).view(2, seq_len, 3)
    local, shard = cp_passes.shard_batch({"x": x_global}, group, cp_passes.CPSpec(seq_inputs=("x",), layout=kind))
    x = local["x"].requires_grad_()
    firsts = None
    if doc_starts is not None:
        starts, queries = torch.tensor(doc_starts), shard.positions
        keys = torch.arange(int(queries.max()) + 1)
        firsts = first_keys((starts[queries][:, None] == starts[keys][None, :]) & (keys <= queries[:, None]),
                            x, group.size(), kind)
    out = prefix_gather_op(x, 1, group.rank(), group.size(), group.group_name, kind, firsts)
    (out * torch.arange(out.shape[1], dtype=torch.float32)[None, :, None]).sum().backward()
    return {"out": out.detach(), "grad": x.grad, "positions": shard.positions, "padded": shard.padded_len}
