"""Ordinary training code that cp_passes used to refuse (issue 53): each a one-layer causal LM written the way
people write it, and the parity task the worker pool runs for them (``pool.run(common_code.parity, P, names=...)``).
The model's own loss: a sum over ranks of each rank's value is the single-device loss."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import cp_passes
from shared import summed_errors

V, D, H = 64, 16, 2


def _heads(x):
    return x.view(x.shape[0], x.shape[1], H, -1).transpose(1, 2)


def _causal(length):
    i = torch.arange(length)
    return i[:, None] >= i[None, :]


class Base(nn.Module):
    """Embeddings, causal SDPA over two heads, a head and a cross-entropy over pre-shifted labels."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.qkv, self.out = nn.Embedding(V, D), nn.Linear(D, 3 * D), nn.Linear(D, V)

    def attend(self, x):
        q, k, v = map(_heads, self.qkv(x).chunk(3, -1))
        return x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(x.shape)

    def loss(self, h, labels):
        return F.cross_entropy(self.out(h).flatten(0, 1), labels.flatten(), ignore_index=-100)

    def hidden(self, input_ids):
        return self.attend(self.emb(input_ids))

    def forward(self, input_ids, labels):
        return self.loss(self.hidden(input_ids), labels)


# -- attention written with einsum --------------------------------------------------------------------------


class EinsumHeadsFirst(Base):
    def attend(self, x):
        q, k, v = map(_heads, self.qkv(x).chunk(3, -1))
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / 4
        probs = scores.masked_fill(~_causal(x.shape[1]), float("-inf")).softmax(-1)
        return x + torch.einsum("bhqk,bhkd->bhqd", probs, v).transpose(1, 2).reshape(x.shape)


class EinsumSequenceFirst(Base):
    def attend(self, x):
        q, k, v = (t.view(x.shape[0], x.shape[1], H, -1) for t in self.qkv(x).chunk(3, -1))
        scores = torch.einsum("bqhd,bkhd->bqhk", q, k) / 4
        probs = scores.masked_fill(~_causal(x.shape[1])[None, :, None, :], float("-inf")).softmax(-1)
        return x + torch.einsum("bqhk,bkhd->bqhd", probs, v).reshape(x.shape)


class EinsumGateAndProjection(Base):
    """A per-position dot product (``"bsd,bsd->bs"``) and a projection (``"bsd,ed->bse"``)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D) / 4)

    def attend(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        x = x + v * torch.einsum("bsd,bsd->bs", q, k).sigmoid()[..., None]
        return super().attend(torch.einsum("bsd,ed->bse", x, self.w))


# -- losses over trimmed rows ---------------------------------------------------------------------------------


class NanoGPTLoss(Base):
    def forward(self, input_ids, labels):
        logits = self.out(self.hidden(input_ids))
        return F.cross_entropy(logits[:, :-1].reshape(-1, V), input_ids[:, 1:].reshape(-1))


class Transformers4Loss(Base):
    """transformers 4.x: shift_logits / shift_labels, CrossEntropyLoss on views, logits cast to float."""

    def forward(self, input_ids, labels):
        logits = self.out(self.hidden(input_ids)).float()
        shift_logits, shift_labels = logits[..., :-1, :].contiguous(), input_ids[..., 1:].contiguous()
        return nn.CrossEntropyLoss()(shift_logits.view(-1, V), shift_labels.view(-1))


class HeadAfterTrimSummed(Base):
    """The head applied after the trim, a log-softmax, nll_loss with reduction="sum" over labels."""

    def forward(self, input_ids, labels):
        logp = F.log_softmax(self.out(self.hidden(input_ids)[:, :-1]), -1)
        return F.nll_loss(logp.reshape(-1, V), labels[:, 1:].reshape(-1), reduction="sum") / 100


class SmoothedBackwardLoss(Base):
    """Each position predicts the token two before it, with label smoothing."""

    def forward(self, input_ids, labels):
        logits = self.out(self.hidden(input_ids))
        return F.cross_entropy(logits[:, 2:].flatten(0, 1), input_ids[:, :-2].flatten(), label_smoothing=0.1)


# -- means, masked selections, routers --------------------------------------------------------------------------


class ZLoss(Base):
    def forward(self, input_ids, labels):
        logits = self.out(self.hidden(input_ids))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten()) + 1e-2 * logits.logsumexp(-1).pow(2).mean()


class MaskedMean(Base):
    def forward(self, input_ids, labels):
        logits = self.out(self.hidden(input_ids))
        per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten().clamp(min=0), reduction="none")
        return per_token[labels.flatten() != -100].mean()


class MaskedRowsSummed(Base):
    """``h[mask]`` of a [batch, seq] mask over [batch, seq, dim] rows, summed; a mean of squares beside it."""

    def forward(self, input_ids, labels):
        h = self.hidden(input_ids)
        return self.loss(h, labels) + h[labels != -100].sum() * 1e-3 + (h.mean(1) ** 2).sum()


class OneHotRouter(Base):
    """A Switch-style load-balancing loss: top-2 experts as F.one_hot, fractions times mean probabilities."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, 4)

    def forward(self, input_ids, labels):
        h = self.hidden(input_ids)
        probs = self.router(h).softmax(-1)
        hits = F.one_hot(probs.topk(2, -1).indices, 4).sum(-2).float()
        return self.loss(h, labels) + 0.4 * (hits.mean(dim=(0, 1)) * probs.mean(dim=(0, 1))).sum()


