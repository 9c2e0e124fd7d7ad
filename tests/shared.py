"""Toy models, batches and worker-pool tasks that several test modules share (a builder or task one module alone
uses lives in that module; transformers models several modules build are in ``family_models.py``). Tasks return
local tensors; the tests compare them with the single-device model in the main process."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import cp_passes
from cp_passes.tools.models import ToyLlama, ToyLlamaConfig


MIXED = ToyLlamaConfig(n_layers=4, window=5, conv_kernel=(0, 3, 0, 3))
"""Sliding-window attention on packed documents in every block, a causal convolution in every other one: two
kinds of block, each called twice."""


def mixed_toy():
    """The factory ``python -m cp_passes explain tests.shared:mixed_toy`` plans (tests/test_cli.py): a module a
    user's factory could be, importing only cp_passes."""
    return ToyLlama(MIXED)


def toy_batch(seq_len: int, batch: int = 2, vocab: int = 256, seed: int = 1) -> dict:
    """A global batch: token ids, positions, and labels shifted before sharding (-100 at the end)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq_len), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((batch, 1), -100)], dim=1)
    return {"input_ids": ids, "position_ids": torch.arange(seq_len).expand(batch, seq_len).clone(), "labels": labels}


def in_global_order(results: list[dict], key: str, dim: int = 1) -> torch.Tensor:
    """Every rank's ``key`` concatenated along ``dim`` and put in the order of the global sequence: each
    result names its local rows' global positions (``"positions"``, from ``ShardLayout.positions``). Along
    windows of ``m`` positions (fewer rows than positions) a window's order is its first position's."""
    rows = torch.cat([r[key] for r in results], dim)
    if results[0]["positions"].dim() == 2:  # interleaved documents: each batch row in its own order (dim 1)
        order = torch.argsort(torch.cat([r["positions"] for r in results], 1), dim=1)
        return rows.gather(1, order.view(*order.shape, *[1] * (rows.dim() - 2)).expand(rows.shape))
    positions = torch.cat([r["positions"][::r["positions"].numel() // r[key].shape[dim]] for r in results])
    return rows.index_select(dim, torch.argsort(positions))


def toy_model(seed: int = 0, **config) -> ToyLlama:
    torch.manual_seed(seed)
    return ToyLlama(ToyLlamaConfig(**config))


def summed_errors(group, loss, model, expected, reference) -> tuple[float, float]:
    """The ranks' ``loss`` values added against one device's ``expected``, and the ranks' gradients of ``model``
    added against ``reference``'s: the largest relative differences (of the loss, of a parameter's gradient by
    norm)."""
    import torch.distributed as dist

    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    grads = 0.0
    for p, r in zip(model.parameters(), reference.parameters()):
        if r.grad is None:  # a parameter the loss does not read (the LM head of a classifier)
            grads = max(grads, 0.0 if p.grad is None else float("inf"))
            continue
        g = p.grad.clone()
        dist.all_reduce(g, group=group)
        error = ((g - r.grad).norm() / r.grad.norm()).item()
        grads = max(grads, error if error == error else float("inf"))  # a NaN is no match
    return (abs(total - expected) / abs(expected)).item(), grads


def param_grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def toy_parity(group, backend: str, config: dict, seq_lens: list[int], pass_positions: bool,
               spec: dict | None = None) -> list[dict]:
    """One compiled toy model, one forward/backward per global length."""
    model = toy_model(**config)
    spec = cp_passes.CPSpec(**spec) if spec else None
    compiled = cp_passes.cp_compile(model, spec, mesh=group, backend=backend, verbose=False)
    results = []
    for seq_len in seq_lens:
        local, layout = cp_passes.shard_batch(toy_batch(seq_len), group, spec)
        if not pass_positions:
            local.pop("position_ids")
        model.zero_grad()
        loss, logits = compiled(**local)
        loss.backward()
        results.append({"loss": loss.detach(), "logits": logits.detach(), "grads": param_grads(model),
                        "valid": layout.valid, "positions": layout.positions,
                        "compiles": [r.static for r in compiled.compile_records],
                        "records": [(r.rule, r.transport, r.bytes, r.lower_bound_bytes)
                                    for r in compiled.compile_records[-1].records]})
    return results


def _decay_attention(x):
    """Scores plus a decay bias from a running sum over the sequence (forgetting attention): the key side of
    the bias is a scan's output, brought after the scan made it global."""
    decay = torch.nn.functional.logsigmoid(x[..., 0]).cumsum(1)
    scores = x @ x.transpose(1, 2) + (decay[:, :, None] - decay[:, None, :])
    return scores.softmax(-1) @ x


