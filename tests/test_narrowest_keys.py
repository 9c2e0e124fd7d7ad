"""The lower bound of the keys' bytes: the narrowest tensors attention's K and V derive from position by position
(an MLA latent), found by a minimum cut over the ops that run on a shard as they are. Structure tests on the fake
process group (rank 3 of 8)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cp_passes.tools.dryrun import dry_run


class Latent(nn.Module):
    """Keys and values decompressed from narrow per-position tensors: ``one`` latent of 8 (MLA), or ``two`` of 4
    each, added after their projections (the cut must hold both), or no latent: K and V (1,024 B a position) are
    narrower than the hidden rows they come from (2,048 B)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.embed = nn.Embedding(32, 512)
        self.q = nn.Linear(512, 128)
        widths = {"one": (8,), "two": (4, 4), "none": (512,)}[kind]
        self.down = nn.ModuleList(nn.Linear(512, w) for w in widths)
        self.up = nn.ModuleList(nn.Linear(w, 256) for w in widths)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        b, s, _ = x.shape
        kv = sum(up(F.silu(down(x))) for down, up in zip(self.down, self.up))
        k, v = kv.view(b, s, 8, 32).transpose(1, 2).chunk(2, dim=-1)
        q = self.q(x).view(b, s, 8, 16).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


@pytest.mark.parametrize("kind,row", [("one", 8 * 4), ("two", 2 * 4 * 4), ("none", 256 * 4)])
def test_the_bound_moves_the_narrowest_tensors_the_keys_derive_from(fake_group, kind, row):
    """K and V (8 heads of 16 each, fp32: 1,024 B a position) from a latent of 8 numbers: the bound is 32 B a
    position, and the note names the latent; from two latents of 4 added up: both (32 B); from hidden rows wider
    than K and V: K and V's own bytes, no note."""
    inputs = {"input_ids": ((1, 512), torch.long)}
    (record,) = [r for r in dry_run(lambda: Latent(kind), inputs, mesh=fake_group).record.records
                 if r.rule == "sdpa_causal"]
    assert record.lower_bound_bytes * 1024 == record.bytes * row, (record.bytes, record.lower_bound_bytes)
    if kind == "none":
        assert "derive position by position" not in record.note
    else:
        second = ", down.1 (linear_2)" if kind == "two" else ""
        assert f"K+V derive position by position from down.0 (linear){second}: " \
               f"{row} B a position against 1024" in record.note, record.note


def test_mla_keys_are_bounded_by_the_latent(fake_group):
    """transformers' DeepSeek-V3 (MLA): K and V of 8 heads x (16 + 8 + 16) derive from the latent
    ``kv_a_proj_with_mqa`` makes, kv_lora_rank 32 + qk_rope_head_dim 8 a position; RoPE's positions come from the
    layout (free). cp_passes still moves K and V: 8x the bound."""
    import transformers

    def build():
        torch.manual_seed(0)
        return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            first_k_dense_replace=2, num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=32, q_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, use_cache=False))

    inputs = {"input_ids": ((1, 512), torch.long), "labels": ((1, 512), torch.long)}
    records = [r for r in dry_run(build, inputs, mesh=fake_group).record.records if r.rule == "sdpa_causal"]
    assert len(records) == 2
    for record in records:
        assert record.lower_bound_bytes * 8 * (16 + 8 + 16) == record.bytes * (32 + 8), record
        assert "self_attn.kv_a_proj_with_mqa (linear" in record.note, record.note
        assert "160 B a position against 1280, the lower bound" in record.note, record.note
