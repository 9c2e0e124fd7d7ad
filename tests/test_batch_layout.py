"""A batch whose layout the module cannot establish is refused, and so is padding the model would read.

The verdict on a batch (:mod:`cp_passes.compiler.batch_layout`) is read per rank without a process group;
the padding refusals compile on the fake process group (rank 3 of 8, balanced: shard_batch pads to a multiple
of 16); that every rank raises together runs on real gloo ranks."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cp_passes
from cp_passes import CPCompileError, CPSpec
from cp_passes.compiler.batch_layout import order_refusal, read_batch
from cp_passes.data.batch import shard_for_rank
from cp_passes.group import CPGroup
from cp_passes.layout import BALANCED, CONTIGUOUS, Layout
from shared import error_text, toy_batch, toy_model

SPEC = CPSpec()
FIX = 'cut the batch with cp_passes.shard_batch(batch, mesh, spec)'
CONTIGUOUS_FIX = 'compile with CPSpec(layout="contiguous")'


def verdict(batch: dict, rank: int, size: int = 2, kind: str = BALANCED):
    return read_batch(SPEC, CPGroup(None, "test", rank, size, kind), list(batch.items()))


def hand_cut(batch: dict, rank: int, size: int = 2) -> dict:
    local = batch["input_ids"].shape[1] // size
    return {k: v[:, rank * local:(rank + 1) * local] for k, v in batch.items()}


def together(batches: list[dict], kind: str = BALANCED) -> str | None:
    """What the ranks holding ``batches`` (one per rank) decide: a rank's own refusal, else the verdict on
    their positions' order, from the rows every rank gathers (:func:`confirm_order`)."""
    found = [verdict(batch, rank, len(batches), kind) for rank, batch in enumerate(batches)]
    refusal = next((f.refusal for f in found if f.refusal is not None), None)
    if refusal is not None or found[0].seams is None:
        return refusal
    return order_refusal(Layout(len(batches), kind), [f.seams for f in found], found[0].seam_names)


def unmarked_shards(batch: dict, size: int, kind: str = BALANCED) -> list[dict]:
    """Every rank's rows of the layout, cut by hand (shard_batch never saw them)."""
    return [{k: Layout(size, kind).shard(v, 1, rank) for k, v in batch.items()} for rank in range(size)]


def positions_batch(positions: torch.Tensor) -> dict:
    ids = torch.randint(0, 100, positions.shape, generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "position_ids": positions, "labels": ids.clone()}


def packed_positions(rows: int, seq_len: int, longest: int, seed: int = 0) -> torch.Tensor:
    """Rows of documents of 1 to ``longest`` tokens, each document's positions from 0."""
    g, out = torch.Generator().manual_seed(seed), []
    for _ in range(rows):
        lengths = torch.randint(1, longest + 1, (seq_len,), generator=g)
        out.append(torch.cat([torch.arange(n) for n in lengths.tolist()])[:seq_len])
    return torch.stack(out)


def left_padded_positions(pads: list[int], seq_len: int) -> torch.Tensor:
    """transformers' positions of a left-padded batch: ``cumsum(attention_mask) - 1`` (-1 on the padding)."""
    mask = torch.stack([torch.arange(seq_len) >= pad for pad in pads]).long()
    return mask.cumsum(1) - 1


@pytest.mark.parametrize("size", [2, 4])
def test_hand_cut_positions_are_accepted_only_in_the_order_of_the_layout(size):
    """Packed rows whose positions restart every few tokens and left-padded rows (positions from -1) never run
    ahead of their rows, under either cut: only the order of the chunks, read from the positions at their
    joins, tells a contiguous cut from the balanced layout."""
    cases = {"packed": packed_positions(2, 96, 13), "left padded": left_padded_positions([50, 40], 96),
             "one document a row": torch.arange(96).expand(2, 96)}
    for name, positions in cases.items():
        batch = positions_batch(positions)
        by_hand = [hand_cut(batch, rank, size) for rank in range(size)]
        refusal = together(by_hand)
        assert refusal is not None, name
        if name != "one document a row":  # refused by the positions ahead of their rows
            assert refusal.startswith("input 'position_ids' follows the contiguous cut, not the module's layout "
                                      "(balanced"), (name, refusal)
            assert FIX in refusal and CONTIGUOUS_FIX in refusal
        assert together(by_hand, CONTIGUOUS) is None, name
        assert together(unmarked_shards(batch, size), BALANCED) is None, name
        balanced = together(unmarked_shards(batch, size), CONTIGUOUS)
        assert balanced is not None and "position" in balanced, name