class CumulativeMean(Base):
    def forward(self, input_ids, labels):
        h = self.hidden(input_ids)
        steps = torch.arange(1, h.shape[1] + 1)[None, :, None]
        evens = torch.arange(2, 2 * h.shape[1] + 2, 2)[None, :, None]
        return self.loss(h + h.cumsum(1) / steps + h / evens, labels)


# -- SDPA with a float mask that adds a bias, and memory keys in front of the sequence's ---------------------------


def _alibi(length, slopes, window=None, causal=True):
    """ALiBi's ``slope * (j - i)`` per head, later keys (and keys a window or more behind) at ``-inf``."""
    i = torch.arange(length)
    distance = (i[None, :] - i[:, None]).float()
    bias = slopes[:, None, None] * (distance if causal else -distance.abs())
    hidden = i[None, :] > i[:, None] if causal else torch.zeros(length, length, dtype=torch.bool)
    if window is not None:
        hidden = hidden | (i[:, None] - i[None, :] >= window)
    return bias.masked_fill(hidden, float("-inf"))


class AlibiSDPA(Base):
    def attend(self, x):
        q, k, v = map(_heads, self.qkv(x).chunk(3, -1))
        bias = _alibi(x.shape[1], torch.tensor([0.5, 0.25]))[None]
        return x + F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(x.shape)


class AlibiSDPAGroupedWindow(Base):
    """One K/V head for two query heads (``enable_gqa``), slopes from ``pow``, keys 8 or more behind hidden."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 2 * D)

    def attend(self, x):
        q, kv = self.qkv(x).split([D, D], -1)
        k, v = kv.view(x.shape[0], x.shape[1], 1, D).transpose(1, 2).chunk(2, -1)
        slopes = torch.pow(2.0, -torch.arange(1, H + 1).float())
        bias = _alibi(x.shape[1], slopes, window=8)
        out = F.scaled_dot_product_attention(_heads(q), k, v, attn_mask=bias, enable_gqa=True)
        return x + out.transpose(1, 2).reshape(x.shape)


class AlibiSDPABidirectional(Base):
    """An encoder's ALiBi: ``-slope * |i - j|``, no key hidden."""

    def attend(self, x):
        q, k, v = map(_heads, self.qkv(x).chunk(3, -1))
        bias = _alibi(x.shape[1], torch.tensor([0.5, 0.25]), causal=False)
        return x + F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(x.shape)


