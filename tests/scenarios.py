"""Builders and worker-pool tasks that several test modules share (a task one module alone runs lives in that
module). Tasks return local tensors; the tests compare them with the single-device model in the main
process."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

import cp_passes
from cp_passes.tools.models import ToyLlama, ToyLlamaConfig


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


def _grads(model) -> dict:
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
        results.append({"loss": loss.detach(), "logits": logits.detach(), "grads": _grads(model),
                        "valid": layout.valid, "positions": layout.positions,
                        "compiles": [r.static for r in compiled.compile_records],
                        "records": [(r.rule, r.transport, r.bytes, r.lower_bound_bytes)
                                    for r in compiled.compile_records[-1].records]})
    return results


def hf_llama_config(use_cache: bool = True):
    """A tiny Llama. With use_cache=False transformers 5.x builds a packed-sequence mask from
    position_ids under torch.compile, which cp_passes refuses until packed documents land."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       attn_implementation="sdpa", use_cache=use_cache)


def hf_llama(seed: int = 0, use_cache: bool = True):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(hf_llama_config(use_cache)).float()


def hf_gemma2(seed: int = 0):
    """A tiny Gemma2 with attention written by hand (eager): soft-capped scores, sliding-window layers (a
    window of 4, longer than a shard at P = 4) alternating with global ones, masks from position_ids."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                          sliding_window=4, attn_implementation="eager", use_cache=False)
    torch.manual_seed(seed)
    return Gemma2ForCausalLM(config).float()


def hf_inkling2(seed: int = 0):
    """A tiny Inkling2 text model, both layer types: eager attention with a relative-position bias from the
    queries' activations (extent 6, longer than a shard at P = 4), sinks concatenated on the key axis,
    log-scaled queries from position_ids, a short conv (sliding layers, window 4) and a dynamic one written
    with pad + unfold (full layers); MoE experts on transformers' default grouped_mm."""
    from transformers import Inkling2ForCausalLM, Inkling2TextConfig

    config = Inkling2TextConfig(**INKLING2_TEXT, attn_implementation="eager")
    torch.manual_seed(seed)
    return _inkling2_weights(Inkling2ForCausalLM(config).float())


INKLING2_TEXT = dict(
    vocab_size=128, unpadded_vocab_size=128, eos_token_id=None, hidden_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, swa_num_attention_heads=4,
    swa_num_key_value_heads=2, swa_head_dim=16, sliding_window_size=4, d_rel=8, rel_extent=6,
    log_scaling_n_floor=4, layer_types=["hybrid_sliding", "hybrid"], conv_kernel_size=3,
    moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_layers_per_attn_res_block=1,
    use_cache=False)


def _inkling2_weights(model):
    """Constant parameters (unit scales, zero queries) and std-0.02 weights would hide errors (near-uniform
    attention, no rel-pos profile): weights are drawn at 1 / sqrt(fan_in), which keeps activations O(1), and
    vectors perturbed. Larger weights make the model amplify rounding: computing the same positions with more
    masked keys then changes its own logits by more than the parity tolerance on one device."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)
            else:
                p.add_(torch.randn_like(p) * 0.3)
    return model


HF_MODELS = {"llama": hf_llama, "gemma2": hf_gemma2, "inkling2": hf_inkling2}


def hf_batch(seq_len: int, batch: int = 2, seed: int = 2, labels_in_model: bool = False) -> dict:
    """Inputs for LlamaForCausalLM: pre-shifted labels (passed as labels= and shift_labels=), or, with
    ``labels_in_model``, unshifted labels (``labels=input_ids``) that the model shifts itself."""
    b = toy_batch(seq_len, batch, vocab=128, seed=seed)
    if labels_in_model:
        return {"input_ids": b["input_ids"], "position_ids": b["position_ids"], "labels": b["input_ids"].clone()}
    return {"input_ids": b["input_ids"], "position_ids": b["position_ids"], "shift_labels": b["labels"]}


def hf_parity(group, backend: str, seq_lens: list[int], mean_loss: bool = False,
              labels_in_model: bool = False, family: str = "llama", checkpointing: bool = False) -> list[dict]:
    """LlamaForCausalLM with position_ids and pre-shifted labels. The loss is sum / global token count, given
    as num_items_in_batch, or (mean_loss) the model's own mean, which cp_passes makes global. With
    ``labels_in_model`` it is called as users do, ``model(input_ids, labels=input_ids)``, and shifts inside.
    ``checkpointing``: transformers' activation checkpointing on every decoder layer (called with use_cache=False,
    as cp_passes asks: the layers would log while turning the configured cache off)."""
    model = HF_MODELS[family]()
    call = {}
    if checkpointing:
        model.activation_checkpointing_enable()
        call["use_cache"] = False
    compiled = cp_passes.cp_compile(model, mesh=group, backend=backend, verbose=False)
    results = []
    for seq_len in seq_lens:
        global_batch = hf_batch(seq_len, labels_in_model=labels_in_model)
        local, layout = cp_passes.shard_batch(global_batch, group, compiled.spec)
        model.zero_grad()
        if labels_in_model:
            out = compiled(**local, **call)
        else:
            count = (global_batch["shift_labels"] != -100).sum()
            extra = {} if mean_loss else {"num_items_in_batch": count}
            out = compiled(**local, labels=local["shift_labels"], **extra, **call)
        out.loss.backward()
        results.append({"loss": out.loss.detach(), "logits": out.logits.detach(), "grads": _grads(model),
                        "valid": layout.valid, "positions": layout.positions, "compiles": len(compiled.compile_records),
                        "records": [(r.rule, r.transport, r.bytes, r.lower_bound_bytes)
                                    for r in compiled.compile_records[-1].records]})
    return results


class RunningScans(torch.nn.Module):
    """Every running op along the sequence over activations: cumsum, cumprod, logcumsumexp, cummax / cummin
    with their indices (token ids repeat, so equal running maxima across ranks test the tie rule), and diff
    of activations (a learned first row) and of booleans."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.start = torch.nn.Parameter(torch.randn(1, 1, 16))
        self.proj = torch.nn.Linear(7 * 16, 64)

    def forward(self, input_ids, position_ids, labels):
        h = self.embed(input_ids)
        count = (position_ids[..., None] + 1).to(h.dtype)
        top, bottom = h.cummax(1), h.cummin(1)
        features = [h.cumsum(1) / count, (torch.sigmoid(h) * 0.5 + 0.75).cumprod(1), h.logcumsumexp(1) - count.log(),
                    top.values, bottom.values, (top.indices - bottom.indices).to(h.dtype) / count,
                    torch.diff(h, dim=1, prepend=self.start.expand(h.shape[0], 1, -1))]
        even = input_ids % 2 == 0  # a boolean diff: where evenness changes (the first position from False)
        changes = torch.diff(even, dim=1, prepend=torch.zeros(even.shape[0], 1, dtype=torch.bool))
        features[-1] = features[-1] + changes.to(h.dtype)[..., None]
        logits = self.proj(torch.tanh(torch.cat(features, -1)))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        return loss, logits


