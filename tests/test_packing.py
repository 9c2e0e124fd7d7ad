"""Packed documents on the batch side: one global doc-id map, per-document positions and labels, then
contiguous shards. Property tests over random document lengths against a plain loop."""

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from cp_passes.data.batch import shard_for_rank
from cp_passes.data.packing import PAD_DOC_ID, UNUSED_SLOT

IGNORE = -100


@st.composite
def packed_rows(draw):
    """rows x (slot, length) partitions of one row length; slots 0..3 longer than their documents."""
    seq_len = draw(st.integers(1, 40))
    rows = draw(st.integers(1, 2))
    layout = []
    for _ in range(rows):
        cuts = sorted(draw(st.sets(st.integers(1, seq_len - 1), max_size=6))) if seq_len > 1 else []
        slots = [b - a for a, b in zip([0] + cuts, cuts + [seq_len])]
        layout.append([(slot, draw(st.integers(max(0, slot - 3), slot))) for slot in slots])
    return seq_len, layout


def make_batch(seq_len, layout, with_positions):
    rows, width = len(layout), max(len(r) for r in layout)
    g = torch.Generator().manual_seed(seq_len * 31 + width)
    ids = torch.randint(0, 50, (rows, seq_len), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone(),
             "seq_lens": torch.full((rows, width), UNUSED_SLOT),
             "seq_lens_padded": torch.full((rows, width), UNUSED_SLOT)}
    for r, docs in enumerate(layout):
        for d, (slot, length) in enumerate(docs):
            batch["seq_lens"][r, d], batch["seq_lens_padded"][r, d] = length, slot
    if with_positions:
        batch["position_ids"] = reference(seq_len, layout, ids)["position_ids"]
    return batch


def reference(seq_len, layout, labels):
    """The loop a reader can check by eye."""
    rows = len(layout)
    doc_ids = torch.full((rows, seq_len), PAD_DOC_ID)
    positions = torch.zeros((rows, seq_len), dtype=torch.long)
    for r, docs in enumerate(layout):
        t = 0
        for d, (slot, length) in enumerate(docs):
            for i in range(length):
                doc_ids[r, t + i], positions[r, t + i] = d, i
            t += slot
    valid = doc_ids != PAD_DOC_ID
    shift = torch.full((rows, seq_len), IGNORE)
    for r in range(rows):
        for t in range(seq_len - 1):
            if valid[r, t] and valid[r, t + 1] and doc_ids[r, t] == doc_ids[r, t + 1]:
                shift[r, t] = labels[r, t + 1]
    return {"doc_ids": doc_ids, "position_ids": positions, "valid": valid, "shift_labels": shift}


def reassemble(batch, world, **kwargs):
    """Every rank's shard, put back in the global order of the spec's layout."""
    shards = [shard_for_rank(batch, rank, world, **kwargs) for rank in range(world)]
    layout = shards[0][1].layout
    full = {key: layout.unshard(torch.cat([s[0][key] for s in shards], dim=1), 1) for key in shards[0][0]
            if isinstance(shards[0][0][key], torch.Tensor) and shards[0][0][key].dim() == 2}
    full["valid"] = layout.unshard(torch.cat([s[1].valid for s in shards], dim=1), 1)
    return full, shards[0][1]


@settings(max_examples=60, deadline=None)
@given(packed=packed_rows(), world=st.sampled_from([2, 4]), with_positions=st.booleans())
@example(packed=(12, [[(12, 12)]]), world=4, with_positions=True)            # one document over all 4 ranks
@example(packed=(9, [[(1, 1), (1, 1), (7, 2)]]), world=4, with_positions=False)  # single tokens; padding-only shards
def test_packed_shards_reassemble_to_the_reference(packed, world, with_positions):
    seq_len, layout = packed
    batch = make_batch(seq_len, layout, with_positions)
    full, layout_info = reassemble(batch, world)
    ref = reference(seq_len, layout, batch["labels"])
    padded = layout_info.padded_len
    multiple = world * layout_info.layout.chunks  # a balanced layout holds 2P equal ranges
    assert padded % multiple == 0 and padded - seq_len < multiple
    for key in ("doc_ids", "position_ids", "shift_labels"):
        assert torch.equal(full[key][:, :seq_len], ref[key]), key
    assert torch.equal(full["valid"][:, :seq_len], ref["valid"]) and not full["valid"][:, seq_len:].any()
    assert (full["doc_ids"][:, seq_len:] == PAD_DOC_ID).all() and (full["shift_labels"][:, seq_len:] == IGNORE).all()
    assert torch.equal(full["input_ids"][:, :seq_len], batch["input_ids"])  # tokens untouched, padding included
    assert "seq_lens" not in full


