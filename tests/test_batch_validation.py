"""Malformed batches are refused before anything is packed, padded or sliced, with an error that names the
key (and the row and the document where they apply). Pure CPU, no process group: shard_for_rank."""

import pytest
import torch

from cp_passes import CPSpec, load_spec
from cp_passes.data.batch import shard_for_rank

IDS = torch.arange(10, 18)[None]  # one row of 8 tokens
TWO = torch.arange(16).view(2, 8)  # two rows of 8 tokens
TWO_DOCS = [[4, 4], [4, 4]]


def refusal(batch, spec=None, error=ValueError, **kwargs) -> str:
    with pytest.raises(error) as info:
        shard_for_rank(batch, 0, 2, spec, **kwargs)
    return str(info.value)


def whole(batch, spec=None, world=2, **kwargs) -> dict:
    """Every rank's shard, put back in the global order of the spec's layout."""
    shards = [shard_for_rank(batch, rank, world, spec, **kwargs) for rank in range(world)]
    layout = shards[0][1].layout
    return {key: layout.unshard(torch.cat([s[key] for s, _ in shards], dim=1), 1) for key in shards[0][0]
            if isinstance(shards[0][0][key], torch.Tensor)}


# cu_seqlens: integer offsets from 0, non-decreasing, ending at the row length

@pytest.mark.parametrize("lengths,message", [
    ({"cu_seqlens": [1, 4, 9]}, r"cu_seqlens: row 0 starts at 1; document offsets start at 0"),
    ({"cu_seqlens": [0, 5, 4, 8]}, r"cu_seqlens: row 0 falls from 5 to 4 at document 1"),
    ({"cu_seqlens": [0, 4, 7]}, r"cu_seqlens: row 0 ends at 7, but the row has 8 positions"),
    ({"cu_seqlens": [0, 4, 7], "cu_seqlens_padded": [1, 5, 9]}, r"cu_seqlens_padded: row 0 starts at 1"),
    ({"cu_seqlens": [], "cu_seqlens_padded": []}, r"cu_seqlens is empty"),
    ({"cu_seqlens_padded": [0, 4, 8]}, r"cu_seqlens_padded needs cu_seqlens"),
])
def test_cu_seqlens_must_be_offsets_from_zero_to_the_row_length(lengths, message):
    with pytest.raises(ValueError, match=message):
        shard_for_rank({"input_ids": IDS, **lengths}, 0, 2)


def test_cu_seqlens_per_row_with_padding_slots():
    batch = {"input_ids": TWO, "cu_seqlens": [[0, 3, 6], [0, 8, 8]], "cu_seqlens_padded": [[0, 4, 8], [0, 8, 8]]}
    full = whole(batch)
    assert full["doc_ids"].tolist() == [[0, 0, 0, -1, 1, 1, 1, -1], [0] * 8]


# a one-row tensor next to a [B, S] batch is not broadcast

@pytest.mark.parametrize("key", ["labels", "attention_mask"])
@pytest.mark.parametrize("packed", [False, True])
def test_a_one_row_tensor_is_not_broadcast_to_every_row(key, packed):
    batch = {"input_ids": TWO, key: IDS, **({"seq_lens": TWO_DOCS} if packed else {})}
    message = refusal(batch)
    assert f"batch[{key!r}] has 1 row but input_ids has 2 rows" in message and "broadcast" in message


# a [1, S] position_ids applies to every row (and is validated there); a 1-D tensor is refused

def test_one_row_of_positions_applies_to_every_row():
    full = whole({"input_ids": TWO, "position_ids": torch.arange(8)[None]})
    assert full["position_ids"].tolist() == [list(range(8))] * 2


def test_one_row_of_positions_is_validated_per_row_and_document():
    per_doc = torch.arange(4).repeat(2)[None]
    full = whole({"input_ids": TWO, "position_ids": per_doc, "seq_lens": TWO_DOCS})
    assert full["position_ids"].tolist() == [per_doc[0].tolist()] * 2
    message = refusal({"input_ids": TWO, "position_ids": per_doc, "seq_lens": [[4, 4], [8, -1000]],
                       "seq_lens_padded": [[4, 4], [8, -1000]]})
    assert "position_ids: row 1, document 0 jumps from position 3 to 0" in message
    assert "its one row is used for every row" in message


@pytest.mark.parametrize("key,value", [("position_ids", torch.arange(8)), ("labels", IDS[0]),
                                       ("loss_weight", torch.ones(8))])
def test_a_1d_tensor_in_a_packed_batch_is_refused(key, value):
    message = refusal({"input_ids": IDS, key: value, "seq_lens": [[8]]})
    assert f"batch[{key!r}] has shape [8], but sequence tensors need [batch, seq]" in message


# seq_lens is [rows, docs]

@pytest.mark.parametrize("seq_lens,shape", [([[4], [4], [4], [4]], "[4, 1]"), ([4, 4, 4, 4], "[4]")])
def test_seq_lens_must_have_one_row_per_batch_row(seq_lens, shape):
    message = refusal({"input_ids": TWO, "seq_lens": seq_lens})
    assert f"seq_lens has shape {shape}, but a batch of 2 rows needs [2, docs]" in message


# seq_lens and cu_seqlens together must agree

def test_seq_lens_and_cu_seqlens_that_disagree_are_refused():
    message = refusal({"input_ids": IDS, "seq_lens": [[4, 4]], "cu_seqlens": [0, 3, 8]})
    assert "row 0: seq_lens give the documents [(0, 4, 4), (4, 4, 4)] but cu_seqlens give [(0, 3, 3), (3, 5, 5)]" \
        in message
    agreed = whole({"input_ids": IDS, "seq_lens": [[3, 5]], "cu_seqlens": [0, 3, 8]})
    assert agreed["doc_ids"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 1]]