class SharedMaskInputs(torch.nn.Module):
    """A model whose arange and cumsum feed both its activations and its doc-id attention mask: the transports
    rewrite them for the activations while the mask is evaluated over the whole sequence as the model wrote it."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.proj = torch.nn.Linear(16, 64)

    def forward(self, input_ids, doc_ids, labels):
        b, s = input_ids.shape
        pos = torch.arange(s, device=input_ids.device)
        count = (doc_ids >= 0).long().cumsum(1)
        h = self.embed(input_ids) + 0.01 * (pos[None, :, None] + count[..., None])
        mask = (pos[:, None] >= pos[None, :]) & (count[:, :, None] >= count[:, None, :])
        mask = mask & (doc_ids[:, :, None] == doc_ids[:, None, :])
        q = h.view(b, s, 2, 8).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask[:, None])
        logits = self.proj(out.transpose(1, 2).reshape(b, s, 16))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        return loss, logits


def shared_mask_batch(seq_len: int) -> dict:
    batch = toy_batch(seq_len, vocab=64)
    del batch["position_ids"]
    batch["doc_ids"] = (torch.arange(seq_len) >= seq_len // 3).long().expand(2, seq_len).clone()
    return batch


SCAN_MODELS = {"running_scans": RunningScans, "shared_mask_inputs": SharedMaskInputs}


def scan_batch(model: str, seq_len: int) -> dict:
    return shared_mask_batch(seq_len) if model == "shared_mask_inputs" else toy_batch(seq_len, vocab=64)


def scan_parity(group, backend: str, seq_lens: list[int], model: str) -> list[dict]:
    """One of SCAN_MODELS (running ops over activations, or an arange and a cumsum shared with a mask)."""
    name = model
    torch.manual_seed(0)
    model = SCAN_MODELS[name]()
    compiled = cp_passes.cp_compile(model, mesh=group, backend=backend, verbose=False)
    results = []
    for seq_len in seq_lens:
        batch = scan_batch(name, seq_len)
        local, layout = cp_passes.shard_batch(batch, group)
        model.zero_grad()
        loss, logits = compiled(**local)
        loss.backward()
        results.append({"loss": loss.detach(), "logits": logits.detach(), "grads": _grads(model),
                        "valid": layout.valid, "positions": layout.positions, "records": [(r.rule, r.transport)
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
    return F.scaled_dot_product_attention(q, q, q, attn_mask=positive[:, None, :, None] & positive[:, None, None, :])[:, 0]


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


MIXES = {"decay_attention": _decay_attention, "shared_position_mask": _shared_position_mask,
         "sdpa_over_a_running_sum": _sdpa_over_a_running_sum, "window_with_key_temperature": _window_with_key_temperature,
         "top_k_attention": _top_k_attention, "top_k_over_a_running_sum": _top_k_over_a_running_sum,
         "both_ways_activation_mask": _both_ways_activation_mask, "prompt_unmasked_by_addition": _prompt_unmasked_by_addition,
         "alibi_baddbmm": _alibi_baddbmm}


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
    return {"loss": loss.detach(), "logits": out.detach(), "grads": _grads(model), "valid": layout.valid,
            "positions": layout.positions,
            "records": [(r.rule, r.transport, r.bytes, r.lower_bound_bytes) for r in compiled.compile_records[-1].records]}


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


class AdditiveIdsMask(torch.nn.Module):
    """Two heads of attention under an additive mask computed from the token ids: added to hand-written scores,
    or (``sdpa``) given to SDPA as the boolean ``mask == 0`` its refusal asks for."""

    def __init__(self, sdpa: bool = False):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 8)
        self.proj = torch.nn.Linear(8, 8)
        self.sdpa = sdpa

    def forward(self, input_ids):
        x = self.embed(input_ids)
        batch, length, _ = x.shape
        mask = additive_mask_from_ids(input_ids, x.dtype)
        q = x.view(batch, length, 2, 4).transpose(1, 2)
        k, v = q * 0.5, q + 1
        if self.sdpa:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask == 0)
        else:
            o = (q @ k.transpose(-2, -1) / 2 + mask).softmax(-1) @ v
        out = self.proj(o.transpose(1, 2).reshape(batch, length, 8))
        return out.pow(2).sum(), out


class PrefixLM(torch.nn.Module):
    """Attention written by hand with a prefix-LM mask: prompt tokens (doc id 1) see each other both ways,
    the rest causally. For one document it is causal, so cp_passes brings the causal prefix and checks the
    mask each step."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 8)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, input_ids, doc_ids):
        x = self.embed(input_ids)
        pos = torch.arange(x.shape[1])
        prompt = doc_ids == 1
        allowed = (pos[None, :, None] >= pos[None, None, :]) | (prompt[:, :, None] & prompt[:, None, :])
        out = self.proj((x @ x.transpose(1, 2)).masked_fill(~allowed, float("-inf")).softmax(-1) @ x)
        return out.pow(2).sum(), out