class MemoryKeys(Base):
    """Four learned memory K/V rows in front of the sequence's keys, every query sees them; causal otherwise."""

    def __init__(self):
        super().__init__()
        self.mem_k, self.mem_v = nn.Parameter(torch.randn(1, H, 4, D // H)), nn.Parameter(torch.randn(1, H, 4, D // H))

    def attend(self, x):
        q, k, v = map(_heads, self.qkv(x).chunk(3, -1))
        b, s = x.shape[:2]
        k = torch.cat([self.mem_k.expand(b, -1, -1, -1), k], 2)
        v = torch.cat([self.mem_v.expand(b, -1, -1, -1), v], 2)
        mask = torch.cat([torch.ones(s, 4, dtype=torch.bool), _causal(s)], 1)
        return x + F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(x.shape)


class MemoryKeysAfterFloatMask(MemoryKeys):
    """The memory after the sequence's keys, a float 0 / -inf causal mask padded with zeros for it."""

    def attend(self, x):
        q, k, v = map(_heads, self.qkv(x).chunk(3, -1))
        b, s = x.shape[:2]
        k = torch.cat([k, self.mem_k.expand(b, -1, -1, -1)], 2)
        v = torch.cat([v, self.mem_v.expand(b, -1, -1, -1)], 2)
        mask = F.pad(torch.zeros(s, s).masked_fill(~_causal(s), float("-inf")), (0, 4))
        return x + F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(x.shape)


class AlibiRowsSeeingNothing(Base):
    """ALiBi whose rows from 20 on see no key: SDPA answers 0 there (the adversarial round's NaN)."""

    def attend(self, x):
        q, k, v = map(_heads, self.qkv(x).chunk(3, -1))
        i = torch.arange(x.shape[1])
        bias = _alibi(x.shape[1], torch.tensor([0.5, 0.25])).masked_fill(i[:, None] >= 20, float("-inf"))
        return x + F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(x.shape)


class MemoryRowsSeeingNothing(MemoryKeys):
    """The memory hidden from rows 0 and 1, the sequence's keys strictly before: row 0 sees no key."""

    def attend(self, x):
        q, k, v = map(_heads, self.qkv(x).chunk(3, -1))
        b, s = x.shape[:2]
        i = torch.arange(s)
        k = torch.cat([self.mem_k.expand(b, -1, -1, -1), k], 2)
        v = torch.cat([self.mem_v.expand(b, -1, -1, -1), v], 2)
        mask = torch.cat([(i[:, None] >= 2).expand(s, 4), i[:, None] > i[None, :]], 1)
        return x + F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(x.shape)


class MemoryAndAlibi(MemoryKeys):
    """Memory keys in front, ALiBi over the sequence's keys: one float mask ``cat([0, alibi], -1)``."""

    def attend(self, x):
        q, k, v = map(_heads, self.qkv(x).chunk(3, -1))
        b, s = x.shape[:2]
        k = torch.cat([self.mem_k.expand(b, -1, -1, -1), k], 2)
        v = torch.cat([self.mem_v.expand(b, -1, -1, -1), v], 2)
        mask = torch.cat([torch.zeros(H, s, 4), _alibi(s, torch.tensor([0.5, 0.25]))], -1)
        return x + F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(x.shape)


class WrittenOut(MemoryKeys):
    """ALiBi with rows that see no key, memory keys hidden from the first rows, memory and ALiBi (one compile)."""

    def attend(self, x):
        x = AlibiRowsSeeingNothing.attend(self, x)
        return MemoryAndAlibi.attend(self, MemoryRowsSeeingNothing.attend(self, x))


# -- causal masks that are no band: read at the rank's rows ------------------------------------------------


class ChunkedSDPA(Base):
    """Llama 4's chunked attention written as a mask: a query sees the earlier keys of its chunk of 8."""

    def attend(self, x):
        q, k, v = map(_heads, self.qkv(x).chunk(3, -1))
        i = torch.arange(x.shape[1])
        mask = (i[:, None] >= i[None, :]) & (i[:, None] // 8 == i[None, :] // 8)
        return x + F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(x.shape)


class EveryOtherEarlierKey(Base):
    """Every other earlier key (a strided causal mask)."""

    def attend(self, x):
        q, k, v = map(_heads, self.qkv(x).chunk(3, -1))
        i = torch.arange(x.shape[1])
        mask = (i[:, None] >= i[None, :]) & ((i[:, None] - i[None, :]) % 2 == 0)
        return x + F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(x.shape)


class StrictlyEarlierKeys(Base):
    """Only strictly earlier keys: the first query sees none (SDPA answers 0 there)."""

    def attend(self, x):
        q, k, v = map(_heads, self.qkv(x).chunk(3, -1))
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril(-1)
        return x + F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(x.shape)


# -- learned relative-position biases (T5's, a decoder's, clamped tables) -------------------------------------


def _log_buckets(distance, buckets=8, max_distance=32):
    """T5's unidirectional buckets of ``i - j >= 0``: exact below ``buckets // 2``, logarithmic up to
    ``max_distance``."""
    exact = buckets // 2
    large = exact + (torch.log(distance.float().clamp(min=1) / exact) / math.log(max_distance / exact)
                     * (buckets - exact)).long()
    return torch.where(distance < exact, distance, large.clamp(max=buckets - 1))


class Relative(Base):
    """A learned table per head of relative distances (``nn.Embedding``)."""

    def __init__(self, size=16):
        super().__init__()
        self.table = nn.Embedding(size, H)


class RelativeTableSDPA(Relative):
    """SDPA with ``attn_mask = table[clamp(i - j, 0, 15)]`` and later keys at ``-inf``."""

    def attend(self, x):
        q, k, v = map(_heads, self.qkv(x).chunk(3, -1))
        i = torch.arange(x.shape[1])
        bias = self.table((i[:, None] - i[None, :]).clamp(0, 15)).permute(2, 0, 1)
        bias = bias.masked_fill(~_causal(x.shape[1]), float("-inf"))
        return x + F.scaled_dot_product_attention(q, k, v, attn_mask=bias[None]).transpose(1, 2).reshape(x.shape)


class RelativeTableEager(Relative):
    """A decoder's T5 bias written by hand: ``scores + table[bucket(i - j)]`` (log buckets), a causal
    ``masked_fill``, the table read by indexing its weight."""

    def attend(self, x):
        q, k, v = map(_heads, self.qkv(x).chunk(3, -1))
        i = torch.arange(x.shape[1], device=x.device)
        bias = self.table.weight[_log_buckets((i[:, None] - i[None, :]).clamp(min=0))].permute(2, 0, 1)
        scores = (q @ k.transpose(-2, -1)) / 4 + bias.unsqueeze(0)
        probs = scores.masked_fill(~_causal(x.shape[1]), float("-inf")).softmax(-1)
        return x + (probs @ v).transpose(1, 2).reshape(x.shape)


class RelativeTableWindowed(Relative):
    """``table[i - j]`` for the 8 keys a query sees (a window), written with ``torch.where`` and einsum."""

    def attend(self, x):
        q, k, v = map(_heads, self.qkv(x).chunk(3, -1))
        i = torch.arange(x.shape[1])
        distance = i[:, None] - i[None, :]
        seen = (distance >= 0) & (distance < 8)
        bias = F.embedding(distance.clamp(0, 7), self.table.weight).permute(2, 0, 1)
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / 4
        scores = torch.where(seen, scores + bias, float("-inf"))
        return x + torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), v).transpose(1, 2).reshape(x.shape)


class GatedRelativeTable(Relative):
    """A relative table scaled per query by an activation: the table is the learned bias of positions, the gate an
    operand on the query axis."""

    def attend(self, x):
        q, k, v = map(_heads, self.qkv(x).chunk(3, -1))
        i = torch.arange(x.shape[1])
        gate = torch.sigmoid(x.sum(-1))[:, None, :, None]
        bias = self.table((i[:, None] - i[None, :]).clamp(0, 15)).permute(2, 0, 1) * gate
        scores = (q @ k.transpose(-2, -1)) / 4 + bias
        probs = scores.masked_fill(~_causal(x.shape[1]), float("-inf")).softmax(-1)
        return x + (probs @ v).transpose(1, 2).reshape(x.shape)


class DataDependentBias(Relative):
    """A relative table plus a difference of an activation's values at the query and the key: a bias no longer of
    positions and parameters alone."""

    def attend(self, x):
        q, k, v = map(_heads, self.qkv(x).chunk(3, -1))
        i = torch.arange(x.shape[1])
        s = x.sum(-1)
        pairs = (s[:, :, None] - s[:, None, :])[:, None]
        bias = self.table((i[:, None] - i[None, :]).clamp(0, 15)).permute(2, 0, 1) + pairs
        scores = (q @ k.transpose(-2, -1)) / 4 + bias
        probs = scores.masked_fill(~_causal(x.shape[1]), float("-inf")).softmax(-1)
        return x + (probs @ v).transpose(1, 2).reshape(x.shape)


# -- the older rotary cache check -------------------------------------------------------------------------------


class CachedRotary(nn.Module):
    """transformers 4.x's rotary embedding: a cache of ``max_len`` rows, checked against the length."""

    def __init__(self, dim: int, max_len: int):
        super().__init__()
        self.max_seq_len_cached = max_len
        freqs = torch.outer(torch.arange(max_len).float(), 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("cos_cached", torch.cat([freqs, freqs], -1).cos(), persistent=False)
        self.register_buffer("sin_cached", torch.cat([freqs, freqs], -1).sin(), persistent=False)

    def forward(self, x, seq_len):
        if seq_len > self.max_seq_len_cached:
            raise ValueError(f"{seq_len} positions are more than the {self.max_seq_len_cached} cached")
        return self.cos_cached[:seq_len], self.sin_cached[:seq_len]


def _rotate(x):
    a, b = x.chunk(2, -1)
    return torch.cat([-b, a], -1)


class CachedRotaryModel(Base):
    def __init__(self, max_len: int = 256):
        super().__init__()
        self.rotary = CachedRotary(D // H, max_len)

    def attend(self, x):
        q, k, v = map(_heads, self.qkv(x).chunk(3, -1))
        cos, sin = self.rotary(v, seq_len=x.shape[1])
        q, k = q * cos + _rotate(q) * sin, k * cos + _rotate(k) * sin
        return x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(x.shape)


# -- one row owned by one rank: pooling -------------------------------------------------------------------------


class Classifier(Base):
    """A classification head over pooled rows; the label of a row is its first label's class (of 3). The loss is
    whole: every rank holds the single-device value."""

    def __init__(self):
        super().__init__()
        self.cls = nn.Linear(D, 3)

    def classify(self, pooled, labels):
        return F.cross_entropy(self.cls(pooled), labels[:, 0] % 3)


class LastToken(Classifier):
    def forward(self, input_ids, labels):
        return self.classify(self.hidden(input_ids)[:, -1], labels)


class FirstAndSecondLast(Classifier):
    def forward(self, input_ids, labels):
        h = self.hidden(input_ids)
        return self.classify(h[:, 0] + h[:, -2], labels)


class LastNonPadding(Classifier):
    """transformers' sequence-classification pick: the argmax of ``arange * (ids != pad)``, then an index."""

    def forward(self, input_ids, labels):
        logits = self.cls(self.hidden(input_ids))
        last = (torch.arange(input_ids.shape[-1], dtype=torch.int32) * (input_ids != 0).to(torch.int32)).argmax(-1)
        return F.cross_entropy(logits[torch.arange(input_ids.shape[0]), last], labels[:, 0] % 3)


class GatheredLength(Classifier):
    """The row at the count of non-padding tokens minus one, read with gather; a weight penalty beside it."""

    def forward(self, input_ids, labels):
        h = self.hidden(input_ids)
        last = (input_ids != 0).sum(-1) - 1
        pooled = h.gather(1, last[:, None, None].expand(-1, 1, h.shape[-1])).squeeze(1)
        return self.classify(pooled, labels) + 1e-2 * self.cls.weight.pow(2).sum()


class PooledAndTokens(Classifier):
    """A per-token loss (a share) and a pooled classification loss (whole) added: the whole one enters as 1/P."""

    def forward(self, input_ids, labels):
        h = self.hidden(input_ids)
        return self.loss(h, labels) + 0.5 * self.classify(h.index_select(1, torch.tensor([0, 5])).mean(1), labels)


class Pooled(Classifier):
    """Every pick in one model (one compile): the last row, the first, the argmax pick, gather and a weight
    penalty, in one whole loss."""

    def forward(self, input_ids, labels):
        h = self.hidden(input_ids)
        last = (torch.arange(input_ids.shape[-1]) * (input_ids != 0)).argmax(-1)
        count = (input_ids != 0).sum(-1) - 1
        gathered = h.gather(1, count[:, None, None].expand(-1, 1, h.shape[-1])).squeeze(1)
        pooled = h[:, -1] + h[:, 0] + h[torch.arange(h.shape[0]), last] * gathered
        return self.classify(pooled, labels) + 1e-2 * self.cls.weight.pow(2).sum()


class ReturnsWeight(Classifier):
    """The loss and a parameter as it is, the objective over both: dynamo hands the parameter back from the
    module, outside any graph."""

    def forward(self, input_ids, labels):
        return self.classify(self.hidden(input_ids)[:, 0], labels), self.cls.weight


class PickedRows(Classifier):
    """Rows by an index tensor of constants and negative ones, sequence-first ``[S, B, D]`` picks, rows of 4-D
    heads: the adversarial round's exact cases."""

    def forward(self, input_ids, labels):
        h = self.hidden(input_ids)
        heads = _heads(h)
        first = h.transpose(0, 1)
        pooled = h[:, torch.tensor([-1, -2, 3])].sum(1) + first[-1] + first[5] + heads[..., -3, :].flatten(1)
        return self.classify(pooled + h.select(1, -3), labels)


POOLED = {c.__name__: c for c in (LastToken, FirstAndSecondLast, LastNonPadding, GatheredLength, PooledAndTokens,
                                  Pooled, ReturnsWeight, PickedRows)}
"""Models whose loss is whole (each rank holds the single-device value) or a share that adds a whole term."""


def _objective(out):
    """The loss, or the loss and ``1e-2 * |w|^2`` of a returned weight."""
    return out[0] + 1e-2 * out[1].pow(2).sum() if isinstance(out, tuple) else out


class Everyday(OneHotRouter):
    """Every kind above in one model (one compile): einsum attention, a running mean over ``arange(1, S + 1)``, a
    one-hot router's balancing loss, the nanoGPT loss over trimmed rows, a z-loss and a masked mean."""

    attend = EinsumSequenceFirst.attend

    def forward(self, input_ids, labels):
        h = self.hidden(input_ids)
        h = h + h.cumsum(1) / torch.arange(1, h.shape[1] + 1)[None, :, None]
        probs = self.router(h).softmax(-1)
        hits = F.one_hot(probs.topk(2, -1).indices, 4).sum(-2).float()
        logits = self.out(h)
        per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten().clamp(min=0), reduction="none")
        return (F.cross_entropy(logits[:, :-1].reshape(-1, V), input_ids[:, 1:].reshape(-1))
                + 0.4 * (hits.mean(dim=(0, 1)) * probs.mean(dim=(0, 1))).sum()
                + 1e-2 * logits.logsumexp(-1).pow(2).mean() + per_token[labels.flatten() != -100].mean())


MODELS = {c.__name__: c for c in (
    EinsumHeadsFirst, EinsumSequenceFirst, EinsumGateAndProjection, NanoGPTLoss, Transformers4Loss,
    HeadAfterTrimSummed, SmoothedBackwardLoss, ZLoss, MaskedMean, MaskedRowsSummed, OneHotRouter, CumulativeMean,
    CachedRotaryModel, AlibiSDPA, AlibiSDPAGroupedWindow, AlibiSDPABidirectional, MemoryKeys,
    MemoryKeysAfterFloatMask, AlibiRowsSeeingNothing, MemoryRowsSeeingNothing, MemoryAndAlibi, WrittenOut,
    RelativeTableSDPA, RelativeTableEager, RelativeTableWindowed, GatedRelativeTable, DataDependentBias,
    ChunkedSDPA, EveryOtherEarlierKey, StrictlyEarlierKeys, Everyday)}


def batch(seq_len: int) -> dict:
    """Token ids (the last 5 of row 1 are 0) and labels shifted before sharding, 4 of row 0 ignored."""
    ids = torch.randint(1, V, (2, seq_len), generator=torch.Generator().manual_seed(1))
    ids[1, -5:] = 0
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    labels[0, 3:7] = -100
    return {"input_ids": ids, "labels": labels}


def _run(group, model_class, seq_len: int, layout: str | None, objective=lambda out: out):
    """``model_class`` on one device and compiled on this rank's shard, each backward from ``objective`` of its
    output: ``(compiled model, reference, this rank's objective, one device's)``."""
    torch._dynamo.reset()
    spec = cp_passes.CPSpec(layout=layout) if layout else None
    model, reference = model_class(), model_class()
    inputs = batch(seq_len)
    expected = objective(reference(**inputs))
    expected.backward()
    compiled = cp_passes.cp_compile(model, spec, mesh=group, backend="aot_eager", verbose=False)
    loss = objective(compiled(**cp_passes.shard_batch(inputs, group, spec)[0]))
    loss.backward()
    return model, reference, loss, expected.detach()


def parity(group, names: list[str], seq_len: int, layout: str | None = None) -> dict:
    """Per model: the relative difference of the ranks' summed losses and of their summed gradients from one
    device's."""
    found = {}
    for name in names:
        model, reference, loss, expected = _run(group, MODELS[name], seq_len, layout)
        found[name] = summed_errors(group, loss, model, expected, reference)
    return found


def pooled_parity(group, names: list[str], seq_len: int, layout: str | None = None) -> dict:
    """Per model: the relative difference from one device's loss of this rank's loss (whole) or of the ranks'
    losses added (a share: ``PooledAndTokens``), and of the ranks' summed gradients."""
    found = {}
    for name in names:
        model, reference, loss, expected = _run(group, POOLED[name], seq_len, layout, _objective)
        shares, grads = summed_errors(group, loss, model, expected, reference)
        whole = (abs(loss.detach() - expected) / abs(expected)).item()
        found[name] = (shares if name == "PooledAndTokens" else whole, grads)
    return found


def sequence_classification(group, seq_len: int, padded_rows: int) -> tuple[float, float, float]:
    """transformers' LlamaForSequenceClassification as shipped (the last non-padding token's logits, picked by an
    argmax over the sequence), row 1 ending in ``padded_rows`` pad tokens, ``labels=`` and ``attention_mask``:
    this rank's loss and logits against one device's, and the ranks' summed gradients."""
    import torch.distributed as dist
    import transformers

    def make():
        torch.manual_seed(0)
        return transformers.LlamaForSequenceClassification(transformers.LlamaConfig(
            vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_labels=3, pad_token_id=0))

    torch._dynamo.reset()
    inputs = batch(seq_len)
    ids = inputs["input_ids"]
    ids[1, ids.shape[1] - padded_rows:] = 0
    mask, labels = (ids != 0).long(), torch.tensor([1, 2])
    model, reference = make(), make()
    expected = reference(input_ids=ids, attention_mask=mask, labels=labels)
    expected.loss.backward()
    compiled = cp_passes.cp_compile(model, mesh=group, backend="aot_eager", verbose=False)
    out = compiled(**cp_passes.shard_batch({"input_ids": ids, "attention_mask": mask}, group)[0], labels=labels)
    out.loss.backward()
    grads = 0.0
    for p, r in zip(model.parameters(), reference.parameters()):
        g = p.grad.clone()
        dist.all_reduce(g, group=group)
        error = ((g - r.grad).norm() / r.grad.norm()).item()
        grads = max(grads, error if error == error else float("inf"))  # a NaN is no match
    loss = (abs(out.loss - expected.loss) / expected.loss).item()
    return loss, (out.logits - expected.logits).abs().max().item(), grads


def rotary_lengths(group, lengths: list[int], max_len: int) -> list[str]:
    """CachedRotaryModel with a cache of ``max_len`` rows called at each global length in turn: what happened."""
    torch._dynamo.reset()
    compiled = cp_passes.cp_compile(CachedRotaryModel(max_len), mesh=group, backend="aot_eager", verbose=False)
    out = []
    for seq_len in lengths:
        try:
            compiled(**cp_passes.shard_batch(batch(seq_len), group)[0])
            out.append(f"ran ({len(compiled.compile_records)} graphs)")
        except Exception as error:
            out.append(f"{type(error).__name__}: {error}")
    return out