def _shared_position_mask(x):
    """Two hand-written causal attentions sharing one mask built from positions."""
    pos = torch.arange(x.shape[1])
    mask = torch.zeros(x.shape[1], x.shape[1]).masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    for _ in range(2):
        x = x + (x @ x.transpose(1, 2) / 4 + mask).softmax(-1) @ x
    return x


def _sdpa_over_a_running_sum(x):
    """Causal SDPA whose keys are the running sum itself: the gather must read the scan's global values."""
    q = x[:, None]
    k = q.cumsum(2)
    return torch.nn.functional.scaled_dot_product_attention(q, k, q, is_causal=True)[:, 0]


def _window_with_key_temperature(x):
    """A window of 3 (a band mask from positions) over scores divided by a per-key temperature: the
    temperature lands on the key axis besides K and V, so the keys come as a gather's prefix, not as a halo
    whose zero rows would divide by zero."""
    pos = torch.arange(x.shape[1])
    band = (pos[:, None] - pos[None, :] >= 0) & (pos[:, None] - pos[None, :] < 3)
    temperature = torch.nn.functional.softplus(x[..., 0]) + 0.5
    scores = (x @ x.transpose(1, 2)) / temperature[:, None, :]
    return scores.masked_fill(~band, float("-inf")).softmax(-1) @ x


def _top_k(x, indexed, values):
    """Sparse attention as an indexer writes it: under no_grad, scores from ``indexed`` pick each query's 3
    best causal keys (top-k), the indices are scattered into a boolean mask; attention over ``x`` sees those
    keys only and reads ``values``."""
    s = x.shape[1]
    causal = torch.arange(s)[:, None] >= torch.arange(s)[None, :]
    with torch.no_grad():
        index = (indexed @ indexed.transpose(1, 2)).masked_fill(~causal, float("-inf"))
        picked = index.topk(min(3, s), dim=-1).indices
        keep = torch.zeros(x.shape[0], s, s, dtype=torch.bool).scatter(-1, picked, True) & causal
    return (x @ x.transpose(1, 2)).masked_fill(~keep, float("-inf")).softmax(-1) @ values


def _top_k_attention(x):
    return _top_k(x, x, x)


def _top_k_over_a_running_sum(x):
    """The indexer reads a running sum that the values use too: the mask's leaf is the scan's output as the
    carry makes it, not the shard's own running sum."""
    running = x.cumsum(1)
    return _top_k(x, running, running)


def _both_ways_activation_mask(x):
    """SDPA with a boolean mask computed from activations that lets queries see later keys."""
    q, positive = x[:, None], x.sum(-1) > 0
    mask = positive[:, None, :, None] & positive[:, None, None, :]
    return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)[:, 0]


def _prompt_unmasked_by_addition(x):
    """A prefix LM written as causal attention plus an un-mask: ``finfo.min`` above the diagonal, then
    ``finfo.max`` added back on the first 10 tokens' later keys, where the two sum to a score of 0. A query of
    the prompt sees keys past its rank's causal prefix."""
    pos = torch.arange(x.shape[1])
    later = pos[None, :] > pos[:, None]
    prompt = (pos[:, None] < 10) & (pos[None, :] < 10)
    causal = torch.zeros(later.shape).masked_fill(later, torch.finfo(x.dtype).min)
    unmask = torch.zeros(later.shape).masked_fill(later & prompt, torch.finfo(x.dtype).max)
    return (x @ x.transpose(1, 2) / 4 + causal + unmask).softmax(-1) @ x