def prefix_lm(group, prompt: int, attention_keys: str) -> dict:
    """PrefixLM on 8 tokens whose first ``prompt`` are the prompt: this rank's outputs, or the error."""
    torch.manual_seed(0)
    model = PrefixLM()
    spec = cp_passes.CPSpec(attention_keys=attention_keys)
    compiled = cp_passes.cp_compile(model, spec, mesh=group, backend="aot_eager", verbose=False)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(3))
    doc_ids = (torch.arange(8) < prompt).long().expand(2, 8)
    local, layout = cp_passes.shard_batch({"input_ids": ids, "doc_ids": doc_ids}, group, spec)
    outputs = []
    error = error_text(lambda: outputs.append(compiled(**local)[1].detach()))
    return {"error": error, "out": outputs[0] if outputs else None, "want": model(ids, doc_ids)[1].detach(),
            "positions": layout.positions}


class RunningExtremes(torch.nn.Module):
    """cummax / cummin of integers, booleans and floats with NaN: values and indices, no gradients."""

    def forward(self, input_ids):
        nan = torch.where(input_ids == 7, float("nan"), input_ids.float())
        return (input_ids.to(torch.uint8).cummin(1), (input_ids % 3 == 0).cummax(1), (input_ids % 3 == 0).cummin(1),
                input_ids.cummin(1), nan.cummax(1), nan.cummin(1))


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


def hf_one_device(model, batch: dict, seq_len: int, packed: bool) -> tuple:
    """A transformers model on one device: its output, its gradients and which positions are real (all, or the
    documents of a ``packed`` batch, which is packed here as shard_batch would)."""
    from cp_passes.data.checks import check_batch
    from cp_passes.data.packing import pack

    if packed:
        batch = pack(check_batch(batch, cp_passes.CPSpec(), ()))
    out = model(**(packed_model_inputs(batch, hf=True) if packed else batch))
    out.loss.backward()
    return out, _grads(model), batch["valid"] if packed else torch.ones(2, seq_len, dtype=torch.bool)


def packed_parity(group, model: str, backend: str, cases: list, config: dict | None = None) -> list[dict]:
    """One compiled model run on several packed batches (seq_len, layout)."""
    hf = model == "hf"
    config = dict(config or {})
    left_padding, layout = config.pop("left_padding", 0), config.pop("layout", "auto")
    balance = config.pop("balance", None)
    net = hf_llama(use_cache=False) if hf else toy_model(**config)
    rules = (cp_passes.AttentionRule("layers.*.attn", window=config["window"], left_padding=left_padding),) \
        if config.get("window") else ()
    spec = cp_passes.CPSpec(attention=rules, layout=layout)
    # every case its own length: lowered for any length from the first call, one compile
    compiled = cp_passes.cp_compile(net, spec, mesh=group, backend=backend, verbose=False, dynamic=True)
    results = []
    for seq_len, layout in cases:
        local, shard = cp_passes.shard_batch(packed_batch(seq_len, layout, 128 if hf else 256), group, spec,
                                             balance=balance)
        net.zero_grad()
        out = compiled(**packed_model_inputs(local, hf))
        loss, logits = (out.loss, out.logits) if hf else out
        loss.backward()
        results.append({"loss": loss.detach(), "logits": logits.detach(), "grads": _grads(net), "valid": shard.valid,
                        "positions": shard.positions,
                        "rules": [r.rule for r in compiled.compile_records[-1].records]})
    return results


