"""Bidirectional encoders as transformers ships them (ModernBERT: global layers, and local layers whose mask lets
each query see keys on both sides): every key is brought and the model's mask evaluated at each rank's rows, under
SDPA and eager attention, with and without a padding attention_mask. Parity on real gloo processes against one
device; structure on the fake process group."""

import pytest

import cp_passes

from encoder_models import ToyEncoder, batch, build, reference, toy_reference
from scenarios import in_global_order
from test_parity import GRAD_RTOL, OUT_TOL, compare_valid

CASES = [(2, "sdpa", True, "auto", [11])] + [
    pytest.param(*case, marks=pytest.mark.full) for case in (
        (2, "sdpa", False, "auto", [16]), (2, "sdpa", True, "contiguous", [16]), (2, "eager", True, "auto", [16]),
        (4, "sdpa", True, "auto", [16, 11]), (4, "eager", True, "auto", [16, 11]))]


@pytest.mark.parametrize("P,attention,padded,layout,seq_lens", CASES,
                         ids=lambda v: v if isinstance(v, str) else None)
def test_modernbert_matches_one_device(pool, parity_report, P, attention, padded, layout, seq_lens):
    """spec=None (no shipped spec: the defaults); labels at every third position; with ``padded`` the second row
    ends in 3 pad tokens that its attention_mask hides (shard_batch pads an odd length's mask with 0 too)."""
    per_rank = pool.run("encoder_models:parity", P, seq_lens=seq_lens, attention=attention, padded=padded,
                        layout=layout)
    for i, seq_len in enumerate(seq_lens):
        compare_valid(f"hf-modernbert-{attention}{'-padded' if padded else ''}-{layout}", [r[i] for r in per_rank],
                      reference(seq_len, attention, padded), seq_len, parity_report)
    if attention == "sdpa":
        rules = [rule for rule, *_ in per_rank[0][0]["records"] if rule.startswith("sdpa")]
        assert rules == ["sdpa_bidirectional"] * 3 if padded else rules == ["sdpa_full", "sdpa_bidirectional",
                                                                            "sdpa_bidirectional"], rules


@pytest.mark.full
def test_bidirectional_masks_written_by_hand_match_one_device(pool):
    """A two-sided band from arange comparisons, a doc-id equality mask (a packed encoder's), a band combined
    with a padding mask, a band built in a helper method, a prefix-LM mask (a prompt every query sees): each
    brings every key and matches one device at
    P = 2, 16 positions (the band of 3 on either side reaches across the shard boundary)."""
    for variant in ToyEncoder.VARIANTS:
        ranks = pool.run("encoder_models:toy_parity", 2, variant=variant, seq_len=16)
        logits, loss, grads, keep = toy_reference(variant, 16)
        assert all(r["rules"] == ["sdpa_bidirectional"] for r in ranks), (variant, ranks[0]["rules"])
        got = in_global_order(ranks, "logits")
        assert (got - logits.detach())[keep].abs().max() <= OUT_TOL, variant
        assert abs(sum(r["loss"] for r in ranks) - loss.detach()) <= OUT_TOL * abs(loss.item()), variant
        for name, g in grads.items():
            err = (sum(r["grads"][name] for r in ranks) - g).abs().max() / g.abs().max()
            assert err <= GRAD_RTOL, (variant, name, err.item())


@pytest.fixture(scope="module")
def group(fake_group):
    return fake_group


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