def test_positions_that_show_no_order_are_refused_under_the_balanced_layout():
    """Documents that end exactly where the chunks do: the positions restart at every join, so they cannot
    tell the chunks' order. The balanced module refuses them cut either way; the contiguous one takes them."""
    for size in (2, 4):
        chunk = 96 // (2 * size)
        batch = positions_batch(torch.arange(chunk).repeat(2, 2 * size))
        for cut in ([hand_cut(batch, rank, size) for rank in range(size)], unmarked_shards(batch, size)):
            refusal = together(cut)
            assert refusal.startswith("input 'position_ids' cannot show that this hand-cut batch follows the "
                                      "module's layout"), refusal
            assert together(cut, CONTIGUOUS) is None
        batch["position_ids"] = packed_positions(2, 96, chunk, seed=3) * 0  # every token its own document
        assert together([hand_cut(batch, rank, size) for rank in range(size)]) is not None


def test_a_shard_cut_for_another_rank_or_from_another_batch_is_told():
    """shard_batch's mark names the rank and world size it cut for; the global batch's fingerprint goes into
    what the ranks agree on, so ranks that cut different batches disagree there."""
    batch = toy_batch(128)
    local, _ = shard_for_rank(batch, 0, 2)
    refusal = verdict(local, 1).refusal
    assert refusal.startswith("input 'input_ids' was cut by shard_batch for rank 0 of 2, but this module runs "
                              "on rank 1 of 2"), refusal
    assert verdict(shard_for_rank(batch, 1, 4)[0], 1).refusal is not None
    lines = [verdict(shard_for_rank(batch, rank, 2)[0], rank).lines() for rank in range(2)]
    assert lines[0] == lines[1]
    other = verdict(shard_for_rank(toy_batch(128, seed=2), 1, 2)[0], 1).lines()
    assert other != lines[1] and other[-1].startswith("the global batch shard_batch cut (its fingerprint): ")


def test_a_contiguous_slice_with_positions_is_refused_where_its_positions_run_ahead():
    """Rank 0's slice [0, 64) could be balanced positions of a packed row; rank 1's [64, 128) cannot (it holds
    [32, 96)): its refusal reaches rank 0 on the inputs' all-reduce (test_hand_cut_batches_fail_on_every_rank)."""
    batch = toy_batch(128)
    assert verdict(hand_cut(batch, 0), 0).refusal is None
    refusal = verdict(hand_cut(batch, 1), 1).refusal
    assert refusal.startswith("input 'position_ids' disagrees with the module's layout: local row 0 holds a "
                              "position past global position 32, the one rank 1 of 2 holds"), refusal
    assert FIX in refusal and CONTIGUOUS_FIX in refusal
    for size in (4, 8):
        for rank in range(1, size):
            assert verdict(hand_cut(batch, rank, size), rank, size).refusal is not None
    assert verdict(hand_cut(batch, 1), 1, kind=CONTIGUOUS).refusal is None
    one_row = {k: v[:1] if k == "position_ids" else v for k, v in hand_cut(batch, 1).items()}
    assert verdict(one_row, 1).refusal is not None


def test_a_contiguous_slice_without_positions_is_refused_unless_the_layout_is_contiguous():
    local = hand_cut(toy_batch(128), 1)
    local.pop("position_ids")
    refusal = verdict(local, 1).refusal
    assert refusal.startswith("cp_passes cannot tell which positions this batch holds: its sequence inputs "
                              "('input_ids', 'labels') were not cut by cp_passes.shard_batch"), refusal
    assert FIX in refusal and CONTIGUOUS_FIX in refusal and "or pass position_ids" in refusal
    assert verdict(local, 0).refusal is not None  # every rank knows: no rank can tell
    assert verdict(local, 1, kind=CONTIGUOUS).refusal is None
    assert verdict(toy_batch(128), 0, size=1, kind=CONTIGUOUS).refusal is None