def _alibi_baddbmm(x):
    """Bloom's attention over 2 heads: ``alibi.baddbmm(q, k^T)`` (a slope times the key position), viewed as
    ``[batch, heads, S, S]`` for a causal ``finfo.min`` fill, and back for ``bmm`` with V."""
    b, s, d = x.shape
    q = x.view(b, s, 2, d // 2).transpose(1, 2).reshape(b * 2, s, d // 2)
    pos = torch.arange(s)
    alibi = (torch.tensor([0.5, 0.25]).repeat(b)[:, None] * pos[None, :])[:, None, :]
    scores = alibi.baddbmm(q, (q * 0.5).transpose(1, 2), beta=1.0, alpha=0.5).view(b, 2, s, s)
    scores = scores.masked_fill(pos[None, :] > pos[:, None], torch.finfo(x.dtype).min)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).view(b * 2, s, -1)
    return torch.bmm(probs, q + 1).view(b, 2, s, d // 2).transpose(1, 2).reshape(b, s, d)


def _attention_masked_by_positions(x, mask):
    pos = torch.arange(x.shape[1])
    q = x[:, None]
    return F.scaled_dot_product_attention(q, q, q, attn_mask=mask(pos[:, None], pos[None, :]))[:, 0]


def _chunks_of_1024(x):
    """Llama 4's chunked attention (chunks of 1,024, causal within): not a band; a band of 1,024 holds it."""
    return _attention_masked_by_positions(x, lambda q, k: (k <= q) & (q // 1024 == k // 1024))


def _window_until_late_rows(x):
    """A window of 4, except that the queries past 6,000 see every earlier and later key: no band holds it, and
    evaluated at 4,100 positions it reads as a window."""
    return _attention_masked_by_positions(x, lambda q, k: ((k <= q) & (k > q - 4)) | (q > 6000))


MIXES = {"decay_attention": _decay_attention, "shared_position_mask": _shared_position_mask,
         "sdpa_over_a_running_sum": _sdpa_over_a_running_sum,
         "window_with_key_temperature": _window_with_key_temperature,
         "top_k_attention": _top_k_attention, "top_k_over_a_running_sum": _top_k_over_a_running_sum,
         "both_ways_activation_mask": _both_ways_activation_mask,
         "prompt_unmasked_by_addition": _prompt_unmasked_by_addition,
         "alibi_baddbmm": _alibi_baddbmm, "chunks_of_1024": _chunks_of_1024,
         "window_until_late_rows": _window_until_late_rows}


class Mixer(torch.nn.Module):
    """Token embeddings, one of MIXES along the sequence, a projection; the loss a sum of squares."""

    def __init__(self, mix: str):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 8)
        self.proj = torch.nn.Linear(8, 8)
        self.mix = MIXES[mix]

    def forward(self, input_ids):
        out = self.proj(self.mix(self.embed(input_ids)))
        return out.pow(2).sum(), out


def mixer_batch(seq_len: int) -> dict:
    return {"input_ids": torch.randint(0, 32, (2, seq_len), generator=torch.Generator().manual_seed(3))}


def step_result(model, compiled, loss, out, layout) -> dict:
    """One step's results on this rank: loss, outputs, gradients, which rows are real, the rewrite table."""
    return {"loss": loss.detach(), "logits": out.detach(), "grads": param_grads(model), "valid": layout.valid,
            "positions": layout.positions,
            "records": [(r.rule, r.transport, r.bytes, r.lower_bound_bytes)
                        for r in compiled.compile_records[-1].records]}


def small_parity(group, model, spec, seq_lens: list[int], batch=None) -> list[dict]:
    """A model called as ``loss, out = model(input_ids=...)`` on ``batch(seq_len)`` (mixer batches by default),
    one compiled model for every length: this rank's results, each with the number of graphs compiled so far."""
    compiled = cp_passes.cp_compile(model, spec, mesh=group, backend="aot_eager", verbose=False)
    results = []
    for seq_len in seq_lens:
        local, layout = cp_passes.shard_batch((batch or mixer_batch)(seq_len), group, spec)
        model.zero_grad()
        loss, out = compiled(**local)
        loss.backward()
        results.append({**step_result(model, compiled, loss, out, layout), "compiles": len(compiled.compile_records)})
    return results


def additive_mask_from_ids(input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Hugging Face 4.x's causal and padding masks (pad id 0), combined: ``[B, 1, S, S]``, 0 where a query
    attends, finfo.min elsewhere."""
    batch, length = input_ids.shape
    low = torch.finfo(dtype).min
    causal = torch.full((length, length), low)
    position = torch.arange(causal.size(-1))
    causal.masked_fill_(position < (position + 1).view(causal.size(-1), 1), 0)
    causal = causal[None, None].expand(batch, 1, length, length)
    inverted = 1.0 - (input_ids != 0)[:, None, None, :].expand(batch, 1, length, length).to(dtype)
    return causal.masked_fill(inverted.to(torch.bool), low)


def packed_batch(seq_len: int, layout: list, vocab: int, seed: int = 3) -> dict:
    """One packed row per entry of ``layout`` (lists of (slot, length)); unused slots -1000."""
    rows, width = len(layout), max(len(r) for r in layout)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq_len), generator=g)
    lens = torch.full((rows, width), -1000)
    padded = torch.full((rows, width), -1000)
    for r, docs in enumerate(layout):
        for d, (slot, length) in enumerate(docs):
            lens[r, d], padded[r, d] = length, slot
    return {"input_ids": ids, "labels": ids.clone(), "seq_lens": lens, "seq_lens_padded": padded}


def packed_model_inputs(batch: dict, hf: bool) -> dict:
    """What each model takes from a packed batch: ToyLlama reads doc_ids, transformers derives documents
    from position_ids (restarting at 0) itself; both get labels shifted inside each document."""
    keys = ("input_ids", "position_ids") + (() if hf else ("doc_ids",))
    inputs = {k: batch[k] for k in keys}
    inputs["labels"] = batch["shift_labels"]
    if hf:
        inputs["shift_labels"] = batch["shift_labels"]
    return inputs


def error_text(call) -> str:
    """``call()``'s exception as ``Type: message``, or "no error"."""
    try:
        call()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def envelope_violation(group, layout: list | None = None) -> str:
    """A doc-id mask that reaches further back than the spec's declared window must fail the first step, on
    every rank, even when only some ranks' rows leave the window."""
    net = toy_model()
    spec = cp_passes.CPSpec(attention=(cp_passes.AttentionRule("layers.*.attn", window=2),))
    compiled = cp_passes.cp_compile(net, spec, mesh=group, backend="aot_eager", verbose=False)
    local, _ = cp_passes.shard_batch(packed_batch(8, layout or [[(8, 8)]], 256), group, spec)
    return error_text(lambda: compiled(**packed_model_inputs(local, hf=False)))


class MaskedBlock(torch.nn.Module):
    """Attention under a mask it is given (``[S, S]``), or that it builds from document ids (``[B, S]``) or from
    positions (``[S]``); optionally also returning the sum of its output."""

    def __init__(self, returns_sum: bool = False):
        super().__init__()
        self.qkv, self.returns_sum = torch.nn.Linear(8, 24), returns_sum

    def forward(self, x, mask_or_ids):
        if mask_or_ids.dim() == 1:  # positions: causal attention
            mask_or_ids = mask_or_ids[:, None] >= mask_or_ids[None, :]
        elif mask_or_ids.dtype != torch.bool:  # document ids: causal attention within each document
            pos = torch.arange(x.shape[1])
            ids = mask_or_ids
            mask_or_ids = ((pos[:, None] >= pos[None, :]) & (ids[:, :, None] == ids[:, None, :]))[:, None]
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 4).permute(2, 0, 3, 1, 4)
        out = x + F.scaled_dot_product_attention(q, k, v, attn_mask=mask_or_ids).transpose(1, 2).flatten(2)
        return (out, out.sum()) if self.returns_sum else out