def error_text(call) -> str:
    """``call()``'s exception as ``Type: message``, or "no error"."""
    try:
        call()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


class MarkedKeyAttention(torch.nn.Module):
    """SDPA over token embeddings with a mask read from the token ids: causal, and every query also sees token
    31 wherever it stands, later keys included. For one document without that token it is causal."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 8)

    def forward(self, input_ids):
        x = self.embed(input_ids)[:, None]
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        mask = (pos[:, None] >= pos[None, :]) | (input_ids[:, None, :] == 31)
        return F.scaled_dot_product_attention(x, x, x, attn_mask=mask[:, None])[:, 0].square().sum()


def envelope_violation(group, layout: list | None = None) -> str:
    """A doc-id mask that reaches further back than the spec's declared window must fail the first step, on
    every rank, even when only some ranks' rows leave the window."""
    net = toy_model()
    spec = cp_passes.CPSpec(attention=(cp_passes.AttentionRule("layers.*.attn", window=2),))
    compiled = cp_passes.cp_compile(net, spec, mesh=group, backend="aot_eager", verbose=False)
    local, _ = cp_passes.shard_batch(packed_batch(8, layout or [[(8, 8)]], 256), group, spec)
    return error_text(lambda: compiled(**packed_model_inputs(local, hf=False)))


class BreaksOnSomeRanks(torch.nn.Module):
    """ToyLlama whose forward has a graph break where ``breaks`` is set: those ranks cannot compile."""

    def __init__(self, breaks: bool):
        super().__init__()
        self.toy = toy_model()
        self.breaks = breaks

    def forward(self, input_ids):
        if self.breaks:
            torch._dynamo.graph_break()
        return self.toy(input_ids)


class Scaled(torch.nn.Module):
    """ToyLlama's logits times a Python float: dynamo guards on its value."""

    def __init__(self):
        super().__init__()
        self.toy = toy_model()
        self.factor = 1.0

    def forward(self, input_ids):
        return self.toy(input_ids) * self.factor


KDA_KERNEL = "transformers.models.glm5_next.modeling_glm5_next:chunk_kimi_delta_attention"


def kda_spec(form: str = "affine") -> cp_passes.CPSpec:
    return cp_passes.CPSpec(recurrences=(cp_passes.Recurrence(KDA_KERNEL, ("query", "key", "value", "g", "beta"),
                                                              form=form),))