@settings(max_examples=30, deadline=None)
@given(packed=packed_rows(), alignment=st.sampled_from([2, 4, 8]))
def test_packed_alignment_starts_documents_on_multiples(packed, alignment):
    seq_len, layout = packed
    batch = make_batch(seq_len, layout, with_positions=False)
    full, _ = reassemble(batch, 2, packed_alignment=alignment)
    for r, docs in enumerate(layout):
        starts = [t for t in range(full["doc_ids"].shape[1])
                  if full["position_ids"][r, t] == 0 and full["valid"][r, t]]
        assert all(t % alignment == 0 for t in starts)
        kept = full["input_ids"][r][full["valid"][r]]
        original = torch.cat([batch["input_ids"][r, sum(s for s, _ in docs[:d]):sum(s for s, _ in docs[:d]) + n]
                              for d, (_, n) in enumerate(docs)]) if docs else kept
        assert torch.equal(kept, original)


def test_an_eos_equal_to_the_pad_id_stays_valid():
    batch = make_batch(4, [[(2, 2), (2, 1)]], with_positions=False)
    batch["input_ids"][0] = torch.tensor([5, 0, 7, 0])  # token 1 is EOS == pad id 0; token 3 is padding
    full, _ = reassemble(batch, 2)
    assert full["valid"][0].tolist() == [True, True, True, False]


def test_loss_mask_ignores_masked_targets():
    batch = make_batch(6, [[(6, 6)]], with_positions=False)
    batch["loss_mask"] = torch.tensor([[1, 1, 0, 1, 1, 1]])
    full, _ = reassemble(batch, 2)
    assert full["shift_labels"][0, 1] == IGNORE and full["shift_labels"][0, 2] != IGNORE


@pytest.mark.parametrize("change,message", [
    (lambda b: (b["seq_lens"].__setitem__((0, 0), 3), b["seq_lens_padded"].__setitem__((0, 0), 3)),
     "row 0: document lengths sum to 7, but the row has 8 positions"),
    (lambda b: (b["seq_lens"].__setitem__((0, 1), -2), b["seq_lens_padded"].__setitem__((0, 1), -2)),
     "row 0, document 1: negative length -2"),
    (lambda b: b["seq_lens"].__setitem__((0, 1), 9), "row 0, document 1: padded length 4 is shorter than its length 9"),
    (lambda b: b["position_ids"].__setitem__((0, 6), 7), "position_ids: row 0, document 1 jumps from position 1 to 7"),
    (lambda b: b["position_ids"].__setitem__((0, 4), 1), "position_ids: row 0, document 1 starts at position 1, not 0"),
])
def test_bad_batches_name_the_row_and_document(change, message):
    batch = make_batch(8, [[(4, 4), (4, 4)]], with_positions=True)
    change(batch)
    with pytest.raises(ValueError, match=message):
        shard_for_rank(batch, 0, 2)


def test_cu_seqlens_is_a_one_row_pack():
    batch = {"input_ids": torch.arange(7)[None], "cu_seqlens": torch.tensor([0, 3, 7])}
    full, _ = reassemble(batch, 2)
    assert full["doc_ids"][0, :7].tolist() == [0, 0, 0, 1, 1, 1, 1]
    assert full["position_ids"][0, :7].tolist() == [0, 1, 2, 0, 1, 2, 3]


def test_packing_writes_and_reads_the_key_names_the_spec_gives():
    """doc_key, position_keys[0] and packed_labels name what packing writes and reads; the defaults give the
    same tensors under doc_ids, position_ids, labels and shift_labels."""
    from cp_passes import CPSpec

    layout = [[(5, 4), (7, 7)]]
    batch = make_batch(12, layout, with_positions=False)
    default, _ = shard_for_rank(batch, 0, 2)
    spec = CPSpec(doc_key="segments", position_keys=("pos",), label_keys=("targets", "next_targets"),
                  packed_labels=("targets", "next_targets"))
    renamed = dict(batch)
    renamed["targets"] = renamed.pop("labels")
    local, _ = shard_for_rank(renamed, 0, 2, spec)
    for new, old in (("segments", "doc_ids"), ("pos", "position_ids"), ("next_targets", "shift_labels")):
        assert torch.equal(local[new], default[old]), new
    assert "doc_ids" not in local and "shift_labels" not in local
    with pytest.raises(ValueError, match="position_keys=\\(\\)"):
        shard_for_rank(batch, 0, 2, CPSpec(position_keys=()))
