"""Halo exchange: exactly the preceding positions, across as many ranks as the halo spans."""

import pytest
import torch

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


@pytest.mark.parametrize("P,halo,left_padding", [(2, 2, 0), (2, 6, 2), (4, 9, 0), (4, 10, 1)])
def test_gather_halo_matches_global_slices_and_returns_gradients(pool, P, halo, left_padding):
    seq_len = 12
    local = seq_len // P
    per_rank = pool.run("halo_roundtrip", P, seq_len=seq_len, halo=halo, left_padding=left_padding)
    x = torch.arange(2 * seq_len * 3, dtype=torch.float32).view(2, seq_len, 3)
    expected_grad = torch.zeros(seq_len)
    for rank, r in enumerate(per_rank):
        start = rank * local
        rows = [torch.zeros(2, 3) if p < 0 else x[:, p] for p in range(start - halo, start + local)]
        expected = torch.cat([torch.zeros(2, left_padding, 3), torch.stack(rows, dim=1)], dim=1)
        assert torch.equal(r["out"], expected)
        for i, p in enumerate(range(start - halo, start + local)):
            if p >= 0:
                expected_grad[p] += left_padding + i
    for rank, r in enumerate(per_rank):
        want = expected_grad[rank * local:(rank + 1) * local][None, :, None].expand(2, local, 3)
        assert torch.equal(r["grad"], want)


def test_shift_reads_position_t_plus_offset_across_ranks_and_returns_gradients(pool):
    """cp_passes::shift at P = 4, 3 rows per rank: offsets within a rank, spanning two ranks, past the end."""
    seq_len, P, offsets = 12, 4, [1, -1, 3, 5, -7, 13, 0]
    local = seq_len // P
    per_rank = pool.run("shift_roundtrip", P, seq_len=seq_len, offsets=offsets)
    x = torch.arange(2 * seq_len * 3, dtype=torch.float32).view(2, seq_len, 3)
    for k, offset in enumerate(offsets):
        expected_grad = torch.zeros(seq_len)
        for rank, results in enumerate(per_rank):
            rows = [x[:, p] if 0 <= p < seq_len else torch.full((2, 3), -1.0)
                    for p in range(rank * local + offset, (rank + 1) * local + offset)]
            assert torch.equal(results[k]["out"], torch.stack(rows, dim=1)), (offset, rank)
            for i, p in enumerate(range(rank * local + offset, (rank + 1) * local + offset)):
                if 0 <= p < seq_len:
                    expected_grad[p] += i + 1
        for rank, results in enumerate(per_rank):
            want = expected_grad[rank * local:(rank + 1) * local][None, :, None].expand(2, local, 3)
            assert torch.equal(results[k]["grad"], want), (offset, rank)