class DeltaRule(torch.nn.Module):
    """Kimi Delta Attention as transformers writes it (chunk_kimi_delta_attention: a Python loop over chunks of
    64), called through its module attribute as Glm5Next's layers do: a [K, V] state per head flows along the
    sequence, across ranks under CP."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.qkvg = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
        self.beta = torch.nn.Linear(16, 2)
        self.out = torch.nn.Linear(16, 8)

    def forward(self, input_ids):
        from transformers.models.glm5_next import modeling_glm5_next as glm

        h = self.embed(input_ids)
        q, k, v, g = [layer(h).unflatten(-1, (2, 8)) for layer in self.qkvg]
        o, _ = glm.chunk_kimi_delta_attention(q, k, v, g=-torch.sigmoid(g), beta=torch.sigmoid(self.beta(h)),
                                              use_qk_l2norm_in_kernel=True)
        out = self.out(o.flatten(-2))
        return out.pow(2).sum(), out


def gated_scan(query, key, value, g, initial_state=None, output_final_state=False, cu_seqlens=None):
    """A gated linear recurrence written as a Python loop over positions, in flash-linear-attention's layout:
    query, key ``[B, T, H, K]``, value ``[B, T, H, V]``, g ``[B, T, H]`` (log decay); the state ``[H, K, V]``
    goes ``S <- exp(g_t) S + k_t^T v_t`` and ``o_t = q_t S``. With ``cu_seqlens`` (B = 1) document n starts
    from ``initial_state[n]`` (zeros when None), and the final states are one per document."""
    batch, length, heads, n_k = key.shape
    bounds = [0, length] if cu_seqlens is None else cu_seqlens.tolist()
    segments = ([(b, 0, length, b) for b in range(batch)] if cu_seqlens is None else
                [(0, start, stop, n) for n, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:]))])
    states = (initial_state if initial_state is not None else
              key.new_zeros(len(segments), heads, n_k, value.shape[-1]))
    outs, finals = [[] for _ in range(batch)], []
    for b, start, stop, n in segments:
        state = states[n]
        for t in range(start, stop):
            state = g[b, t].exp()[:, None, None] * state + key[b, t][:, :, None] * value[b, t][:, None, :]
            outs[b].append(torch.einsum("hk,hkv->hv", query[b, t], state))
        finals.append(state)
    return torch.stack([torch.stack(o) for o in outs]), (torch.stack(finals) if output_final_state else None)


SCAN_KERNEL = "scenarios:gated_scan"


def scan_spec(form: str = "affine") -> cp_passes.CPSpec:
    return cp_passes.CPSpec(recurrences=(cp_passes.Recurrence(SCAN_KERNEL, ("query", "key", "value", "g"), form=form,
                                                              documents="cu_seqlens"),))


class PackedScan(torch.nn.Module):
    """Token embeddings, gated_scan over packed documents (the boundaries passed as ``cu_seqlens``, the whole
    sequence's), a projection; the loss a sum of squares."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
        self.gate = torch.nn.Linear(16, 2)
        self.out = torch.nn.Linear(16, 8)

    def forward(self, input_ids, cu_seqlens=None):
        h = self.embed(input_ids)
        q, k, v = [layer(h).unflatten(-1, (2, 8)) for layer in self.qkv]
        o, _ = gated_scan(q, k, v, F.logsigmoid(self.gate(h)), cu_seqlens=cu_seqlens)
        out = self.out(o.flatten(-2))
        return out.pow(2).sum(), out


def packed_scan_batch(lengths: list[int]) -> dict:
    ids = torch.randint(0, 32, (1, sum(lengths)), generator=torch.Generator().manual_seed(5))
    return {"input_ids": ids, "cu_seqlens": torch.tensor([0, *lengths]).cumsum(0)}


KDA_LAYERS = ("linear_attention",) * 3
"""Glm5Next's first three layer types: Kimi Delta Attention."""
GLM5_LAYERS = KDA_LAYERS + ("indexed_attention",)
"""Its default pattern's first four: the fourth runs MLA over the keys a top-k indexer picks."""


def hf_glm5_next(seed: int = 0, layer_types: tuple[str, ...] = KDA_LAYERS):
    """A tiny Glm5Next text model (GLM-5.3-Flash's public relative): linear-attention (KDA) layers (short
    causal convs, the KDA recurrence) and indexed-attention layers (MLA over the keys a top-k indexer picks
    from pools of 4, plus the open pool's tail: 11 of the causal keys at most), hyper-connections, a dense MLP
    first and MoE layers after it (4 experts, top 2, transformers' default grouped_mm)."""
    from transformers import Glm5NextTextConfig, Glm5NextTextModel

    config = Glm5NextTextConfig(**_glm5_next_text(layer_types))
    torch.manual_seed(seed)
    return Glm5NextTextModel(config).float()


def _glm5_next_text(layer_types: tuple[str, ...] = KDA_LAYERS) -> dict:
    n = len(layer_types)
    return dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=n,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16,
        q_lora_rank=16, qk_rope_head_dim=0, qk_nope_head_dim=16, v_head_dim=16, index_topk=8, index_kpool=4,
        index_head_dim=16, index_n_heads=2, linear_head_dim=8, linear_num_heads=2, linear_conv_kernel_dim=4,
        hc_mult=2, hc_sinkhorn_iters=3, pad_token_id=0, use_cache=False, layer_types=list(layer_types),
        mlp_layer_types=["dense"] + ["sparse"] * (n - 1), indexer_types=["full"] * n)


def glm5_next_batch(seq_len: int) -> dict:
    ids = torch.randint(1, 128, (2, seq_len), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "position_ids": torch.arange(seq_len).expand(2, seq_len)}


def glm5_next_parity(group, seq_lens: list[int], layer_types: tuple[str, ...] = KDA_LAYERS) -> list[dict]:
    """The model with model_specs/glm5_next.py; the loss is the sum of squares of the last hidden states."""
    model = hf_glm5_next(layer_types=tuple(layer_types))
    compiled = cp_passes.cp_compile(model, "glm5_next", mesh=group, backend="aot_eager", verbose=False)
    results = []
    for seq_len in seq_lens:
        local, layout = cp_passes.shard_batch(glm5_next_batch(seq_len), group, "glm5_next")
        model.zero_grad()
        out = compiled(**local).last_hidden_state
        loss = out.pow(2).sum()
        loss.backward()
        results.append(step_result(model, compiled, loss, out, layout))
    return results


def glm5_next_packed_batch(documents: list[list[int]]) -> dict:
    """Two packed rows of Glm5Next tokens, one per list of document lengths (each row's lengths sum alike)."""
    ids = torch.randint(1, 128, (len(documents), sum(documents[0])), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "seq_lens": torch.tensor(documents)}


