"""The lower bound of the keys' bytes: the narrowest tensors attention's K and V derive from position by position
(an MLA latent), found by a minimum cut over the ops that run on a shard as they are. Structure tests on the fake
process group (rank 3 of 8)."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cp_passes.layout import Layout
from cp_passes.tools.dryrun import dry_run
from family_models import hf_deepseek_v3, hf_parity
from parity import compare, hf_reference


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
def test_the_narrowest_tensors_the_keys_derive_from_move(fake_group, kind, row):
    """K and V (8 heads of 16 each, fp32: 1,024 B a position) from a latent of 8 numbers: the bound is 32 B a
    position, the note names the latent, and the latent moves (computing K and V again costs less than moving
    their bytes); of the latent's two tensors of that width (``down``'s output and its silu) the one nearest the
    keys, so that less is computed again; from two latents of 4 added up: both (32 B); from hidden rows wider than
    K and V: K and V's own bytes, no note."""
    inputs = {"input_ids": ((1, 512), torch.long)}
    (record,) = [r for r in dry_run(lambda: Latent(kind), inputs, mesh=fake_group).record.records
                 if r.rule == "sdpa_causal"]
    rows = Layout(8, "balanced").seen_before(3, 512)
    assert (record.bytes, record.lower_bound_bytes) == (rows * row, rows * row), record
    if kind == "none":
        assert "derive position by position" not in record.note
    else:
        second = ", silu_1" if kind == "two" else ""
        assert f"K+V derive position by position from silu{second}: " \
               f"{row} B a position against 1024, the lower bound; cp_passes moves those" in record.note, record.note


def test_mla_moves_its_latent_and_computes_the_keys_again(fake_group):
    """transformers' DeepSeek-V3 (MLA): K and V of 8 heads x (16 + 8 + 16) derive from the latent
    ``kv_a_proj_with_mqa`` makes, kv_lora_rank 32 + qk_rope_head_dim 8 a position; RoPE's positions come from the
    layout. Computing K and V again on the rows received costs less than the attention, so the latent moves (and
    the positions, 8 B a row, without autograd): the bytes are the bound's and the positions'."""
    inputs = {"input_ids": ((1, 512), torch.long), "labels": ((1, 512), torch.long)}
    records = [r for r in dry_run(hf_deepseek_v3, inputs, mesh=fake_group).record.records if r.rule == "sdpa_causal"]
    assert len(records) == 2
    rows = Layout(8, "balanced").seen_before(3, 512)
    for record in records:
        assert "self_attn.kv_a_proj_with_mqa (linear" in record.note, record.note
        assert "160 B a position against 1280, the lower bound; cp_passes moves those" in record.note, record.note
        assert (record.bytes, record.lower_bound_bytes, record.metadata_bytes) == (160 * rows, 160 * rows, 0)


def test_mla_moves_k_and_v_where_the_spec_says(fake_group):
    """``CPSpec(moved_keys="kv")``: K and V move, 8x the bound; the note says why."""
    from cp_passes.spec import resolve_spec

    inputs = {"input_ids": ((1, 512), torch.long), "labels": ((1, 512), torch.long)}
    model = hf_deepseek_v3()
    spec = dataclasses.replace(resolve_spec(None, model.config), moved_keys="kv")
    records = [r for r in dry_run(lambda: model, inputs, mesh=fake_group, spec=spec).record.records
               if r.rule == "sdpa_causal"]
    for record in records:
        assert record.lower_bound_bytes * 8 == record.bytes, record
        assert 'cp_passes moves K+V (CPSpec.moved_keys="kv")' in record.note, record.note


# (P, moved_keys, position_ids, lengths)
MLA_CASES = [(2, "auto", False, [16]), pytest.param(4, "auto", True, [16, 11], marks=pytest.mark.full),
             pytest.param(2, "kv", True, [16], marks=pytest.mark.full)]


@pytest.mark.parametrize("P,moved,position_ids,seq_lens", MLA_CASES,
                         ids=[f"P{c[0]}-{c[1]}" + ("-position_ids" if c[2] else "") for c in
                              (getattr(case, "values", case) for case in MLA_CASES)])
def test_deepseek_v3_with_its_latent_moved_matches_one_device(pool, parity_report, P, moved, position_ids, seq_lens):
    """transformers' DeepSeek-V3 (MLA, a dense layer and a routed MoE layer) on gloo ranks: each rank receives the
    rows of the narrowest tensors K and V derive from and computes K and V from them again; the gradients of the
    copies flow back to the ranks that own the rows. Without position_ids those are the latent (160 B a position
    against 1,280) and RoPE reads the keys' positions from the layout; given position_ids (a packed-sequence mask,
    read at run time), the latent and RoPE's rotated halves (320 B against 2,560, batch 2). Logits, loss and
    gradients match one device, and the bytes are the bound. ``moved_keys="kv"`` moves K and V, 8x the bound."""
    per_rank = pool.run(hf_parity, P, backend="aot_eager", seq_lens=seq_lens, family="deepseek-v3",
                        spec={"moved_keys": moved}, position_ids=position_ids)
    for i, seq_len in enumerate(seq_lens):
        compare(f"hf-deepseek-v3-{moved}{'-position_ids' if position_ids else ''}-aot_eager",
                [r[i] for r in per_rank], *hf_reference(seq_len, False, family="deepseek-v3",
                                                        position_ids=position_ids), seq_len, parity_report)
    for results in per_rank:
        attention = [(b, bound) for rule, _, b, bound in results[0]["records"] if rule.startswith("sdpa")]
        assert len(attention) == 2, results[0]["records"]
        assert all(b == bound if moved == "auto" else b > 4 * bound for b, bound in attention), attention
