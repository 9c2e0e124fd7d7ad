"""Compressed attention as transformers writes DeepSeek V4 (DeepseekV4ForCausalLM with
model_specs/deepseek_v4.py): windows of positions pooled into compressed entries, concatenated after the
raw keys, with a sliding-window mask, the causal block rule and a top-k indexer. Parity on real gloo
processes against one device, unpacked and packed; what each rank receives per layer on the fake group."""


import pytest
import torch

import cp_passes
from cp_passes import CPCompileError
from cp_passes.tools.dryrun import dry_run
from family_models import deepseek_v4_parity, deepseek_v4_spec, hf_deepseek_v4
from parity import GRAD_RTOL, compare, deepseek_v4_cut_floor, deepseek_v4_reference


PACKED = [[3, 17, 4], [8, 8, 8]]
"""Aligned to windows of 4: row 0's documents start at 0, 4 and 24 (32 positions after padding), so at
P = 4 (8 a rank) the second spans ranks 0, 1 and 2 and the third starts at rank 3's first position; row 1's
start at every shard boundary."""


CASES = [(2, PACKED, True), pytest.param(2, None, False, marks=pytest.mark.full),
         pytest.param(1, None, True, marks=pytest.mark.full),
         pytest.param(2, None, True, marks=pytest.mark.full), pytest.param(4, None, True, marks=pytest.mark.full),
         pytest.param(4, None, False, marks=pytest.mark.full), pytest.param(4, PACKED, True, marks=pytest.mark.full)]


@pytest.mark.parametrize("P,documents,positions", CASES)
def test_deepseek_v4_matches_one_device(pool, parity_report, P, documents, positions):
    """A sliding-window layer, a CSA layer (windows of 2, each paired with the previous one by a halo of one
    window, a top-2 indexer over the compressed entries) and an HCA layer (windows of 4), two windows a rank
    at least. Each compressed layer's keys are the raw positions and the compressed entries, brought part by
    part; its masks (sliding window, causal block rule, the indexer's top-k) are evaluated at each rank's query
    rows and cut to the keys brought. Packed rows: documents aligned to the spec's groups, one across three ranks.
    Without ``position_ids`` the model's own ``arange`` feeds both the rotary (made this rank's positions) and
    the masks (copied whole, over the global length)."""
    seq_len = 8 * P
    per_rank = pool.run(deepseek_v4_parity, P, documents=documents, seq_len=seq_len, positions=positions)
    batch, loss, logits, grads = deepseek_v4_reference(P, documents)
    name = (f"hf-DeepseekV4ForCausalLM-{'packed' if documents else 'unpacked'}"
            f"{'' if positions else '-no-position_ids'}-aot_eager")
    if documents:
        assert batch["doc_ids"][0].tolist()[:25] == [0] * 3 + [-1] + [1] * 17 + [-1] * 3 + [2], batch["doc_ids"]
        for r in per_rank:  # every position is compared, the padding between documents too
            r["valid"] = torch.ones_like(r["valid"])
    # At P = 1 the cut is no cut; the model's sensitivity to rounding is read from a cut in two.
    tolerance = max(GRAD_RTOL, 2 * deepseek_v4_cut_floor(max(P, 2), batch, grads))
    compare(f"{name} (grad tol {tolerance:.1e})", per_rank, loss, logits, grads, logits.shape[1], parity_report,
             grad_rtol=tolerance)
    rules = [rec[0] for rec in per_rank[0]["records"]]
    assert rules.count("shift_stencil") == 2 and rules.count("key_operand") == 6, rules


@pytest.mark.full
@pytest.mark.parametrize("P,positions", [(2, False), (4, False), (2, True)])
def test_deepseek_v4_as_regions_matches_one_device(pool, parity_report, P, positions):
    """Each decoder layer a nested compile region (``regions=True``), two layers of each kind, with and without
    ``position_ids``: the model builds its masks (and without them its positions, from ``arange``) once and
    hands them to every layer; they are computed inside each region, which is planned once for its two calls."""
    per_rank = pool.run(deepseek_v4_parity, P, seq_len=8 * P, positions=positions, regions=True)
    batch, loss, logits, grads = deepseek_v4_reference(P, None, layers=6)
    tolerance = max(GRAD_RTOL, 2 * deepseek_v4_cut_floor(P, batch, grads, layers=6))
    name = f"hf-DeepseekV4ForCausalLM-regions{'' if positions else '-no-position_ids'}-aot_eager"
    compare(f"{name} (grad tol {tolerance:.1e})", per_rank,
             loss, logits, grads, logits.shape[1], parity_report, grad_rtol=tolerance)
    history = per_rank[0]["history"]
    assert sum(label.endswith("are computed inside it") for label in history) == 3, history
    assert not any(" inlined at its " in label for label in history), history


