"""A toy key move, written from CONTRIBUTING's "Adding a key move" alone: a ring that brings the causal prefix one
rank at a time (rank r receives the shards of r - 1, r - 2, ..., 0 in r hops), registered for ``Move.PREFIX`` in
place of the one all_to_all. Rules, plans and the attention rewrite are untouched; the table and the graph show
the ring, and a model over it matches one device."""

from __future__ import annotations

import contextlib

import pytest
import torch

import cp_passes
from cp_passes.key_plan import Move
from cp_passes.layout import CONTIGUOUS
from cp_passes.transports.base import Cost
from cp_passes.transports.key_move import MOVERS, KeyMover, register_mover
from parity import compare, toy_reference
from shared import toy_parity

WAIT = torch.ops._c10d_functional.wait_tensor.default


def ring_prefix(x: torch.Tensor, dim: int, rank: int, world: int, group_name: str) -> torch.Tensor:
    """Every position before the end of this rank's shard, in global order along ``dim``: at hop ``s`` each rank
    hands the shard it got at hop ``s - 1`` (its own at hop 1) to the next rank. Differentiable: the functional
    all_to_all's backward hands each gradient back along the ring."""
    rows = x.movedim(dim, 0)
    n, pieces, passing = rows.shape[0], [rows], rows
    for hop in range(1, world):
        sends = rank + 1 < world and rank + 1 - hop >= 0
        receives = rank - hop >= 0
        send = [n if sends and q == rank + 1 else 0 for q in range(world)]
        recv = [n if receives and q == rank - 1 else 0 for q in range(world)]
        # Nothing to send: zero rows of the last hop's buffer, a new input at every hop, so that no two idle hops
        # are the same node (common-subexpression elimination would merge them and this rank skip a hop).
        idle = pieces[0].narrow(0, 0, 0)
        out = torch.ops._c10d_functional_autograd.all_to_all_single(
            (passing if sends else idle).contiguous(), recv, send, group_name)
        out = WAIT(out)
        pieces.insert(0, out)  # zero rows where nothing came: every rank joins every hop, none is dropped as unused
        if receives:
            passing = out
    return torch.cat(pieces).movedim(0, dim)


class RingPrefix(KeyMover):
    move = Move.PREFIX
    layouts = (CONTIGUOUS,)
    runtime = (ring_prefix,)

    def insert(self, edit, x, dim, plan, name, *, firsts, left_padding, global_order, metadata):
        return edit.insert(ring_prefix, (x, dim, edit.rank, edit.world, edit.group_name), name=name)

    def cost(self, plan, layout, rank, local_len, row, itemsize, what, metadata):
        received = rank * local_len * row
        sent = (rank + 1) * local_len * row if rank + 1 < layout.world else 0
        return Cost(f"ring of {layout.world - 1} hops ({what or 'rows'}, causal prefix) | bw ring",
                    received // itemsize, received, received, sent)


@contextlib.contextmanager
def ring_moves_the_prefix():
    original = MOVERS[Move.PREFIX]
    register_mover(RingPrefix(), replace=True)
    try:
        yield
    finally:
        register_mover(original, replace=True)


def ring_parity(group, **kwargs) -> list[dict]:
    with ring_moves_the_prefix():
        return toy_parity(group, **kwargs)


def test_the_ring_moves_the_causal_prefix_on_the_table_and_in_the_graph(fake_group):
    """Rank 3 of 8, contiguous: the ring receives 3 shards of K+V in 7 hops, the lower bound; the
    all_to_all of the built-in prefix move is gone from the forward, and the rank joins every hop of the ring, also
    those that move nothing to or from it (a hop dropped as unused would leave the others waiting)."""
    torch.manual_seed(0)
    model = cp_passes.tools.models.ToyLlama(cp_passes.tools.models.ToyLlamaConfig(n_layers=2))
    with ring_moves_the_prefix():
        compiled = cp_passes.cp_compile(model, cp_passes.CPSpec(layout="contiguous"), mesh=fake_group,
                                        backend="aot_eager", verbose=False)
        ids = torch.randint(0, 256, (2, 16))
        loss, _ = compiled(ids, labels=ids)
    record = compiled.compile_records[-1]
    rows = [r for r in record.records if r.rule == "sdpa_causal"]
    assert len(rows) == 2
    for row in rows:
        assert row.collective.startswith("ring of 7 hops (K+V, causal prefix)"), row.collective
        assert row.bytes == row.lower_bound_bytes > 0
    forward = record.aot_ops["forward"]
    assert forward.get("cp_passes.prefix_pack.default", 0) == 0
    assert forward.get("_c10d_functional.all_to_all_single.default", 0) == 2 * 7


@pytest.mark.full
def test_the_ring_matches_one_device(pool, parity_report):
    """P = 3 on real gloo processes (two hops to the last rank), forward and gradients."""
    config, seq_lens = {"kv_repeat": "sdpa"}, [12]
    per_rank = pool.run(ring_parity, 3, backend="aot_eager", config=config, seq_lens=seq_lens, pass_positions=True,
                        spec={"layout": "contiguous"})
    compare("toy-ring-prefix", [r[0] for r in per_rank], *toy_reference(config, 12, True), 12, parity_report)
    assert any(rec[0] == "sdpa_causal" for rec in per_rank[-1][0]["records"])