# a sharded integer key needs a declared padding, even where this batch needs none

def test_a_misspelled_label_key_is_refused_with_a_suggestion():
    message = refusal({"input_ids": IDS, "labels": IDS}, CPSpec(label_keys=("label",)))
    assert "batch['labels'] is an integer sequence tensor that no spec field declares" in message
    assert "label_keys" in message and "replicated_inputs" in message
    assert "did you mean 'labels' where the spec has 'label' in label_keys?" in message


def test_undeclared_integer_keys_need_a_declaration():
    batch = {"input_ids": IDS[:, :7], "token_type_ids": torch.ones(1, 7, dtype=torch.long),
             "weights": torch.ones(1, 7), "keep": torch.ones(1, 7, dtype=torch.bool),
             "doc_ids": torch.zeros(1, 7, dtype=torch.long)}
    assert "batch['token_type_ids'] is an integer sequence tensor" in refusal(batch)
    as_tokens = whole(batch, CPSpec(token_keys=("input_ids", "token_type_ids"), pad_token_id=5))
    assert as_tokens["token_type_ids"][0, 7] == 5 and as_tokens["input_ids"][0, 7] == 5
    as_mask = whole(batch, mask_keys=("token_type_ids",))
    assert as_mask["token_type_ids"][0, 7] == 0 and as_mask["input_ids"][0, 7] == 0
    assert as_mask["weights"][0, 7] == 0 and not as_mask["keep"][0, 7] and as_mask["doc_ids"][0, 7] == -1
    kept, _ = shard_for_rank(batch, 1, 2, CPSpec(replicated_inputs=("token_type_ids",)))
    assert kept["token_type_ids"] is batch["token_type_ids"]
    assert "mask_keys must be a tuple" in refusal(batch, mask_keys="token_type_ids", error=TypeError)


# plain mistakes get a clear error instead of a crash deep inside

@pytest.mark.parametrize("lengths,error,message", [
    ({"seq_lens": torch.tensor([[4.0, 4.0]])}, TypeError, "seq_lens must hold integers, got torch.float32"),
    ({"cu_seqlens": torch.tensor([0.0, 4.0, 8.0])}, TypeError, "cu_seqlens must hold integers, got torch.float32"),
    ({"seq_lens": [[4, 4], [8]]}, ValueError, "seq_lens must be a tensor or equal-length lists of ints"),
    ({"cu_seqlens": [[0, 4, 8], [0, 8]]}, ValueError, "cu_seqlens must be a tensor or equal-length lists of ints"),
    ({"seq_lens": [[4, 4], [8, -1000]], "seq_lens_padded": [[4, 4, -1000], [8, -1000, -1000]]}, ValueError,
     "seq_lens_padded has shape [2, 3] but seq_lens has [2, 2]"),
])
def test_malformed_lengths_get_a_clear_error(lengths, error, message):
    assert message in refusal({"input_ids": TWO, **lengths}, error=error)


@pytest.mark.parametrize("packed", [False, True])
def test_labels_one_longer_than_the_tokens_are_refused(packed):
    batch = {"input_ids": IDS, "labels": torch.arange(9)[None], **({"seq_lens": [[8]]} if packed else {})}
    assert "batch['labels'] has length 9 on dim 1 but input_ids has 8" in refusal(batch)


@pytest.mark.parametrize("batch,message", [
    ({"input_ids": IDS[0], "seq_lens": [8]},
     "batch['input_ids'] has shape [8], but sequence tensors need [batch, seq]"),
    ({"input_ids": IDS[:0]}, "batch['input_ids'] has shape [0, 8]: no rows to shard"),
    ({"input_ids": IDS[:, :0]}, "batch['input_ids'] has shape [1, 0]: no positions to shard"),
])
def test_degenerate_token_tensors_are_refused(batch, message):
    assert message in refusal(batch)


def test_a_packed_batch_of_embeddings_takes_its_shape_from_inputs_embeds():
    embeds = torch.randn(1, 8, 3)
    full = whole({"inputs_embeds": embeds, "labels": IDS, "seq_lens": [[3, 5]]})
    assert torch.equal(full["inputs_embeds"], embeds)
    assert full["doc_ids"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 1]]
    assert full["shift_labels"].tolist() == [[11, 12, -100, 14, 15, 16, 17, -100]]


def test_a_spec_name_is_accepted_and_anything_else_is_a_type_error():
    batch = {"input_ids": IDS[:, :7], "labels": IDS[:, :7]}
    by_name, by_spec = whole(batch, "llama"), whole(batch, load_spec("llama"))
    assert by_name.keys() == by_spec.keys() and all(torch.equal(by_name[k], by_spec[k]) for k in by_name)
    assert "spec must be a CPSpec, a spec name such as 'llama', or None; got int" in refusal(batch, 3, TypeError)


def test_keys_that_packing_adds_are_sharded_whatever_the_spec_lists():
    """doc_ids, position_ids and shift_labels are sequence tensors by construction: a spec whose seq_inputs
    omits them used to hand every rank the whole [B, S] tensor."""
    batch = {"input_ids": torch.arange(10, 18)[None], "labels": torch.arange(10, 18)[None],
             "cu_seqlens": torch.tensor([0, 3, 8])}
    out, _ = shard_for_rank(batch, 1, 2, CPSpec(seq_inputs=("input_ids", "labels"), layout="contiguous"))
    for key in ("doc_ids", "position_ids", "shift_labels"):
        assert out[key].shape == (1, 4), (key, out[key].shape)
    assert out["doc_ids"].tolist() == [[1, 1, 1, 1]] and out["position_ids"].tolist() == [[1, 2, 3, 4]]
