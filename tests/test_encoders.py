"""Bidirectional encoders as transformers ships them (ModernBERT: global layers, and local layers whose mask lets
each query see keys on both sides): a global layer brings every key, a local one a halo from both sides (eager
attention with a padding attention_mask: every key), under SDPA and eager attention, with and without a padding
attention_mask. Parity on real gloo processes against one
device; structure on the fake process group."""

import pytest

import cp_passes
import encoder_models
from encoder_models import ToyEncoder, batch, build, reference, toy_batch, toy_reference
from parity import GRAD_RTOL, OUT_TOL, compare_valid
from shared import in_global_order

CASES = [(2, "sdpa", True, "auto", [11])] + [
    pytest.param(*case, marks=pytest.mark.full) for case in (
        (2, "sdpa", False, "auto", [16]), (2, "sdpa", True, "contiguous", [16]), (2, "eager", True, "auto", [16]),
        (2, "eager", False, "auto", [16]), (4, "sdpa", True, "auto", [16, 11]), (4, "eager", True, "auto", [16, 11]),
        (4, "eager", False, "contiguous", [16]))]


@pytest.mark.parametrize("P,attention,padded,layout,seq_lens", CASES,
                         ids=lambda v: v if isinstance(v, str) else None)
def test_modernbert_matches_one_device(pool, parity_report, P, attention, padded, layout, seq_lens):
    """spec=None (no shipped spec: the defaults); labels at every third position; with ``padded`` the second row
    ends in 3 pad tokens that its attention_mask hides (shard_batch pads an odd length's mask with 0 too)."""
    per_rank = pool.run(encoder_models.parity, P, seq_lens=seq_lens, attention=attention, padded=padded,
                        layout=layout)
    for i, seq_len in enumerate(seq_lens):
        compare_valid(f"hf-modernbert-{attention}{'-padded' if padded else ''}-{layout}", [r[i] for r in per_rank],
                      reference(seq_len, attention, padded), seq_len, parity_report)
    records = per_rank[0][0]["records"]
    if attention == "sdpa":
        rules = [rule for rule, *_ in records if rule.startswith("sdpa")]
        assert rules == ["sdpa_bidirectional" if padded else "sdpa_full"] + ["sdpa_bidirectional_window"] * 2, rules
    elif not padded:  # the local layers' K and V by a two-sided halo, the global layer's every key
        moved = [moved for rule, _, moved, *_ in records if rule == "key_operand"]
        assert len(moved) == 6 and sorted(moved)[:4] == [min(moved)] * 4 and min(moved) < max(moved), moved


T5 = [(2, "sdpa", True, [11])] + [pytest.param(*case, marks=pytest.mark.full) for case in (
    (2, "sdpa", True, [16]), (2, "eager", True, [16]), (4, "sdpa", False, [16]), (4, "sdpa", True, [24, 11]),
    (4, "eager", False, [16]))]


@pytest.mark.parametrize("P,attention,padded,seq_lens", T5, ids=lambda v: v if isinstance(v, str) else None)
def test_t5_relative_position_bias_matches_one_device(pool, parity_report, P, attention, padded, seq_lens):
    """T5's encoder (token classification, spec=None): the bias ``table[bucket(j - i)]`` is learned, so it is no
    mask, but it is computed from positions and a parameter alone: evaluated at the rank's rows and every key, its
    gradient reaches the table through each rank's part. Under SDPA the biased attention is written out first."""
    per_rank = pool.run(encoder_models.parity, P, seq_lens=seq_lens, attention=attention, padded=padded, model="t5")
    for i, seq_len in enumerate(seq_lens):
        compare_valid(f"hf-t5-{attention}{'-padded' if padded else ''}", [r[i] for r in per_rank],
                      reference(seq_len, attention, padded, model="t5"), seq_len, parity_report)
    masks = [rule for rule, *_ in per_rank[0][0]["records"] if rule == "key_mask"]
    assert masks, per_rank[0][0]["records"]  # the bias, evaluated at the rank's rows (once where layers share it)


WINDOWED = {"two_sided_band", "band_and_padding", "band_in_a_helper", "asymmetric_band", "eager_additive_band",
            "eager_masked_fill_band", "eager_where_asymmetric"}


