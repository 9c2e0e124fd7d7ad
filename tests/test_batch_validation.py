"""Malformed batches are refused before anything is packed, padded or sliced, with an error that names the
key (and the row and the document where they apply). Pure CPU, no process group: shard_for_rank."""

import pytest
import torch

from cp_passes.batch import shard_for_rank

IDS = torch.arange(10, 18)[None]  # one row of 8 tokens
TWO = torch.arange(16).view(2, 8)  # two rows of 8 tokens


def refusal(batch, spec=None, error=ValueError, **kwargs) -> str:
    with pytest.raises(error) as info:
        shard_for_rank(batch, 0, 2, spec, **kwargs)
    return str(info.value)


def whole(batch, spec=None, world=2, **kwargs) -> dict:
    """Every rank's shard, concatenated back along the sequence."""
    shards = [shard_for_rank(batch, rank, world, spec, **kwargs)[0] for rank in range(world)]
    return {key: torch.cat([s[key] for s in shards], dim=1) for key in shards[0]
            if isinstance(shards[0][key], torch.Tensor)}


# cu_seqlens: integer offsets from 0, non-decreasing, ending at the row length

@pytest.mark.parametrize("lengths,message", [
    ({"cu_seqlens": [1, 4, 9]}, r"cu_seqlens: row 0 starts at 1; document offsets start at 0"),
    ({"cu_seqlens": [0, 5, 4, 8]}, r"cu_seqlens: row 0 falls from 5 to 4 at document 1"),
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
