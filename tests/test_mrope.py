"""Per-input sequence dims: M-RoPE positions ``[3, batch, seq]`` carry the sequence on their last dim.
shard_batch cuts them there, cp_compile marks that dim, and Qwen2VLTextModel matches one device with an
image's positions spanning a rank boundary."""

from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import cp_passes
from cp_passes.data.batch import shard_for_rank
from parity import GRAD_RTOL, blockwise_sdpa, compare, split_floor
from shared import step_result


MROPE_SPEC = cp_passes.CPSpec(name="qwen2_vl_text", sequence_dims=(("position_ids", -1),))
"""Qwen2-VL's M-RoPE positions ``[3, batch, seq]`` carry the sequence on their last dim."""


def hf_qwen2_vl_text(seed: int = 0):
    """A tiny Qwen2VLTextModel: M-RoPE (sections 2, 3, 3 of head_dim 16's 8 frequencies: temporal, height,
    width), causal attention through SDPA."""
    from transformers import Qwen2VLTextConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLTextModel

    config = Qwen2VLTextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, use_cache=False, bos_token_id=None, eos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    torch.manual_seed(seed)
    return Qwen2VLTextModel(config).float()


def mrope_batch(seq_len: int, image: tuple[int, int, int]) -> dict:
    """Token ids and M-RoPE positions as Qwen2-VL's ``get_rope_index`` lays them out for one image of
    ``image = (start, height, width)`` patches: text positions count on all three rows; the image's tokens
    share the temporal position ``start`` and take ``start + row`` / ``start + column`` on the others; text
    after it resumes at the image's largest position + 1."""
    start, height, width = image
    ids = torch.randint(1, 128, (2, seq_len), generator=torch.Generator().manual_seed(5))
    rows = torch.arange(height).repeat_interleave(width)
    cols = torch.arange(width).repeat(height)
    after = torch.arange(seq_len - start - height * width) + start + max(height, width)
    t = torch.cat([torch.arange(start), torch.full((height * width,), start), after])
    h = torch.cat([torch.arange(start), start + rows, after])
    w = torch.cat([torch.arange(start), start + cols, after])
    return {"input_ids": ids, "position_ids": torch.stack([t, h, w])[:, None].expand(3, 2, seq_len).contiguous()}

IMAGE = (3, 2, 4)
"""An image of 2 x 4 patches at positions 3..10: across the boundary at 8 (P = 2, 16 positions) and at 4 and
8 (P = 4)."""


def test_shard_batch_cuts_mrope_positions_on_their_last_dim():
    """Rank 1 of 4 (balanced: chunks 1 and 6 of 8, positions 2, 3, 12, 13) cuts the [3, batch, seq] positions on
    their last dim; the two padding positions (rank 0's tail) continue each row's count."""
    batch = mrope_batch(14, IMAGE)
    local, layout = shard_for_rank(batch, 1, 4, MROPE_SPEC)
    assert layout.padded_len == 16 and local["input_ids"].shape == (2, 4)
    assert local["position_ids"].shape == (3, 2, 4)
    assert torch.equal(local["position_ids"], batch["position_ids"][..., [2, 3, 12, 13]])
    shards = [shard_for_rank(batch, rank, 4, MROPE_SPEC)[0]["position_ids"] for rank in range(4)]
    whole = layout.layout.unshard(torch.cat(shards, -1), 2)
    assert torch.equal(whole[..., :14], batch["position_ids"])
    assert torch.equal(whole[..., 14:], batch["position_ids"][..., -1:] + torch.tensor([1, 2]))


def test_mrope_positions_without_their_dim_are_refused_naming_the_field():
    batch = mrope_batch(16, IMAGE)
    with pytest.raises(ValueError, match=r"sequence_dims=\(\('position_ids', -1\),\)"):
        shard_for_rank(batch, 0, 2, None)
    with pytest.raises(ValueError, match=r"sequence_dims=\(\('position_ids', -1\),\)"):
        cp_passes.CPSpec().is_sharded("position_ids", batch["position_ids"][..., :8], 8, (2,))


def test_rows_of_an_input_on_seq_dim_stay_on_dim_0():
    """Only a ``sequence_dims`` input counts rows just before its sequence; ``[batch, channels, seq]`` has
    ``batch`` rows."""
    spec = cp_passes.CPSpec(seq_dim=2, seq_inputs=("x",))
    local, layout = shard_for_rank({"x": torch.randn(2, 4, 8)}, 1, 2, spec)
    assert layout.valid.shape == (2, 4) and torch.equal(local["x"], local["x"][:, :, :4])


def test_packed_rows_with_mrope_positions_are_refused():
    """Packing writes [batch, seq] positions, not the [3, batch, seq] ones the spec says the model takes."""
    batch = {"input_ids": torch.randint(1, 128, (1, 16)), "seq_lens": torch.tensor([[8, 8]])}
    with pytest.raises(ValueError, match="packed batches.*position_ids"):
        shard_for_rank(batch, 0, 2, MROPE_SPEC)


def _reference(P: int):
    """One device, and its floor (:func:`split_floor`): the gradient summed from P query blocks' losses,
    each block attending to the keys up to its own last one only. Rounding moves the k projections'
    gradients by up to 1.4e-5 of their size (in float64 CP matches one device to 7e-16)."""
    model = hf_qwen2_vl_text()
    batch = mrope_batch(16, IMAGE)
    out = model(**batch).last_hidden_state
    loss = out.pow(2).sum()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    with mock.patch.object(F, "scaled_dot_product_attention", blockwise_sdpa(P)):
        cut = model(**batch).last_hidden_state
    local = 16 // P
    floor = split_floor(model, [cut[:, s:s + local].pow(2).sum() for s in range(0, 16, local)], grads)
    return loss.detach(), out.detach(), grads, max(GRAD_RTOL, 2 * floor)


@pytest.mark.parametrize("P", [2, pytest.param(4, marks=pytest.mark.full)])
def test_qwen2_vl_text_with_mrope_positions_matches_one_device(pool, parity_report, P):
    per_rank = pool.run(mrope_parity, P, seq_len=16, image=IMAGE)
    loss, out, grads, tolerance = _reference(P)
    compare(f"hf-Qwen2VLTextModel-mrope-aot_eager (grad tol {tolerance:.1e})", per_rank, loss, out, grads, 16,
             parity_report, grad_rtol=tolerance)
    rules = [(rec[0], rec[1]) for rec in per_rank[0]["records"]]
    assert rules == [("sdpa_causal", "sequence_gather")] * 2, rules


# Tasks the worker pool's ranks run (pool.run(task, P, ...)).


def mrope_parity(group, seq_len: int, image: tuple[int, int, int]) -> dict:
    """Qwen2VLTextModel on this rank's slice of ids and of the [3, batch, seq] positions (shard_batch cuts
    their last dim); the loss is the sum of squares of the last hidden states."""
    model = hf_qwen2_vl_text()
    compiled = cp_passes.cp_compile(model, MROPE_SPEC, mesh=group, backend="aot_eager", verbose=False)
    local, layout = cp_passes.shard_batch(mrope_batch(seq_len, image), group, MROPE_SPEC)
    out = compiled(**local).last_hidden_state
    loss = out.pow(2).sum()
    loss.backward()
    return step_result(model, compiled, loss, out, layout)