@pytest.mark.full
@pytest.mark.parametrize("P,seq_len,window", [(2, 16, 3), (4, 16, 5), (4, 24, 7)])
def test_bidirectional_masks_written_by_hand_match_one_device(pool, P, seq_len, window):
    """A two-sided band from arange comparisons, a doc-id equality mask (a packed encoder's), a band combined
    with a padding mask, a band built in a helper method, an asymmetric band, a prefix-LM mask (a prompt every
    query sees): the bands take a halo from both sides, the others bring every key; each matches one device.
    At P = 4 the band is wider than a shard (2 positions under the balanced layout at 16, 3 at 24 with a band of
    7): its halo spans several ranks."""
    for variant in ToyEncoder.VARIANTS:
        ranks = pool.run(encoder_models.toy_parity, P, variant=variant, seq_len=seq_len, window=window)
        logits, loss, grads, keep = toy_reference(variant, seq_len, window)
        if variant.startswith("eager_"):  # K and V: a halo each (bytes below an all-gather's), or every key
            expected = ["key_operand", "key_mask", "key_operand"]
            halo = all(r["halo"] for r in ranks)
            assert halo == (variant in WINDOWED) and all(r["rules"] == expected for r in ranks), (variant, ranks[0])
        else:
            expected = "sdpa_bidirectional_window" if variant in WINDOWED else "sdpa_bidirectional"
            assert all(r["rules"] == [expected] for r in ranks), (variant, ranks[0]["rules"])
        got = in_global_order(ranks, "logits")
        assert (got - logits.detach())[keep].abs().max() <= OUT_TOL, variant
        assert abs(sum(r["loss"] for r in ranks) - loss.detach()) <= OUT_TOL * abs(loss.item()), variant
        for name, g in grads.items():
            err = (sum(r["grads"][name] for r in ranks) - g).abs().max() / g.abs().max()
            assert err <= GRAD_RTOL, (variant, name, err.item())


@pytest.mark.full
def test_data_that_widens_a_two_sided_band_fails_on_every_rank(pool):
    """The band read for one document (3 keys on either side) plans the halo; a batch that marks key 1 as seen by
    every query fails the first step on all 4 ranks (only rank 0 holds key 1; every rank checks every row)."""
    errors = pool.run(encoder_models.toy_error, 4, variant="band_or_marked", seq_len=16)
    for error in errors:
        assert "outside the window of 3 keys before and 3 after" in error, error


def test_a_padded_batch_without_attention_mask_is_refused(group):
    """shard_batch pads 17 positions to 24; the local layers' masks come from positions alone, so every query
    would see the padded keys: refused, naming them and the attention_mask fix."""
    compiled = cp_passes.cp_compile(build(), mesh=group, backend="aot_eager", verbose=False)
    local, _ = cp_passes.shard_batch(batch(17), group, compiled.spec)
    with pytest.raises(cp_passes.CPCompileError, match="bidirectional attention with a mask from positions alone"):
        compiled(**local)


def test_a_causal_declaration_on_a_bidirectional_mask_is_refused(group):
    spec = cp_passes.CPSpec(attention=(cp_passes.AttentionRule("model.layers.1.attn", window=4),))
    compiled = cp_passes.cp_compile(build(), spec, mesh=group, backend="aot_eager", verbose=False)
    local, _ = cp_passes.shard_batch(batch(16), group, compiled.spec)
    with pytest.raises(cp_passes.CPCompileError, match="lets queries see later keys"):
        compiled(**local)


@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
def test_a_two_sided_band_moves_only_the_rows_on_either_side(group, layout):
    """The fake group's rank (3 of 8), 32 positions, a band of 3 on either side: it receives the 3 positions before
    and the 3 after each of its ranges that another rank holds (K and V, one row each per batch row and head),
    nothing else. K and V (32 numbers a position) come from the embedded rows (16) by one projection: the lower
    bound moves those."""
    import torch
    from cp_passes.layout import Layout

    model = ToyEncoder("two_sided_band")
    spec = cp_passes.CPSpec(layout=layout)
    compiled = cp_passes.cp_compile(model, spec, mesh=group, backend="aot_eager", verbose=False)
    local, shard = cp_passes.shard_batch(toy_batch("two_sided_band", 32), group, spec)
    compiled(**local)
    (record,) = [r for r in compiled.compile_records[0].records if r.rule.startswith("sdpa")]
    owned = set(shard.positions.tolist())
    world = group.size()
    needed = {p for start, stop in Layout(world, layout).ranges(group.rank(), 32 // world)
              for p in list(range(start - 3, start)) + list(range(stop, stop + 3)) if 0 <= p < 32 and p not in owned}
    row = 2 * 2 * 8 * torch.float32.itemsize  # batch 2, heads 2, head_dim 8
    assert (record.rule, record.transport) == ("sdpa_bidirectional_window", "halo")
    assert record.bytes == 2 * record.lower_bound_bytes == len(needed) * 2 * row, (record.bytes, len(needed))


def test_a_mask_reaching_outside_the_two_sided_window_fails_at_run_time():
    """The envelope read for one document is a band of 2 keys on either side; a batch whose mask lets query 0
    see key 5 fails (every rank checks every row of the whole mask, so all stop together)."""
    import torch
    from cp_passes.key_plan import band
    from cp_passes.transports.masks import mask_block

    allowed = band(8, 3, ahead=2)
    query = torch.zeros(1, 1, 4, 2)
    block = mask_block(allowed, query, 0, 2, "contiguous", "halo", 2, 2)  # keys: 2 before, 4 own, 2 after
    assert torch.equal(block, torch.cat([torch.zeros(4, 2, dtype=torch.bool), allowed[:4, :6]], 1))
    allowed[0, 5] = True
    with pytest.raises(RuntimeError, match="outside the window of 2 keys before and 2 after"):
        mask_block(allowed, query, 1, 2, "contiguous", "halo", 2, 2)
