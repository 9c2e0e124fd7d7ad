"""A model-built mask as per-position terms and a program (``cp_passes.transports.mask_program``): the split
is exact on every tile, and a mask the split cannot write down stays a tensor."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from cp_passes.transports.mask_program import KEY, QUERY, evaluate, split_mask


def _documents(doc, q, k):
    return (q[:, None] >= k[None, :]) & (doc.index_select(1, q)[:, :, None] == doc.index_select(1, k)[:, None, :])


def _padded(doc, q, k):  # padding as doc id -1, read on the key side only
    return _documents(doc, q, k) & (doc.index_select(1, k) != -1)[:, None, :]


def _window(doc, q, k):  # a difference compared on the grid
    return (q[:, None] - k[None, :] < 4) & _documents(doc, q, k)


def _additive(doc, q, k):  # 0 / -inf, then a head dim
    return torch.where(_documents(doc, q, k), 0.0, float("-inf"))[:, None]


def _bidirectional(doc, q, k):  # an encoder's documents, a negated term
    return ~(doc.index_select(1, q)[:, :, None] != doc.index_select(1, k)[:, None, :])


def _indexed(doc, q, k):  # transformers' packed mask: ids indexed by broadcast index tensors, casts
    rows = torch.arange(doc.shape[0])[:, None, None]
    same = doc[rows, q[None, :, None]] == doc[rows, k[None, None, :]]
    return ((k[None, None, :] <= q[None, :, None]).float().to(torch.bool) & same)[:, None].expand(-1, 3, -1, -1)


def _blocks_of_four(doc, q, k):  # a keyword argument that computes: floor division on the grid
    return torch.div(q[:, None] - k[None, :], 4, rounding_mode="floor") == 0


def _cumulative(doc, q, k):  # a reduction along the keys: not elementwise
    return (q[:, None] >= k[None, :]).cumsum(-1) > 0


def _per_position(t: torch.Tensor) -> bool:
    """A query term ``[.., n, 1]``, a key term ``[.., 1, m]`` or ``[m]``, or a scalar: nothing ``[n, m]``."""
    return t.dim() <= 1 or t.shape[-1] == 1 or t.shape[-2] == 1


def _traced(fn, doc, q, k) -> torch.fx.GraphModule:
    gm = make_fx(fn)(doc, q, k)
    for node, name in zip([n for n in gm.graph.nodes if n.op == "placeholder"], ("doc", QUERY, KEY)):
        node.target = node.name = name
    gm.recompile()
    return gm


@pytest.mark.parametrize("fn", [_documents, _padded, _window, _additive, _bidirectional, _indexed,
                                _blocks_of_four])
def test_a_split_mask_is_the_mask_on_every_tile(fn):
    doc = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 3, -1, -1], [0, 1, 1, 1, 1, 1, 2, 2, 3, 3, 3, 3]])
    q, k = torch.tensor([4, 5, 6, 7, 8, 9]), torch.arange(10)  # a rank's queries and the keys it brings
    gm = _traced(fn, doc, q, k)
    split = split_mask(gm)
    assert split is not None
    terms, program = split
    leaves = list(terms(doc, q, k))
    assert all(_per_position(t) for t in leaves)
    whole = fn(doc, q, k)
    for rows in (slice(0, 6), slice(1, 4), slice(5, 6)):
        for keys in (slice(0, 10), slice(3, 7)):
            tile = evaluate(program, leaves, rows, keys)
            assert torch.equal(tile.expand(*whole.shape[:-2], rows.stop - rows.start, keys.stop - keys.start),
                               whole[..., rows, keys]), (fn.__name__, rows, keys)


def test_a_mask_that_reduces_over_keys_stays_a_tensor():
    doc, q, k = torch.zeros(1, 8, dtype=torch.long), torch.arange(4, 8), torch.arange(8)
    assert split_mask(_traced(_cumulative, doc, q, k)) is None