@pytest.mark.full  # the family's parity runs by default
def test_what_each_rank_receives_per_layer_at_p8(fake_group):
    """Rank 3 of 8, 8 positions a rank. Per layer K = V (one head of 32, batch 2, fp32): every layer's raw
    keys by a halo of the 11 rows before the shard (window 12: 8 from rank 2, 3 from rank 1); a compressed
    layer's entries of the 7 other shards whole besides (4 windows of 2 for CSA, 2 of 4 for HCA). CSA's
    pairing moves one window of the first halves of its values and of its gates (2 positions x 32). Contiguous
    shards (the balanced layout's DeepSeek V4 parity runs with the processes). Planned as ``cp_compile``
    plans, on fake tensors (the dry run)."""
    spec = deepseek_v4_spec().replace(layout="contiguous")
    inputs = {"input_ids": ((2, 8), torch.long), "position_ids": ((2, 8), torch.long)}
    records = dry_run(hf_deepseek_v4, inputs, spec, mesh=fake_group, regions=True).record.records
    row = 2 * 32 * 4
    keys = [r.bytes for r in records if r.rule == "key_operand"]
    assert keys == [11 * row] * 2 + [(11 + 7 * 4) * row] * 2 + [(11 + 7 * 2) * row] * 2, keys
    # The masks gather position ids (7 shards of 2 x 8 int64); HCA's reads the compressed entries' shape only.
    notes = [r.note for r in records if r.rule == "key_mask"]  # never [S, S]: the rank's rows, every key cut
    assert len(notes) == 3 and all("evaluated at this rank's rows and the keys brought" in n for n in notes), notes
    masks = [r.bytes for r in records if r.rule == "key_mask"]
    assert masks[0] == masks[2] == 7 * 2 * 8 * 8 < masks[1], masks
    # explain counts them apart: metadata, gathered without autograd; the keys are not
    assert [r.metadata_bytes for r in records if r.rule == "key_mask"] == masks
    assert not any(r.metadata_bytes for r in records if r.rule in ("key_operand", "shift_stencil"))
    shifts = [r.bytes for r in records if r.rule == "shift_stencil"]
    assert shifts == [2 * 2 * 32 * 4] * 2, shifts
    assert all(r.bytes == r.lower_bound_bytes for r in records if r.rule in ("key_operand", "shift_stencil"))


class ConcatenatedKeys(torch.nn.Module):
    """Attention over ``cat([k, windows of k pooled], 1)``, with the concatenation read some other way too."""

    def __init__(self, read: str):
        super().__init__()
        self.read = read
        self.embed = torch.nn.Embedding(32, 8)
        self.q, self.k = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        b, s, d = h.shape
        q, k = self.q(h), self.k(h)
        if self.read == "transposed_head_repeat":  # K^T repeated over heads: brought from the repeat, not the cat
            kv = torch.cat([k[:, None], k[:, None].view(b, 1, s // 2, 2, d).mean(3)], 2)
            probs = (torch.stack([q, q / 2], 1) @ kv.transpose(2, 3).repeat_interleave(2, dim=1)).softmax(-1)
            out = (probs @ kv.repeat_interleave(2, dim=1)).sum(1)
            return out.pow(2).sum(), out
        kv = torch.cat([k, k.view(b, s // 2, 2, d).mean(2)], 1)
        scores = q @ kv.transpose(1, 2)
        if self.read == "key_bias":
            scores = scores + kv.sum(-1)[:, None, :]
        out = scores.softmax(-1) @ (kv * 2.0 if self.read == "scaled_values" else kv)
        return out.pow(2).sum(), (kv if self.read == "returned" else out)


class SeparateValues(torch.nn.Module):
    """K and V each concatenated from positions and windows of 2, a sliding window of 4 over the raw keys and the
    causal block rule over the windows: the masks cut K's raw part, but V is a concatenation of its own."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 8)
        self.q, self.k, self.v = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        b, s, d = h.shape
        q, k, v = self.q(h), self.k(h), self.v(h)
        kc = torch.cat([k, k.view(b, s // 2, 2, d).mean(2)], 1)
        vc = torch.cat([v, v.view(b, s // 2, 2, d).mean(2)], 1)
        pos, windows = torch.arange(s), torch.arange(s // 2)
        distance = pos[:, None] - pos[None, :]
        neg = torch.finfo(h.dtype).min
        sliding = torch.zeros(s, s).masked_fill((distance < 0) | (distance >= 4), neg)
        block = torch.zeros(s, s // 2).masked_fill(2 * windows[None, :] + 1 > pos[:, None], neg)
        out = (q @ kc.transpose(1, 2) + torch.cat([sliding, block], -1)).softmax(-1) @ vc
        return out.pow(2).sum(), out


def test_values_concatenated_apart_from_the_keys_are_refused_saying_so(fake_group):
    """Only one concatenation per attention is brought part by part; cutting K's raw part while V came whole
    would misalign them."""
    spec = cp_passes.CPSpec(name="concat", pad_multiple=2)
    compiled = cp_passes.cp_compile(SeparateValues(), spec, mesh=fake_group, backend="aot_eager", verbose=False)
    local, _ = cp_passes.shard_batch({"input_ids": torch.randint(0, 32, (2, 64))}, fake_group, spec)
    why = "(?s)is not that concatenation.*concatenate once and read the result as both"
    with pytest.raises(CPCompileError, match=why):
        compiled(**local)


@pytest.mark.parametrize("read,why", [("scaled_values", "aten.mul.Tensor reads it as it is"),
                                      ("key_bias", "aten.sum.dim_IntList reads it as it is"),
                                      ("returned", "reads it as it is"),
                                      ("transposed_head_repeat", "whose rows interleave the ranks' parts")])
def test_keys_of_positions_and_windows_read_otherwise_are_refused(read, why, fake_group):
    """Each rank's concatenation holds [its positions | its windows], no shard of the one-device value:
    any read other than K and V brought part by part would be silently wrong."""
    spec = cp_passes.CPSpec(name="concat", pad_multiple=2)
    compiled = cp_passes.cp_compile(ConcatenatedKeys(read), spec, mesh=fake_group, backend="aot_eager",
                                    verbose=False)
    local, _ = cp_passes.shard_batch({"input_ids": torch.randint(0, 32, (2, 64))}, fake_group, spec)
    with pytest.raises(CPCompileError, match=why):
        compiled(**local)
