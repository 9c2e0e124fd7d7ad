"""How many graphs a halo model compiles as the local length varies: one for every length, shards shorter than
the halo included, on a fake process group (one process, aot_eager)."""

import contextlib

import pytest
import torch
import torch.distributed as dist

import cp_passes
from cp_passes.layout import Layout
from cp_passes.tools.models import ToyLlama, ToyLlamaConfig

WORLD = 4


def needed_rows(halo, local, rank, source):
    """Rows rank ``rank`` needs from rank ``source``: global ``[rank*L - halo, rank*L) & [source*L, (source+1)*L)``."""
    start, stop = rank * local - halo, rank * local
    return max(0, min(stop, (source + 1) * local) - max(start, source * local))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("halo", range(1, 13))
def test_halo_counts_are_the_rows_each_rank_needs(world, halo):
    for local in range(1, 13):
        for rank in range(world):
            send, recv, zeros = Layout(world).halo_counts(halo, rank, local)
            assert recv == [needed_rows(halo, local, rank, q) for q in range(world)], (local, rank)
            assert send == [needed_rows(halo, local, r, rank) for r in range(world)], (local, rank)
            assert zeros == Layout(world).leading_zeros(halo, rank, local) == max(0, halo - rank * local), (local, rank)


@contextlib.contextmanager
def fake_rank(rank, world):
    """Rank ``rank`` of a fake process group of ``world`` ranks as the default group, for this block only."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():  # another module's fake group; those modules make a new one when they need it
        assert dist.get_backend() == "fake", dist.get_backend()
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def run_lengths(group, lengths, spec=None, doc_ids=False, backward=True, layout="contiguous", **config):
    """Call a ToyLlama compiled on ``group`` at each local length (one document per row with ``doc_ids``);
    return the module."""
    torch.manual_seed(0)
    model = ToyLlama(ToyLlamaConfig(n_layers=1, **config))
    spec = (spec or cp_passes.CPSpec()).replace(layout=layout)
    compiled = cp_passes.cp_compile(model, spec, mesh=group, backend="aot_eager", verbose=False)
    last = dist.get_rank(group) == dist.get_world_size(group) - 1
    for length in lengths:
        ids = torch.randint(0, 256, (2, length))
        inputs = dict(labels=ids, doc_ids=torch.zeros_like(ids)) if doc_ids else dict(labels=ids)
        if last and layout == "contiguous":
            # The fake group cannot run an all_to_all with nothing to send (the last rank's halo forward):
            # the graph compiles, then the fake collective refuses to run. In a balanced layout every rank
            # sends rows of one of its ranges.
            with pytest.raises(RuntimeError, match="inputBuffer is empty"):
                compiled(ids, **inputs)
        else:
            loss, _ = compiled(ids, **inputs)
            if backward:
                loss.backward()
    return compiled


WINDOW5 = cp_passes.CPSpec(attention=(cp_passes.AttentionRule("layers.*.attn", window=5),))


LENGTH_CONFIGS = {
    "window5_conv4": (dict(window=5, conv_kernel=4), range(2, 17)),  # halos 4 (attention) and 3 (conv)
    "window10": (dict(window=10), range(3, 15)),  # halo 9 (at local length 2 the global 8 cannot show the window)
    "doc_mask_window5": (dict(window=5, spec=WINDOW5, doc_ids=True), range(2, 9)),  # a doc-id mask cut to the halo
}
DEFAULT_LENGTHS = {("window5_conv4", "contiguous", 3), ("doc_mask_window5", "balanced", 3)}


@pytest.mark.parametrize("rank,config,lengths,layout", [
    pytest.param(rank, *LENGTH_CONFIGS[name], layout, id=f"{name}-{rank}-{layout}",
                 marks=() if (name, layout, rank) in DEFAULT_LENGTHS else pytest.mark.full)
    for name in LENGTH_CONFIGS for rank in (1, 3) for layout in ("contiguous", "balanced")])
def test_one_graph_for_every_length(rank, config, lengths, layout):
    """The halo's row counts are computed at run time inside cp_passes::halo and the masks from the layout's
    positions, so no length guard is added: shards shorter than the halo (spanning several ranks) included.
    A balanced layout's guard is that the local length is even (shard_batch pads to a multiple of 2P), and its
    ranges, like a contiguous shard, are at least 2 long (a length of 1 specializes as every size 1 does)."""
    lengths = [n for n in lengths if layout == "contiguous" or (n % 2 == 0 and n >= 4)]
    with fake_rank(rank, WORLD) as group:
        compiled = run_lengths(group, lengths, layout=layout, **config)
        assert [r.local_len for r in compiled.compile_records] == [lengths[0]]
        assert "cp_passes: 1 graph compiled\n  graph 0: local length " in cp_passes.explain(compiled, print_table=False)


def test_explain_counts_graphs_and_says_why_a_length_recompiled():
    with fake_rank(1, WORLD) as group:
        # window 10: at local length 2 the global 8 is causal, guarded to lengths within the window; 3 shows it
        compiled = run_lengths(group, [2, 3, 5], window=10)
        text = cp_passes.explain(compiled, print_table=False)
    assert [r.local_len for r in compiled.compile_records] == [2, 3]
    lines = text.splitlines()
    assert lines[0] == "cp_passes: spec 'default' (given)"
    assert lines[1:3] == ["cp_passes: 2 graphs compiled", "  graph 0: local length 2"]
    assert lines[3].startswith("  graph 1: local length 3; recompiled because ") and "input_ids" in lines[3]
    assert "4*input_ids.size()[1] <= 10" in lines[3]  # causal while the sequence is no longer than the window


CONFIGS = {"window6": dict(window=6), "window10_conv4": dict(window=10, conv_kernel=4),
           "doc_mask_window6": dict(window=6, doc_ids=True, spec=cp_passes.CPSpec(
               attention=(cp_passes.AttentionRule("layers.*.attn", window=6),)))}


@pytest.mark.parametrize("layout,config", [
    pytest.param(layout, config, id=f"{layout}-{name}",
                 marks=() if (layout, name) == ("balanced", "doc_mask_window6") else pytest.mark.full)
    for name, config in CONFIGS.items() for layout in ("contiguous", "balanced")])
def test_every_rank_compiles_a_new_graph_at_the_same_lengths(config, layout):
    """A rank that reuses its graph while another compiles a new one would run its collectives alone: every
    rank's guards must fail at the same lengths, shards shorter than the halo included (rank-specific hop
    counts used to give each rank its own guards: P = 4 packed parity hung at local lengths 4 then 2)."""
    lengths = [4, 2, 2, 3, 8, 5, 12, 4] if layout == "contiguous" else [4, 2, 2, 6, 8, 10, 12, 4]
    compiled_at = []
    for rank in range(WORLD):
        with fake_rank(rank, WORLD) as group:
            compiled = run_lengths(group, lengths, backward=False, layout=layout, **config)
        compiled_at.append([r.local_len for r in compiled.compile_records])
    assert all(c == compiled_at[0] for c in compiled_at), compiled_at
