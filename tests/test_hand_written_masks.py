"""Hand-written attention's masks under CP: evaluated at each rank's query rows and the keys it brings, never over
the whole sequence, and checked at run time (each rank its own queries, the ranks' counts added) to hide every
key a cut leaves out. Structure on a fake process group; parity and the check on real processes (the pool's
task is :func:`parity` / :func:`check_errors` here)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import cp_passes
from cp_passes.graph.analysis import meta_val
from cp_passes.tools.dryrun import dry_run, partition
from shared import summed_errors

NEG = torch.finfo(torch.float32).min


def _distance(x):
    pos = torch.arange(x.shape[1])
    return pos[:, None] - pos[None, :]


def causal_from_zeros(x, doc):  # transformers 4.x style: an additive mask filled into zeros(S, S)
    mask = torch.zeros(x.shape[1], x.shape[1]).masked_fill(_distance(x) < 0, NEG)
    return (x @ x.transpose(1, 2) + mask).softmax(-1) @ x


def causal_documents_fill(x, doc):  # packed documents, -inf fill
    hide = (_distance(x) < 0) | (doc[:, :, None] != doc[:, None, :])
    return (x @ x.transpose(1, 2)).masked_fill(hide, float("-inf")).softmax(-1) @ x


def window_heads_4d(x, doc):  # [1, 1, S, S] additive window of 5 over two heads: a halo
    d = _distance(x)
    mask = torch.zeros(1, 1, x.shape[1], x.shape[1]).masked_fill(((d < 0) | (d >= 5))[None, None], NEG)
    q = x.view(x.shape[0], x.shape[1], 2, -1).transpose(1, 2)
    return ((q @ q.transpose(-1, -2) + mask).softmax(-1) @ q).transpose(1, 2).reshape(x.shape)


def two_sided_band(x, doc):  # an encoder's band, 2 keys either side, in a helper's where
    return torch.where(_distance(x).abs() <= 2, x @ x.transpose(1, 2), NEG).softmax(-1) @ x


def window_documents(x, doc):  # window 3 inside documents
    d = _distance(x)
    hide = (d < 0) | (d >= 3) | (doc[:, :, None] != doc[:, None, :])
    return (x @ x.transpose(1, 2)).masked_fill(hide, float("-inf")).softmax(-1) @ x


def alibi_slopes(x, doc):  # a per-head bias from a constant tensor, then a causal fill
    q, d = x.view(x.shape[0], x.shape[1], 2, -1).transpose(1, 2), _distance(x)
    bias = torch.tensor([0.5, 0.25])[:, None, None] * -d.abs()
    scores = (q @ q.transpose(-1, -2) + bias).masked_fill(d < 0, float("-inf"))
    return (scores.softmax(-1) @ q).transpose(1, 2).reshape(x.shape)


def window_with_bias(x, doc):  # a window of 4, then a distance bias that hides nothing (the halo's zero rows)
    d = _distance(x)
    scores = (x @ x.transpose(1, 2)).masked_fill((d < 0) | (d >= 4), float("-inf"))
    return (scores + d.to(x.dtype) * -0.25).softmax(-1) @ x


def later_across_documents(x, doc):  # causal inside a document, every key across documents
    hide = (_distance(x) < 0) & (doc[:, :, None] == doc[:, None, :])
    return (x @ x.transpose(1, 2)).masked_fill(hide, float("-inf")).softmax(-1) @ x


def document_five_hidden(x, doc):  # the keys of document 5 hidden from every query
    hide = (_distance(x) < 0) | (doc[:, None, :] == 5)
    return (x @ x.transpose(1, 2) + torch.zeros(hide.shape).masked_fill(hide, NEG)).softmax(-1) @ x


def document_seven_seen(x, doc):  # window 3 inside documents, document 7's keys seen by every later query
    d = _distance(x)
    hide = ((d < 0) | (d >= 3) | (doc[:, :, None] != doc[:, None, :])) & ~((doc[:, None, :] == 7) & (d >= 0))
    return (x @ x.transpose(1, 2)).masked_fill(hide, float("-inf")).softmax(-1) @ x


def _rotate(x, pos):  # a rotary-like use of the positions outside the mask
    return x * torch.cos(pos[:, None].to(x.dtype) * 0.3) + x.roll(1, -1) * torch.sin(pos[:, None].to(x.dtype) * 0.3)


def rotary_and_window(x, doc):  # one arange (+ 0, as transformers' position ids) for the rotary and a window of 3
    pos = torch.arange(x.shape[1]) + 0
    x = _rotate(x, pos)
    d = pos[:, None] - pos[None, :]
    return (x @ x.transpose(1, 2)).masked_fill((d < 0) | (d >= 3), float("-inf")).softmax(-1) @ x


def rotary_and_packed_positions(x, doc):  # documents found from the positions (transformers' packed detection)
    pos = (torch.arange(x.shape[1]) + 0)[None].expand(x.shape[0], -1)
    first = pos[:, :1] - 1
    documents = (torch.diff(pos, dim=-1, prepend=first) != 1).cumsum(-1)
    x = _rotate(x, pos[0])
    hide = (pos[:, :, None] < pos[:, None, :]) | (documents[:, :, None] != documents[:, None, :])
    return (x @ x.transpose(1, 2)).masked_fill(hide, float("-inf")).softmax(-1) @ x


def table_positions_and_band(x, doc):  # positions sliced from a longer table, for the rotary and a two-sided band
    pos = torch.arange(64)[: x.shape[1]]
    x = _rotate(x, pos)
    band = (pos[:, None] - pos[None, :]).abs() <= 2
    return torch.where(band, x @ x.transpose(1, 2), NEG).softmax(-1) @ x


ATTENTIONS = {f.__name__: f for f in (causal_from_zeros, causal_documents_fill, window_heads_4d, two_sided_band,
                                      window_documents, alibi_slopes, window_with_bias, later_across_documents,
                                      document_five_hidden, document_seven_seen, rotary_and_window,
                                      rotary_and_packed_positions, table_positions_and_band)}


class Attend(nn.Module):
    def __init__(self, name: str):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.proj, self.attention = nn.Embedding(32, 8), nn.Linear(8, 8), ATTENTIONS[name]

    def forward(self, input_ids, doc_ids):
        return self.proj(self.attention(self.embed(input_ids), doc_ids)).pow(2).sum()


def batch(seq_len: int, documents: list[tuple[int, int]]) -> dict:
    """Random tokens; ``documents`` as ``(doc id, length)`` in order."""
    doc = torch.cat([torch.full((length,), d) for d, length in documents])
    ids = torch.randint(0, 32, (seq_len,), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids.expand(2, -1).clone(), "doc_ids": doc.expand(2, -1).clone()}


ROWS_ONLY_DEFAULT = ("causal_documents_fill", "window_heads_4d", "window_documents", "alibi_slopes",
                     "rotary_and_packed_positions")
"""One of each kind of mask program in the default run; the rest with -m full."""


@pytest.mark.parametrize("name", [n if n in ROWS_ONLY_DEFAULT else pytest.param(n, marks=pytest.mark.full)
                                  for n in ATTENTIONS if n != "table_positions_and_band"])  # export bounds S
def test_masks_are_evaluated_at_the_rank_rows_only(fake_group, name):
    """No value of the rewritten forward (AOTAutograd's partition) has two whole-sequence dims: the masks are
    evaluated at the rank's queries and the keys brought, the check a tile at a time inside its op."""
    run = dry_run(lambda: Attend(name), {"input_ids": ((2, 64), torch.int64), "doc_ids": ((2, 64), torch.int64)},
                  mesh=fake_group)
    notes = [r.note for r in run.record.records if r.rule == "key_mask"]
    assert notes and all("evaluated at this rank's rows and the keys brought" in n for n in notes), notes
    forward, _ = partition(run.graph, run.fakes)
    world = dist.get_world_size(fake_group)
    for node in forward.graph.nodes:
        val = meta_val(node)
        if isinstance(val, torch.Tensor):
            whole = [s for s in val.shape if isinstance(s, torch.SymInt) and str(s).startswith(f"{world}*")]
            assert len(whole) < 2, (node.format_node(), val.shape)
    assert any(node.target is torch.ops.cp_passes.outside_keys.default for node in forward.graph.nodes)


def parity(group, names: list[str], seq_len: int, documents: list) -> dict:
    """Per model: the largest relative difference of the loss and of the gradients from one device."""
    found = {}
    for name in names:
        torch._dynamo.reset()
        inputs = batch(seq_len, documents)
        model, reference = Attend(name), Attend(name)
        expected = reference(**inputs)
        expected.backward()
        compiled = cp_passes.cp_compile(model, mesh=group, backend="aot_eager", verbose=False)
        local, _ = cp_passes.shard_batch(inputs, group)
        loss = compiled(**local)
        loss.backward()
        found[name] = summed_errors(group, loss, model, expected.detach(), reference)
    return found


PARITY = ["causal_from_zeros", "causal_documents_fill", "window_heads_4d", "two_sided_band", "window_documents",
          "alibi_slopes", "window_with_bias", "rotary_and_window", "rotary_and_packed_positions",
          "table_positions_and_band"]


PARITY_DEFAULT = ["causal_documents_fill", "window_heads_4d", "two_sided_band", "rotary_and_packed_positions",
                  "table_positions_and_band"]
"""One mask of each kind (causal, window, band, positions read by the mask) in the default run."""


@pytest.mark.parametrize("P,seq_len,documents,names", [
    pytest.param(2, 16, [(0, 5), (1, 11)], PARITY_DEFAULT, id="P2"),
    pytest.param(2, 16, [(0, 5), (1, 11)], PARITY, marks=pytest.mark.full, id="P2-every-mask"),
    pytest.param(4, 24, [(0, 2), (1, 19), (2, 3)], PARITY, marks=pytest.mark.full,
                 id="P4-document-over-three-ranks"),
])
def test_hand_written_masks_match_one_device(pool, P, seq_len, documents, names):
    """Causal, windowed (shorter and longer than a rank's chunk at P = 4), two-sided and per-head masks, with
    documents, on the balanced layout: loss and gradients as on one device."""
    for rank, found in enumerate(pool.run(parity, P, names=names, seq_len=seq_len,
                                          documents=documents)):
        for name, (loss, grads) in found.items():
            assert loss < 1e-5 and grads < 1e-4, (rank, name, loss, grads)


def check_errors(group, cases: list[tuple[str, list]]) -> list[str]:
    """Each case's first error (or 'ran') on this rank: a model compiled on one document, then called on
    ``documents`` that make its masks show a key outside the keys brought, or hide every key from a query."""
    errors = []
    for name, documents in cases:
        torch._dynamo.reset()
        compiled = cp_passes.cp_compile(Attend(name), mesh=group, backend="aot_eager", verbose=False)
        compiled(**cp_passes.shard_batch(batch(16, [(0, 16)]), group)[0])
        try:
            compiled(**cp_passes.shard_batch(batch(16, documents), group)[0])
            errors.append("ran")
        except RuntimeError as error:
            errors.append(str(error))
    return errors


def test_the_run_time_check_fails_on_every_rank(pool):
    """Compiled on one document, each model's masks are causal (or a window of 3) and its keys cut; on these
    batches they show a later key across documents, a key beyond the window (document 7), or no key to the
    queries of document 5 (whose rows all lie on rank 0): every rank raises the check's message."""
    cases = [("later_across_documents", [(0, 8), (1, 8)]), ("document_seven_seen", [(7, 2), (1, 14)]),
             ("document_five_hidden", [(5, 3), (1, 13)])]
    messages = ["outside the causal prefix in this batch", "outside the window of 3 in this batch",
                "hides every key from some query"]
    for rank, errors in enumerate(pool.run(check_errors, 2, cases=cases)):
        for error, message in zip(errors, messages):
            assert message in error, (rank, error)