class Compressor(torch.nn.Module):
    """DeepSeek V4's compressor of heavily compressed attention (transformers' DeepseekV4HCACompressor) on
    token embeddings: windows of 4 positions pooled by a learned softmax gate into one entry each, rotated
    at the window's global position. Returns the sum of squares of the entries and the entries."""

    def __init__(self):
        super().__init__()
        from transformers import DeepseekV4Config
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as ds

        config = DeepseekV4Config(vocab_size=32, hidden_size=16, head_dim=8, num_hidden_layers=1, q_lora_rank=8,
                                  compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4})
        self.embed = torch.nn.Embedding(32, 16)
        self.compressor = ds.DeepseekV4HCACompressor(config)
        torch.nn.init.normal_(self.compressor.position_bias)

    def forward(self, input_ids, position_ids):
        entries, _ = self.compressor(self.embed(input_ids), None, position_ids, None, 0)
        return entries.pow(2).sum(), entries


COMPRESSOR_SPEC = cp_passes.CPSpec(name="compressor", pad_multiple=4)


def compressor_batch(seq_len: int) -> dict:
    ids = torch.randint(0, 32, (2, seq_len), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "position_ids": torch.arange(seq_len).expand(2, seq_len)}


class OverlappingWindows(torch.nn.Module):
    """The window pairing of DeepSeek V4's CSA compressor, as transformers writes it: each position projects
    to two halves; entry ``w`` pools window ``w``'s second halves with window ``w - 1``'s first halves (written
    into rows ``1:`` of a fresh tensor; window 0's slots stay zero with a -inf gate). Windows of 2."""

    def __init__(self, ratio: int = 2, dim: int = 8):
        super().__init__()
        self.ratio, self.dim = ratio, dim
        self.embed = torch.nn.Embedding(32, 16)
        self.kv_proj = torch.nn.Linear(16, 2 * dim, bias=False)
        self.gate_proj = torch.nn.Linear(16, 2 * dim, bias=False)
        self.position_bias = torch.nn.Parameter(torch.randn(ratio, 2 * dim))

    def forward(self, input_ids, position_ids):
        h = self.embed(input_ids)
        batch, ratio, dim = h.shape[0], self.ratio, self.dim
        n_windows = h.shape[1] // ratio
        kv = self.kv_proj(h).view(batch, n_windows, ratio, -1)
        gate = self.gate_proj(h).view(batch, n_windows, ratio, -1) + self.position_bias
        new_kv = kv.new_zeros((batch, n_windows, 2 * ratio, dim))
        new_gate = gate.new_full((batch, n_windows, 2 * ratio, dim), float("-inf"))
        new_kv[:, :, ratio:] = kv[..., dim:]
        new_gate[:, :, ratio:] = gate[..., dim:]
        new_kv[:, 1:, :ratio] = kv[:, :-1, :, :dim]
        new_gate[:, 1:, :ratio] = gate[:, :-1, :, :dim]
        entries = (new_kv * new_gate.softmax(dim=2)).sum(dim=2)
        return entries.pow(2).sum(), entries


