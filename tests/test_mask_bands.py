"""Masks read from their structure (cp_passes.match.mask_bands): every reading holds for the mask evaluated at
several lengths (exactly, where it says exact), and the common forms read as the band they are, at any length."""

import math

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from cp_passes.match.mask_bands import SymbolicReach, read_formula
from cp_passes.match.mask_replay import positions, replay

INF = math.inf
NEG = torch.finfo(torch.float32).min


def _grid(pos):
    return pos[:, None], pos[None, :]


def causal(pos):
    q, k = _grid(pos)
    return k <= q


def window(pos):  # transformers' sliding_window_overlay and causal_mask_function, anded
    q, k = _grid(pos)
    return q.new_ones((), dtype=torch.bool) & (k > q - 4096) & (k <= q)


def window_as_distance(pos):
    q, k = _grid(pos)
    return ((q - k) < 3) & ((q - k) >= 0)


def window_negated(pos):  # "not later, not too far back"
    q, k = _grid(pos)
    return ~(k > q) & ~(q - k >= 5)


def strictly_causal(pos):
    q, k = _grid(pos)
    return k < q


def two_sided(pos):  # transformers' sliding_window_bidirectional_overlay
    q, k = _grid(pos)
    return (torch.abs(q - k) <= 3) & (q >= 0)


def bidirectional(pos):
    q, k = _grid(pos)
    return (q >= 0) | (k > q)


def chunked(pos):  # Llama 4's chunked attention
    q, k = _grid(pos)
    return ((k - 0) // 4 == (q - 0) // 4) & (k <= q)


def offset_positions(pos):
    q, k = _grid(pos + 7)
    return (k <= q) & (k < pos.shape[0] + 7)


def additive(pos):
    q, k = _grid(pos)
    return torch.where(k <= q, 0.0, NEG)


def packed_from_positions(pos):  # transformers' find_packed_sequence_indices on positions 0..S-1
    ids = pos[None, :]
    doc = (torch.diff(ids, dim=-1, prepend=ids[:, :1] - 1) != 1).cumsum(-1)
    q, k, row = pos[None, :, None], pos[None, None, :], torch.zeros(1, dtype=torch.long)[:, None, None]
    return (doc[row, q] == doc[row, k]) & (k <= q)


def late_rows_see_everything(pos):  # an adversary: a band, except the queries past 20 see every key
    q, k = _grid(pos)
    return ((k <= q) & (k > q - 4)) | (q > 20)


def band_then_tril(pos):  # an op the replay does not model (tril): the band still bounds it
    q, k = _grid(pos)
    return ((k <= q) & (k > q - 4)) & torch.ones(pos.shape[0], pos.shape[0], dtype=torch.bool).tril()


def either_side(pos):  # two disjoint bands: only their hull is known
    q, k = _grid(pos)
    return (q - k == 3) | (k - q == 3)


def from_data(pos):
    q, k = _grid(pos)
    return (k <= q) & (torch.sin(q.float()) > 0)


EXPECTED = [
    (causal, SymbolicReach(0, INF, True)),
    (window, SymbolicReach(0, 4095, True)),
    (window_as_distance, SymbolicReach(0, 2, True)),
    (window_negated, SymbolicReach(0, 4, True)),
    (strictly_causal, SymbolicReach(1, INF, True)),
    (two_sided, SymbolicReach(-3, 3, True)),
    (bidirectional, SymbolicReach(-INF, INF, True)),
    (chunked, SymbolicReach(0, 3, False)),
    (offset_positions, SymbolicReach(0, INF, True)),
    (additive, SymbolicReach(0, INF, True)),
    (packed_from_positions, SymbolicReach(0, INF, True)),
    (late_rows_see_everything, SymbolicReach(-INF, INF, False)),
    (band_then_tril, SymbolicReach(0, 3, False)),
    (either_side, SymbolicReach(-3, 3, False)),
    (from_data, SymbolicReach(0, INF, False)),
]


def _read(build) -> SymbolicReach:
    gm = make_fx(lambda p: build(p), tracing_mode="symbolic")(torch.arange(48))
    (leaf,) = gm.graph.find_nodes(op="placeholder")
    (mask,) = next(iter(gm.graph.find_nodes(op="output"))).args
    return read_formula(replay(mask, {leaf: positions(leaf.meta["val"].shape, 0)}))


@pytest.mark.parametrize("build,expected", EXPECTED, ids=[b.__name__ for b, _ in EXPECTED])
def test_a_mask_reads_as_its_band_at_every_length(build, expected):
    reading = _read(build)
    assert reading == expected
    for n in (5, 23, 130):
        shown = build(torch.arange(n))
        shown = shown if shown.dtype == torch.bool else shown == 0
        assert reading.holds(shown.reshape(n, n)), (n, reading)


def test_a_window_is_read_without_evaluating_it():
    """A window of 65,536 at a million positions: nothing of that size is built."""
    def wide(pos):
        q, k = _grid(pos)
        return (k <= q) & (k > q - 65536)

    assert _read(wide).reach.window == 65536


def test_a_reading_that_disagrees_with_the_mask_is_caught():
    assert not SymbolicReach(0, 2, True).holds(causal(torch.arange(9)))
    assert not SymbolicReach(0, INF, True).holds(window_as_distance(torch.arange(9)))
    assert SymbolicReach(0, INF, False).holds(window_as_distance(torch.arange(9)))
