"""``shard_batch(..., balance="documents")``: packed documents dealt out head and tail, and the compiled module's
proof that the model cannot tell. The batch side is checked on its own; the proof on a fake process group, for
models that keep documents apart and variations that do not (parity and the refusal on every rank at once run
on real processes: tests/test_packed_parity.py and the last test here)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cp_passes
from cp_passes import CPSpec
from cp_passes.data.batch import shard_for_rank
from cp_passes.data.checks import check_batch
from cp_passes.data.packing import pack
from cp_passes.tools.dryrun import dry_run
from cp_passes.tools.models import ToyLlama, ToyLlamaConfig
from shared import error_text, packed_batch, packed_model_inputs, toy_model

LAYOUT = [[(7, 6), (9, 9), (4, 4), (12, 12)]] * 2
"""Two packed rows of 32 positions with the same document lengths (other tokens): documents shorter than their
slots, and one longer than a rank's share at P = 2."""


def shards(world: int, **kwargs):
    batch = packed_batch(32, LAYOUT, 256)
    return [shard_for_rank(batch, rank, world, **kwargs) for rank in range(world)]


def gathered(parts, key: str) -> torch.Tensor:
    return parts[0][1].in_global_order(torch.cat([local[key] for local, _ in parts], 1))


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_holds_a_head_and_a_tail_of_every_document(world):
    """Document d (padded to a multiple of 2P, cut in 2P pieces of ``size``) gives rank r its positions
    ``[r * size, (r + 1) * size)`` in the head half and ``[(2P - 1 - r) * size, ...)`` in the tail half, up to its real
    length: the same causal work from every document on every rank."""
    parts = shards(world, balance="documents")
    pieces = 2 * world
    for row, documents in enumerate(LAYOUT):
        for rank, (local, _) in enumerate(parts):
            halves = zip(local["doc_ids"][row].chunk(2), local["position_ids"][row].chunk(2),
                         (rank, pieces - 1 - rank))
            for doc_ids, positions, piece in halves:
                for d, (slot, real) in enumerate(documents):
                    size = -(-slot // pieces)
                    first = piece * size
                    assert positions[doc_ids == d].tolist() == list(range(first, min(real, first + size))), (rank, d)


@pytest.mark.parametrize("world", [2, 4])
def test_in_global_order_gives_the_packed_row_back(world):
    """Gathered and put in order, the interleaved shards are the packed row with documents aligned to 2P (what
    shard_batch gives without balance= for that alignment), every per-token value kept."""
    interleaved = shards(world, balance="documents")
    aligned = shards(world, packed_alignment=2 * world)
    for key in ("input_ids", "doc_ids", "position_ids", "shift_labels"):
        assert torch.equal(gathered(interleaved, key), gathered(aligned, key)), key
    assert torch.equal(gathered(interleaved, "doc_ids") >= 0,
                       aligned[0][1].in_global_order(torch.cat([s.valid for _, s in aligned], 1)))


def test_balance_needs_packed_rows_and_the_balanced_layout():
    with pytest.raises(ValueError, match="pass their lengths"):
        shard_for_rank({"input_ids": torch.zeros(1, 16, dtype=torch.long)}, 0, 2, balance="documents")
    with pytest.raises(ValueError, match="needs the balanced layout"):
        shard_for_rank(packed_batch(32, LAYOUT, 256), 0, 2, CPSpec(layout="contiguous"), balance="documents")
    with pytest.raises(ValueError, match="balance must be one of"):
        shard_for_rank(packed_batch(32, LAYOUT, 256), 0, 2, balance="docs")
    with pytest.raises(ValueError, match="Pass one packed row per batch"):  # rows ordered differently
        shard_for_rank(packed_batch(32, [LAYOUT[0], [(20, 18), (12, 12)]], 256), 0, 2, balance="documents")


def test_padding_rows_have_no_target():
    """Every document is padded to a multiple of 2P: those rows (doc id -1) hold ignore_index in every label key,
    the unshifted labels included, so a loss over them counts only real tokens."""
    local, _ = shard_for_rank(packed_batch(32, LAYOUT, 256), 1, 4, balance="documents")
    padding = local["doc_ids"] < 0
    assert padding.any()
    for key in ("labels", "shift_labels"):
        assert (local[key][padding] == -100).all(), key


class Probe(nn.Module):
    """Embeddings, one attention whose mask ``mask(pos, doc)`` builds, a head, and ``post`` on its output: the
    variations below change the mask, use positions elsewhere, or sum over the sequence."""

    def __init__(self, mask, extra=None, post=None):
        super().__init__()
        self.embed, self.qkv, self.out = nn.Embedding(64, 16), nn.Linear(16, 48), nn.Linear(16, 8)
        self.mask, self.extra, self.post = mask, extra, post

    def forward(self, input_ids, position_ids, doc_ids, labels):
        x = self.embed(input_ids)
        pos = torch.arange(input_ids.shape[1])
        if self.extra is not None:
            x = x + self.extra(pos, x)
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask(pos, doc_ids))
        out = self.out(out.transpose(1, 2).flatten(2))
        return out if self.post is None else self.post(out, labels)