class ShiftedWrite(torch.nn.Module):
    """A token shift written into a fresh tensor: ``prev[:, 1:] = h[:, :-1]`` (zeros at the first position)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 8)
        self.mix = torch.nn.Linear(16, 8)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        prev = h.new_zeros(h.shape)
        prev[:, 1:] = h[:, :-1]
        out = self.mix(torch.cat([h, prev], -1))
        return out.pow(2).sum(), out


def hf_deepseek_v4(seed: int = 0):
    """A tiny DeepseekV4ForCausalLM: a sliding-window layer (window 12, longer than the tests' shards of 8), a
    compressed-sparse-attention layer (CSA: windows of 2 paired with the previous one, a top-2 indexer) and a
    heavily-compressed one (HCA: windows of 4), attention sinks, hyper-connections, a hash-routed MoE layer
    and two routed ones (experts on transformers' default grouped_mm). Every layer's raw keys go by a halo of 11 rows."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    config = DeepseekV4Config(
        vocab_size=128, hidden_size=64, moe_intermediate_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=2, head_dim=32, q_lora_rank=16, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, hc_mult=2, hc_sinkhorn_iters=3, sliding_window=12, o_groups=2, o_lora_rank=16,
        index_n_heads=2, index_head_dim=16, index_topk=2,
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"], use_cache=False, pad_token_id=0, num_nextn_predict_layers=0)
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config).float()
    with torch.no_grad():  # a hash table that routes tokens to different experts
        for layer in model.model.layers:
            if hasattr(layer.mlp.gate, "tid2eid"):
                layer.mlp.gate.tid2eid.copy_(torch.randint(0, 4, layer.mlp.gate.tid2eid.shape,
                                                           generator=torch.Generator().manual_seed(seed)))
    return model


def deepseek_v4_spec() -> cp_passes.CPSpec:
    """model_specs/deepseek_v4.py read for the tiny config's rates (windows of 2 and 4: whole windows of 4)."""
    return cp_passes.load_spec("deepseek_v4", config=hf_deepseek_v4().config)


def deepseek_v4_batch(documents: list[list[int]] | None = None, seq_len: int = 16) -> dict:
    """Token ids with positions and labels shifted before sharding, or packed rows (one list of document
    lengths per row) with unshifted labels, which shard_batch shifts inside each document."""
    rows = 2
    length = sum(documents[0]) if documents else seq_len
    ids = torch.randint(1, 128, (rows, length), generator=torch.Generator().manual_seed(2))
    if documents:
        return {"input_ids": ids, "labels": ids.clone(), "seq_lens": torch.tensor(documents)}
    shifted = torch.cat([ids[:, 1:], torch.full((rows, 1), -100)], 1)
    return {"input_ids": ids, "position_ids": torch.arange(length).expand(rows, length), "shift_labels": shifted}


def deepseek_v4_loss(model, batch: dict, positions: bool = True):
    """The summed cross entropy of the model's logits against labels shifted inside each document; without
    ``positions`` the model numbers the tokens itself (``arange``, shared by its rotary and its masks)."""
    out = model(input_ids=batch["input_ids"], **({"position_ids": batch["position_ids"]} if positions else {}))
    return F.cross_entropy(out.logits.flatten(0, 1), batch["shift_labels"].flatten(), reduction="sum"), out.logits


STEP3P7_LAYERS = ("sliding_attention", "full_attention", "sliding_attention", "full_attention")


def hf_step3p7(seed: int = 0, moe: bool = True):
    """A tiny Step3p7TextModel (Step-5's public relative) as transformers 5.24 ships it: sliding-window layers
    (window 4) and full-attention layers, per-head q/k norms, partial RoPE, gated attention output; a dense MLP
    first, then MoE layers (4 experts, top 2, a shared expert) whose experts loop over nonzero() (the step5 spec
    runs them through transformers' grouped_mm forward)."""
    from transformers import Step3p7TextConfig, Step3p7TextModel

    torch.manual_seed(seed)
    return Step3p7TextModel(Step3p7TextConfig(**_step3p7_text(moe))).float()


def _step3p7_text(moe: bool = True) -> dict:
    return dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, layer_types=list(STEP3P7_LAYERS),
        mlp_layer_types=["dense"] + ["sparse" if moe else "dense"] * 3, sliding_window=4, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, share_expert_dim=32, max_position_embeddings=64,
        pad_token_id=0, use_cache=False)


IMAGE_TOKEN = 127
"""The image placeholder id of the tiny vision-language models."""


def hf_step3p7_vlm(seed: int = 0):
    """A tiny Step3p7ForConditionalGeneration: the text model of :func:`hf_step3p7` with a vision tower (one
    layer, patch 14) whose 112 x 112 images give 4 tokens each."""
    from transformers import Step3p7Config, Step3p7ForConditionalGeneration

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=56,
                  patch_size=14)
    config = Step3p7Config(text_config=_step3p7_text(), vision_config=vision, image_token_id=IMAGE_TOKEN,
                           use_cache=False)
    torch.manual_seed(seed)
    return Step3p7ForConditionalGeneration(config).float()


VLM_IMAGES = [[6], [2, 11]]
"""Where each row's images start (4 tokens each): row 0's crosses position 8 (a rank boundary at P = 2 and
4), row 1's first crosses 4 and its second 12 (boundaries at P = 4)."""


def vlm_batch(seq_len: int = 16, tokens: int = 4, hw: int = 112) -> dict:
    """Token ids with image placeholders at :data:`VLM_IMAGES`, positions, labels (-100 on the images), and
    every image's pixels (row 0's first)."""
    ids = torch.randint(1, 120, (len(VLM_IMAGES), seq_len), generator=torch.Generator().manual_seed(6))
    for row, starts in enumerate(VLM_IMAGES):
        for start in starts:
            ids[row, start:start + tokens] = IMAGE_TOKEN
    labels = torch.where(ids == IMAGE_TOKEN, -100, ids)
    pixels = torch.randn(sum(map(len, VLM_IMAGES)), 3, hw, hw, generator=torch.Generator().manual_seed(7))
    return {"input_ids": ids, "position_ids": torch.arange(seq_len).expand(len(VLM_IMAGES), seq_len),
            "labels": labels, "pixel_values": pixels}


def hf_inkling2_vlm(seed: int = 0):
    """A tiny Inkling2ForConditionalGeneration: the text model of :func:`hf_inkling2` with a one-layer vision
    tower; an image of grid (1, 2, 2) (28 x 28 pixels a token, channels last) gives 4 tokens."""
    from transformers import Inkling2Config, Inkling2ForConditionalGeneration

    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=14, spatial_merge_size=2,
                  posemb_grid_size=4, projection_hidden_dim=64, text_hidden_size=64)
    config = Inkling2Config(text_config=INKLING2_TEXT, vision_config=vision, image_token_id=IMAGE_TOKEN,
                            use_cache=False)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return _inkling2_weights(Inkling2ForConditionalGeneration(config).float())


