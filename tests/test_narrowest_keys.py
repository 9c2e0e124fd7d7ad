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
    layout, and where the rows arrive they are computed, not moved. A training step computing K and V again
    (0.0749 MFLOP a row received) costs less than moving the 3,360 B a row it saves, so the latent moves: the bytes
    are the bound, no metadata."""
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


def _rotate(x, positions):
    """RoPE at ``positions`` (an ``arange`` the model makes: the layout's positions), interleaved halves."""
    freq = 1.0 / (100 ** (torch.arange(0, x.shape[-1], 2, dtype=torch.float32) / x.shape[-1]))
    angle = positions.float()[:, None] * freq
    cos, sin = torch.cat([angle, angle], -1).cos(), torch.cat([angle, angle], -1).sin()
    a, b = x.chunk(2, -1)
    return x * cos + torch.cat([-b, a], -1) * sin


def _flat_heads(t, b, s):
    """A helper whose shape arithmetic reads the length: positions and heads flattened, scaled, and back."""
    flat = t.reshape(b * s * t.shape[2], -1)
    return (flat * 1.5 + 0.1).reshape(b, s, -1, flat.shape[-1])



class Encoder(nn.Module):
    """Hidden rows (32 a position) narrower than K and V (64): the embedding plus a trained position table sliced to
    the length (``pos[:s]``: a table's rows, which move with autograd), attention over every key."""

    def __init__(self):
        super().__init__()
        self.embed, self.pos = nn.Embedding(64, 32), nn.Parameter(torch.randn(64, 32) * 0.5)
        self.qkv, self.proj, self.head = nn.Linear(32, 96), nn.Linear(32, 32), nn.Linear(32, 64)

    def forward(self, input_ids):
        b, s = input_ids.shape
        x = F.layer_norm(self.embed(input_ids) + self.pos[:s], (32,))
        q, k, v = self.qkv(x).view(b, s, 3, 4, 8).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.head(x + self.proj(out.transpose(1, 2).reshape(b, s, 32)))


class RopeLatent(nn.Module):
    """A latent of 6, merged with the batch on its way (the cut is next to it), decompressed through a
    helper that flattens positions and heads, 2 KV heads for 4 query heads (``enable_gqa``), and a rope part
    rotated at the model's own ``arange`` (positions from the layout)."""

    def __init__(self):
        super().__init__()
        self.embed, self.q = nn.Embedding(64, 32), nn.Linear(32, 4 * 12)
        self.down, self.up, self.rope = nn.Linear(32, 6), nn.Linear(6, 2 * 16), nn.Linear(32, 4)
        self.proj, self.head = nn.Linear(4 * 8, 32), nn.Linear(32, 64)

    def forward(self, input_ids):
        b, s = input_ids.shape
        x = self.embed(input_ids)
        positions = torch.arange(s, device=x.device)
        latent = F.silu(self.down(x)).reshape(b * s, -1)  # positions merged with the batch: rows that cannot move
        kv = _flat_heads(self.up(latent).view(b, s, 2, 16), b, s)
        k_rope = _rotate(self.rope(x), positions)[:, :, None].expand(b, s, 2, 4)
        k = torch.cat([kv[..., :8], k_rope], -1).transpose(1, 2)
        v = kv[..., 8:].transpose(1, 2)
        q = self.q(x).view(b, s, 4, 12)
        q = torch.cat([q[..., :8], _rotate(q[..., 8:], positions[:, None])], -1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.head(x + self.proj(out.transpose(1, 2).reshape(b, s, 32)))


VARIANTS = {"encoder-table": (Encoder, "contiguous", 14), "rope-latent-gqa": (RopeLatent, "balanced", 13)}
"""Each variant's model, layout and length: an odd one where padding is hidden (causal), even for every key."""


def variants_parity(group, names: list[str]) -> list[dict]:
    """Each variant compiled with the cost model's choice, one step at its length: loss = sum of squared logits."""
    import cp_passes
    from shared import param_grads, toy_batch

    results = []
    for name in names:
        build, layout, seq_len = VARIANTS[name]
        torch.manual_seed(0)
        model = build()
        compiled = cp_passes.cp_compile(model, cp_passes.CPSpec(layout=layout), mesh=group, backend="aot_eager",
                                        verbose=False)
        local, shard = cp_passes.shard_batch({"input_ids": toy_batch(seq_len, vocab=64)["input_ids"]}, group,
                                             compiled.spec)
        logits = compiled(**local)
        loss = logits[:, shard.valid[0]].pow(2).sum()
        loss.backward()
        results.append({"loss": loss.detach(), "logits": logits.detach(), "grads": param_grads(model),
                        "valid": shard.valid, "positions": shard.positions,
                        "notes": [r.note for r in compiled.compile_records[-1].records if r.rule.startswith("sdpa")]})
    return results


def test_variants_with_the_narrowest_rows_moved_match_one_device(pool, parity_report):
    """Variations of what broke or could: an encoder whose cut reads a trained position table (its rows moved
    without autograd once, and the graph failed to lower), and a latent merged with the batch on its way (the cut
    fell on the merged rows once, and K and V moved), decompressed through a helper reading the length, GQA by
    ``enable_gqa``, RoPE at the model's own positions. The narrowest rows move (the note says so), and logits,
    loss and gradients match one device."""
    from shared import toy_batch

    names = list(VARIANTS)
    per_rank = pool.run(variants_parity, 2, names=names)
    for i, name in enumerate(names):
        build, _, seq_len = VARIANTS[name]
        torch.manual_seed(0)
        model = build()
        logits = model(toy_batch(seq_len, vocab=64)["input_ids"])
        loss = logits.pow(2).sum()
        loss.backward()
        ranks = [r[i] for r in per_rank]
        assert all("cp_passes moves those" in note for note in ranks[0]["notes"]), ranks[0]["notes"]
        compare(f"{name}-narrowest-rows-aot_eager", ranks, loss.detach(), logits.detach(),
                {n: p.grad for n, p in model.named_parameters()}, seq_len, parity_report)