def documents(doc):
    return doc[:, :, None] == doc[:, None, :]


def causal(pos):
    return pos[:, None] >= pos[None, :]


def causal_documents(pos, doc):  # the toy's own form, in a helper
    return ((pos[:, None] - pos[None, :]) >= 0) & documents(doc)


def ones(doc):
    return torch.ones(doc.shape[1], doc.shape[1], dtype=torch.bool)


def scrambled(pos, doc):
    """Doc ids moved between positions by an expand and a reshape (a view that is not one)."""
    heads = doc[:, :, None].expand(-1, -1, 2).reshape(doc.shape[0], -1).reshape(doc.shape[0], 2, -1)[..., None]
    return causal(pos)[None, None] & (heads == doc[:, None, None, :])


ACCEPTED = None
VARIATIONS = {  # name: (model, None if accepted else a piece of the reason)
    "toy": (lambda: ToyLlama(ToyLlamaConfig()), ACCEPTED),
    "causal mask in a helper": (lambda: Probe(lambda p, d: causal_documents(p, d)[:, None]), ACCEPTED),
    "keys before queries, logical_and": (lambda: Probe(lambda p, d: torch.logical_and(
        documents(d), p[None, :] <= p[:, None])[:, None]), ACCEPTED),
    "not a later key": (lambda: Probe(lambda p, d: (~(p[None, :] > p[:, None]) & documents(d))[:, None]), ACCEPTED),
    "documents only, both ways": (lambda: Probe(lambda p, d: documents(d)[:, None]), ACCEPTED),
    "positions from an int32 arange": (lambda: Probe(lambda p, d: (causal(p.int()) & documents(d))[:, None]),
                                       ACCEPTED),
    "toy, window 6": (lambda: ToyLlama(ToyLlamaConfig(window=6)), "halo"),
    "toy, short convolution": (lambda: ToyLlama(ToyLlamaConfig(conv_kernel=4)), "self.conv(h)"),
    "causal, documents not kept apart": (lambda: Probe(lambda p, d: causal(p)[None, None]),
                                         "documents apart"),
    "one side's doc ids twice": (lambda: Probe(lambda p, d: (causal(p) & (d[:, :, None] == d[:, :, None]))[:, None]),
                                 "documents apart"),
    "doc ids cast to bool": (lambda: Probe(lambda p, d: (causal(p) & documents(d.bool()))[:, None]),
                             "documents apart"),
    "doc ids moved by expand and reshape": (lambda: Probe(scrambled), "reshape"),
    "a band around the query": (lambda: Probe(lambda p, d: ((p[:, None] - p[None, :]).abs() < 3)
                                              & documents(d)[:, None]), "window"),
    "keys at least 2 before": (lambda: Probe(lambda p, d: (((p[:, None] - p[None, :]) >= 2)
                                                           & documents(d))[:, None]), "positions"),
    "q >= 2k (sub with alpha)": (lambda: Probe(lambda p, d: ((torch.sub(p[:, None], p[None, :], alpha=2) >= 0)
                                                             & documents(d))[:, None]), "positions"),
    "first positions": (lambda: Probe(lambda p, d: (causal_documents(p, d) | (p[None, :] < 2))[:, None]),
                        "positions"),
    "positions from a bfloat16 arange": (lambda: Probe(lambda p, d: (causal(torch.arange(
        d.shape[1], dtype=torch.bfloat16)) & documents(d))[:, None]), "arange"),
    "a window from tril and triu": (lambda: Probe(lambda p, d: (ones(d).tril() & ones(d).triu(-3)
                                                                & documents(d))[:, None]), "halo"),
    "a window from cumsum": (lambda: Probe(lambda p, d: (causal(ones(d)[0].long().cumsum(0)) & documents(d))[:, None]),
                             "aten.ones"),
    "positions as features": (lambda: Probe(lambda p, d: causal_documents(p, d)[:, None],
                                            lambda p, x: p[None, :, None].to(x.dtype) * 0.01), "arange"),
    "a loss over the labels": (lambda: Probe(lambda p, d: causal_documents(p, d)[:, None], post=loss), ACCEPTED),
    "a mean loss over the labels": (lambda: Probe(lambda p, d: causal_documents(p, d)[:, None],
                                                  post=lambda y, t: loss(y, t, "mean")), ACCEPTED),
    "a sum over the sequence": (lambda: Probe(lambda p, d: causal_documents(p, d)[:, None],
                                              post=lambda y, t: y.sum(1)), "counts the padding rows"),
    "a loss and a z-loss": (lambda: Probe(lambda p, d: causal_documents(p, d)[:, None],
                                          post=lambda y, t: loss(y, t) + 1e-2 * (y.logsumexp(-1) ** 2).sum()),
                            "counts the padding rows"),
    "a z-loss and a loss": (lambda: Probe(lambda p, d: causal_documents(p, d)[:, None],
                                          post=lambda y, t: 1e-2 * (y.logsumexp(-1) ** 2).sum() + loss(y, t)),
                            "counts the padding rows"),
    "a loss over clamped labels": (lambda: Probe(lambda p, d: causal_documents(p, d)[:, None],
                                                 post=lambda y, t: loss(y, t.clamp(min=0))), "counts the padding rows"),
}