def test_positions_cut_by_hand_in_the_layout_are_accepted():
    by_hand = unmarked_shards(toy_batch(128, seed=5), 2)
    assert together(by_hand) is None
    for local in by_hand:
        local["position_ids"] = local["position_ids"][:1]
    assert together(by_hand) is None


def test_shard_batch_output_is_recognised_after_a_copy():
    batch = toy_batch(126)
    batch.pop("position_ids")
    for rank in range(2):
        local, _ = shard_for_rank(batch, rank, 2)
        for copy in (local, {k: v.clone() for k, v in local.items()}, {k: v.to("cpu") for k, v in local.items()},
                     {k: v.detach().clone().contiguous() for k, v in local.items()}):
            found = verdict(copy, rank)
            assert found.refusal is None and found.cut.kind == BALANCED
            assert (found.padded.seq_len, found.padded.padded_len) == (126, 128)
        changed = {k: v + 1 for k, v in local.items()}
        assert verdict(changed, rank).refusal is not None
    full, _ = shard_for_rank(toy_batch(128), 1, 2)
    assert verdict(full, 1).padded is None


def test_a_packed_batch_from_shard_batch_passes_the_position_check():
    """Positions restart in every document: never ahead of their row, on any rank, cloned or not."""
    rows, seq_len = 2, 61
    batch = {"input_ids": torch.randint(0, 100, (rows, seq_len)), "labels": torch.randint(0, 100, (rows, seq_len)),
             "seq_lens": torch.tensor([[20, 30, 11], [61, -1000, -1000]])}
    for size in (2, 4):
        for rank in range(size):
            local, _ = shard_for_rank(batch, rank, size)
            copy = {k: v.clone() + (0 if k == "position_ids" else 1) for k, v in local.items()}  # unmarked
            assert verdict(copy, rank, size).refusal is None
            assert verdict(copy, rank, size).seams is not None


def test_a_batch_cut_for_another_layout_is_refused():
    local, _ = shard_for_rank(toy_batch(128), 1, 2, CPSpec(layout="contiguous"))
    refusal = verdict({k: v.clone() for k, v in local.items()}, 1).refusal
    assert "sharded by shard_batch for the contiguous layout, but this module was compiled for the balanced " \
           "layout" in refusal


@pytest.mark.parametrize("world", [2])
def test_hand_cut_batches_fail_on_every_rank(pool, world):
    """Real gloo ranks: rank 0's positions look fine to it, rank 1's do not; both raise, before compiling. Packed
    rows cut contiguously look fine to both: the order of their positions, gathered, is refused on both; the same
    rows cut by hand in the layout's order run."""
    results = pool.run(hand_cut_batches, world, timeout=240)
    for rank, (with_positions, without, packed, in_order) in enumerate(results):
        head = "ValueError: " if rank == 1 else "ValueError: rank 1 refused its batch: "
        assert with_positions.startswith(head + "input 'position_ids' disagrees with the module's layout"), \
            with_positions
        assert without.startswith("ValueError: cp_passes cannot tell which positions this batch holds"), without
        assert packed.startswith("ValueError: input 'position_ids' follows the contiguous cut, not the module's "
                                 "layout"), packed
        assert in_order == "no error, 1 graph(s)"