def inkling2_vlm_batch() -> dict:
    """:func:`vlm_batch`'s ids, positions and labels with Inkling2's pixels: one 28 x 28 x 3 block a token."""
    batch = vlm_batch()
    images = sum(map(len, VLM_IMAGES))
    batch["pixel_values"] = torch.rand(4 * images, 28, 28, 3, generator=torch.Generator().manual_seed(7)) * 2 - 1
    batch["image_grid_thw"] = torch.tensor([[1, 2, 2]] * images)
    return batch


class MeasuredSplice(torch.nn.Module):
    """Image features spliced into token embeddings after Inkling2's count check, which measures the masked
    embeddings (``inputs_embeds[mask].numel() == features.numel()``); one causal attention layer mixes them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(128, 16)
        self.vision = torch.nn.Linear(12, 16)
        self.qkv = torch.nn.Linear(16, 48)
        self.head = torch.nn.Linear(16, 128)

    def forward(self, input_ids, pixel_values, labels):
        x = self.embed(input_ids)
        features = self.vision(pixel_values).tanh()
        mask = (input_ids == IMAGE_TOKEN).unsqueeze(-1).expand_as(x)
        torch._check(x[mask].numel() == features.numel())
        x = x.masked_scatter(mask, features)
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
        logits = self.head(x + h)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum"), logits


def measured_splice_batch() -> dict:
    batch = vlm_batch()
    batch.pop("position_ids")
    batch["pixel_values"] = torch.randn(4 * sum(map(len, VLM_IMAGES)), 12, generator=torch.Generator().manual_seed(8))
    return batch


def hf_glm5_next_vlm(seed: int = 0):
    """A tiny Glm5NextForConditionalGeneration: the text model of :func:`hf_glm5_next` with a one-layer vision
    tower; an image of grid (1, 4, 4) patches (flattened, 1176 values each) gives 4 tokens after the 2 x 2
    merge. Image and video markers take ids above the batches' (120..126)."""
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    vision = dict(depth=1, hidden_size=32, num_heads=2, patch_size=14, temporal_patch_size=2, spatial_merge_size=2,
                  out_hidden_size=64, intermediate_size=64, projection_intermediate_size=64, image_size=56)
    config = Glm5NextConfig(text_config=_glm5_next_text(), vision_config=vision, image_token_id=IMAGE_TOKEN,
                            video_token_id=126, image_start_token_id=125, image_end_token_id=124,
                            video_start_token_id=123, video_end_token_id=122, use_cache=False)
    torch.manual_seed(seed)
    return Glm5NextForConditionalGeneration(config).float()


def glm5_next_vlm_batch() -> dict:
    """:func:`vlm_batch`'s ids, positions and labels with Glm5Next's flattened patches, 16 an image."""
    batch = vlm_batch()
    images = sum(map(len, VLM_IMAGES))
    batch["pixel_values"] = torch.randn(16 * images, 1176, generator=torch.Generator().manual_seed(7))
    batch["image_grid_thw"] = torch.tensor([[1, 4, 4]] * images)
    return batch


VLM_MODELS = {"step3p7": (hf_step3p7_vlm, vlm_batch, "step5"),
              "inkling2": (hf_inkling2_vlm, inkling2_vlm_batch, "inkling2"),
              "glm5_next": (hf_glm5_next_vlm, glm5_next_vlm_batch, "glm5_next")}
"""Each vision-language model: builder, batch, spec."""


def step3p7_batch(documents: list[list[int]] | None = None, seq_len: int = 16) -> dict:
    """Token ids with positions, or packed rows (one list of document lengths per row)."""
    length = sum(documents[0]) if documents else seq_len
    ids = torch.randint(1, 128, (2, length), generator=torch.Generator().manual_seed(4))
    if documents:
        return {"input_ids": ids, "seq_lens": torch.tensor(documents)}
    return {"input_ids": ids, "position_ids": torch.arange(length).expand(2, length)}


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


def dp_cp_micro_batches(step: int, seq_lens: list[int], dp: int, replica: int | None = None) -> list[dict]:
    """The micro-batches of one step: 2 rows per replica, one global length each (an odd one padded); a
    replica's rows, or all of them (the single-device reference's concatenated batch)."""
    batches = [toy_batch(seq_len, batch=2 * dp, seed=10 * step + i) for i, seq_len in enumerate(seq_lens)]
    if replica is None:
        return batches
    rows = slice(2 * replica, 2 * replica + 2)
    return [{k: v[rows] for k, v in b.items()} for b in batches]


def bf16_step(model, mode: str, batch: dict, call=None):
    """One training step in bf16: ``mode`` "autocast" (fp32 parameters, bf16 compute) or "params" (bf16
    parameters). Returns the loss, the logits and the gradients, in fp32."""
    call = call or model
    if mode == "params":
        model.to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16) if mode == "autocast" else contextlib.nullcontext():
        loss, logits = call(**batch)
    loss.backward()
    return loss.detach().float(), logits.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}