def loss(logits, labels, reduction="sum"):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction=reduction)


def one_device(build, world: int = 4):
    """The largest difference, over real tokens, between the model's outputs on the packed row (documents aligned to
    2P) and on the interleaved row put back in order, on one device."""
    batch = check_batch(packed_batch(32, LAYOUT, 8), CPSpec(), ())  # tokens and labels < the Probe's 8 classes
    rows = [pack(batch, 2 * world, pieces) for pieces in (1, 2 * world)]
    torch.manual_seed(0)
    model = build().eval()
    with torch.no_grad():
        outs = [model(**{k: row[k] for k in ("input_ids", "position_ids", "doc_ids")}, labels=row["shift_labels"])
                for row in rows]
    packed, interleaved = (o[0] if isinstance(o, tuple) else o for o in outs)
    if packed.dim() < 2 or packed.shape[1] != rows[0]["valid"].shape[1]:  # a loss: summed in another order
        return ((packed - interleaved).abs() / packed.abs().clamp(min=1)).max().item()
    back = torch.argsort(rows[1]["order"], dim=1)
    back = back.view(*back.shape, *[1] * (interleaved.dim() - 2)).expand(interleaved.shape)
    interleaved = interleaved.gather(1, back)
    return (packed - interleaved)[rows[0]["valid"]].abs().max().item()


@pytest.mark.parametrize("name", list(VARIATIONS))
def test_the_compiler_proves_the_model_cannot_tell_or_says_where_it_can(fake_group, name):
    """Each variation's verdict, and what it means on one device: an accepted model computes the same on the packed
    and the interleaved row (several of the refused ones do not: that is what the proof is for)."""
    build, refused = VARIATIONS[name]
    inputs = {key: ((1, 16), torch.long) for key in ("input_ids", "position_ids", "doc_ids", "labels")}
    readers = dry_run(build, inputs, CPSpec(), mesh=fake_group).record.interleave_readers
    if refused is ACCEPTED:
        assert readers == [], readers
        assert one_device(build) < 1e-5
    else:
        assert readers and any(refused in line for line in readers), readers


def test_an_interleaved_batch_the_model_could_tell_fails_on_every_rank(pool):
    messages = pool.run(interleaved_refusal, 2)
    for message in messages:
        assert "documents were interleaved" in message and "keys come by a halo" in message, message


# Tasks the worker pool's ranks run (pool.run(task, P, ...)).


def interleaved_refusal(group) -> str:
    """A windowed ToyLlama (its band reads distances) on a batch whose documents shard_batch interleaved."""
    compiled = cp_passes.cp_compile(toy_model(window=6), mesh=group, backend="aot_eager", verbose=False)
    local, _ = cp_passes.shard_batch(packed_batch(16, [[(5, 5), (11, 11)]], 256), group, balance="documents")
    return error_text(lambda: compiled(**packed_model_inputs(local, hf=False)))