def test_batches_cut_for_other_ranks_fail_on_every_rank(pool):
    """Real gloo ranks, a dp 2 x cp 2 mesh: a batch shard_batch cut over the data-parallel group, and ranks of one
    CP group that cut different global batches, are refused on every rank before anything compiles."""
    for rank, (dp_cut, different) in enumerate(pool.run(batches_for_other_ranks, 4, timeout=240)):
        members = [[0, 1], [2, 3]][rank // 2]
        assert dp_cut.startswith(f"ValueError: input 'input_ids' was cut by shard_batch for rank {rank // 2} of 2 "
                                 f"(the group of global ranks {[rank % 2, rank % 2 + 2]}), but this module runs on "
                                 f"rank {rank % 2} of 2 (the group of global ranks {members})"), dp_cut
        assert different.startswith("ValueError: the CP ranks were called with different inputs (rank 1 has the "
                                    "global batch shard_batch cut (its fingerprint): "), different


# -- padding the model would read ---------------------------------------------------------------------------


class Attention(nn.Module):
    """One attention layer over embeddings and a loss: ``kind`` says how its queries see keys."""

    def __init__(self, kind: str, vocab: int = 64, dim: int = 16):
        super().__init__()
        self.kind, self.emb = kind, nn.Embedding(vocab, dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, vocab)

    def _attend(self, q, k, v):
        if self.kind == "full" or self.kind.startswith("causal"):
            return F.scaled_dot_product_attention(q, k, v, is_causal=self.kind != "full")
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        if self.kind == "hand_causal":
            pos = torch.arange(q.shape[-2], device=q.device)
            scores = scores.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
        return scores.softmax(-1) @ v

    def forward(self, input_ids, labels):
        q, k, v = self.qkv(self.emb(input_ids)).unsqueeze(1).chunk(3, dim=-1)
        h = self._attend(q, k, v).squeeze(1)
        if self.kind == "mean_mse":
            return F.mse_loss(h.sum(-1), labels.float())
        if self.kind == "causal_next_row":  # each position also reads the next one (0 past the end)
            h = h + F.pad(h, (0, 0, 0, 1))[:, 1:]
        if self.kind == "causal_longest":  # longrope's switch: the padded positions continue the count
            h = h * (torch.max(input_ids) > 60)
        if self.kind == "causal_sum_of_squares":
            return self.out(h).pow(2).sum()
        if self.kind == "causal_loss_then_sum":  # the second of two sums adds the padded rows
            loss = F.cross_entropy(self.out(h).flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
            return loss + self.out(h).pow(2).sum()
        if self.kind == "causal_shifted_labels":  # the label shift inside the model, a summed loss
            labels = F.pad(labels, (0, 1), value=-100)[:, 1:]
            return F.cross_entropy(self.out(h).flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        return F.cross_entropy(self.out(h).flatten(0, 1), labels.flatten(), ignore_index=-100)


def run(group, kind: str, seq_len: int, spec: CPSpec | None = None, **extra):
    torch.manual_seed(0)
    compiled = cp_passes.cp_compile(Attention(kind), spec, mesh=group, backend="aot_eager", verbose=False)
    ids = torch.randint(0, 64, (2, seq_len))
    local, _ = cp_passes.shard_batch({"input_ids": ids, "labels": ids.clone(), **extra}, group)
    compiled(**{k: v.clone() for k, v in local.items()})
    return compiled


@pytest.mark.parametrize("kind, what", [
    ("full", "aten.scaled_dot_product_attention.default at "),
    ("hand_full", "aten.matmul.default at "),
    ("mean_mse", "aten.mse_loss.default at "),
    ("causal_next_row", "a shift that reads 1 row(s) later: the last real rows read the padding"),
    ("causal_sum_of_squares", "a sum over the sequence returned as this rank's share: it adds the padded rows"),
    ("causal_loss_then_sum", "a sum over the sequence returned as this rank's share: it adds the padded rows"),
    ("causal_longest", "a max over the sequence read as a whole: it reads the padded rows"),
])
def test_padding_a_model_reads_is_refused_at_the_first_call(group, kind, what):
    with pytest.raises(CPCompileError) as info:
        run(group, kind, 120)
    text = str(info.value)
    assert text.startswith("shard_batch padded the sequence from 120 to 128 positions (a multiple of 16 under the "
                           "balanced layout), and the model reads those padded positions from real ones"), text
    assert what in text and "test_batch_layout.py:" in text
    assert "fix: pass sequences whose length is a multiple of 16" in text
    run(group, kind, 128)


@pytest.mark.parametrize("kind, spec", [("causal", None), ("hand_causal", None),
                                        ("hand_causal", CPSpec(attention_keys="all")), ("causal_shifted_labels", None)])
def test_end_padding_under_causal_attention_is_accepted(group, kind, spec):
    """Hand-written causal attention that brings every key (as the spec asks) still reads no later key; labels
    shifted in the model read the padded labels, ignore_index like the shift's fill, and a summed loss that
    ignores them adds nothing for the padded rows."""
    run(group, kind, 120, spec)


def test_padding_is_refused_on_a_cached_graph_too(group):
    compiled = run(group, "full", 128)
    ids = torch.randint(0, 64, (2, 120))
    local, _ = cp_passes.shard_batch({"input_ids": ids, "labels": ids}, group)
    with pytest.raises(CPCompileError, match="shard_batch padded the sequence from 120 to 128 positions"):
        compiled(**local)
    assert len(compiled.compile_records) == 1


def modernbert(attn: str):
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    config = ModernBertConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, global_attn_every_n_layers=2, local_attention=16,
                              max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                              cls_token_id=1, sep_token_id=2)
    torch.manual_seed(0)
    return ModernBertForMaskedLM._from_config(config, attn_implementation=attn)


def test_an_encoder_is_refused_padding_unless_an_attention_mask_hides_it(group):
    """ModernBERT (eager): every query reads every key. Its own attention_mask, padded with 0, hides padding."""
    ids = torch.randint(3, 64, (2, 126))
    compiled = cp_passes.cp_compile(modernbert("eager"), mesh=group, backend="aot_eager", verbose=False)
    local, _ = cp_passes.shard_batch({"input_ids": ids, "labels": ids}, group)
    with pytest.raises(CPCompileError) as info:
        compiled(**local)
    text = str(info.value)
    assert "padded the sequence from 126 to 128" in text and "modeling_modernbert.py" in text
    assert "attention written by hand that lets a query read later keys, with no mask from attention_mask" in text
    masked, _ = cp_passes.shard_batch({"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)},
                                      group)
    compiled(**masked)


def test_a_copy_known_by_content_speaks_only_for_a_whole_batch():
    """A doc-id map of zeros cut for the balanced layout has the contents of any other zeros: beside unmarked
    tokens it says nothing about the batch (a contiguous module takes the hand-cut batch), and a hand-cut
    balanced batch is still refused for its tokens."""
    zeros = torch.zeros(2, 64, dtype=torch.long)
    shard_for_rank({"input_ids": torch.randint(0, 100, (2, 128)), "doc_ids": zeros.repeat(1, 2)}, 1, 2)
    hand = {"input_ids": torch.randint(0, 100, (2, 64)), "doc_ids": zeros.clone()}
    assert verdict(hand, 1, kind=CONTIGUOUS).refusal is None
    assert verdict(hand, 1).refusal.startswith("cp_passes cannot tell which positions this batch holds")


# Tasks the worker pool's ranks run (pool.run(task, P, ...)).


def hand_cut_batches(group) -> list[str]:
    """Each rank passes its contiguous slice of a batch to a module on the (default) balanced layout, with
    positions and without: only the ranks after the first can see that their positions disagree, and every
    rank must raise, before any graph exists. Then packed rows, cut contiguously and in the layout's order."""
    compiled = cp_passes.cp_compile(toy_model(n_layers=1), mesh=group, backend="aot_eager", verbose=False)
    batch, rank, size = toy_batch(16), group.rank(), group.size()
    local = hand_cut(batch, rank, size)
    with_positions = error_text(lambda: compiled(**local))
    local.pop("position_ids")
    without = error_text(lambda: compiled(**local))
    batch["position_ids"] = packed_positions(2, 16, 5, seed=1)
    packed = error_text(lambda: compiled(**hand_cut(batch, rank, size)))
    in_order = error_text(lambda: compiled(**unmarked_shards(batch, size)[rank]))
    return [with_positions, without, packed, f"{in_order}, {len(compiled.compile_records)} graph(s)"]


def batches_for_other_ranks(group) -> list[str]:
    """Four ranks as dp 2 x cp 2 (CP groups [0, 1] and [2, 3]): the toy model on the CP group, fed batches cut
    the wrong way (see test_batches_cut_for_other_ranks_or_in_another_order_fail_on_every_rank)."""
    import torch.distributed as dist

    cp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    world_rank = dist.get_rank()
    cp, dp = cp_groups[world_rank // 2], dp_groups[world_rank % 2]
    compiled = cp_passes.cp_compile(toy_model(), mesh=cp, backend="aot_eager", verbose=False)
    batch = toy_batch(32)
    dp_cut = error_text(lambda: compiled(**cp_passes.shard_batch(batch, dp)[0]))
    own = toy_batch(32, seed=world_rank)  # a data loader each rank seeds its own way
    different = error_text(lambda: compiled(**cp_passes.shard_batch(own, cp)[0]))
    return [dp_cut, different]
