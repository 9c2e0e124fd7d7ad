"""Parity with the single-device model on real gloo process groups, forward and gradients.

Tolerances (fp32): outputs max abs diff <= 1e-5; every parameter gradient, summed over ranks, within
1e-5 of the single-device gradient relative to that gradient's largest entry (or to 1e-4 of the model's largest
entry, for a gradient that cancels to less). Lengths that do not
divide P are padded by shard_batch (labels padded with the ignore index), and only valid positions
are compared.
"""

import pytest
import torch
import torch.nn.functional as F

import cp_passes
from cp_passes.layout import Layout
from family_models import hf_parity
from parity import compare, hf_reference, toy_reference
from shared import (Mixer, additive_mask_from_ids, in_global_order, mixer_batch, param_grads, small_parity, toy_batch,
                    toy_parity)


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
        results.append({"loss": loss.detach(), "logits": logits.detach(), "grads": param_grads(model),
                        "valid": layout.valid, "positions": layout.positions, "records": [(r.rule, r.transport)
                                                           for r in compiled.compile_records[-1].records]})
    return results


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


class RunningExtremes(torch.nn.Module):
    """cummax / cummin of integers, booleans and floats with NaN: values and indices, no gradients."""

    def forward(self, input_ids):
        nan = torch.where(input_ids == 7, float("nan"), input_ids.float())
        return (input_ids.to(torch.uint8).cummin(1), (input_ids % 3 == 0).cummax(1), (input_ids % 3 == 0).cummin(1),
                input_ids.cummin(1), nan.cummax(1), nan.cummin(1))

class GlobalExtremes(torch.nn.Module):
    """max, min, any and all of integer and boolean metadata over the whole sequence or per row (longrope's
    ``torch.max(position_ids) + 1``): every rank returns the single-device values."""

    def forward(self, input_ids):
        small = input_ids.to(torch.uint8)
        return (input_ids.max(), torch.min(input_ids), input_ids.amax(dim=1), input_ids.amin(dim=(0, 1)),
                small.amax(dim=1, keepdim=True), input_ids.to(torch.int32).min(), (input_ids == 0).any(),
                (input_ids == 0).any(dim=1), (input_ids < 9).all(dim=-1), (input_ids < 9).all(),
                torch.max(input_ids) + 1 > 8)


TOY_CASES = [
    # (P, backend, kv_repeat, global lengths, position_ids passed?)
    (1, "aot_eager", "expand", [16, 13], False),
    # P = 2 on aot_eager by default: test_saved_keys_parity, test_halo_parity, test_packed_documents_match_one_device
    pytest.param(2, "aot_eager", "expand", [16, 13], False, marks=pytest.mark.full),
    (2, "inductor", "repeat_interleave", [16], True),  # lowered for the one length (packed parity: any length)
    pytest.param(2, "inductor", "repeat_interleave", [16, 11], True, marks=pytest.mark.full),  # then symbolic
    pytest.param(4, "aot_eager", "sdpa", [16, 13, 6], False, marks=pytest.mark.full),  # P = 4: test_halo_parity
]


@pytest.mark.parametrize("P,backend,kv_repeat,seq_lens,pass_positions", TOY_CASES,
                         ids=[f"P{c[0]}-{c[1]}-{c[2]}-{len(c[3])}" for c in (getattr(case, "values", case)
                                                                             for case in TOY_CASES)])
def test_toy_llama_parity(pool, parity_report, P, backend, kv_repeat, seq_lens, pass_positions):
    config = {"kv_repeat": kv_repeat}
    per_rank = pool.run(toy_parity, P, backend=backend, config=config, seq_lens=seq_lens,
                        pass_positions=pass_positions)
    for i, seq_len in enumerate(seq_lens):
        ref = toy_reference(config, seq_len, pass_positions)
        compare(f"toy-{kv_repeat}-{backend}", [r[i] for r in per_rank], *ref, seq_len, parity_report)
    # aot_eager: one graph for every length (the sequence dim is symbolic). Inductor lowers the first graph for
    # its length alone, as torch.compile does, and the next length compiles once more, for every length.
    assert per_rank[0][-1]["compiles"] == ([True, False][:len(seq_lens)] if backend == "inductor" else [False])
    rules = {rec[0] for rec in per_rank[-1][0]["records"]}
    assert "sdpa_causal" in rules and "partial_sum" in rules
    assert ("arange_positions" in rules) == (not pass_positions)


# Halo cases: (P, backend, config, global lengths). Local lengths L = length / P; windows below, at and
# 2.5x L; conv kernels 2..7 (one per layer), dilation 2, both causal forms, depthwise and full, and
# halos that span several ranks.
HALO_CASES = [
    pytest.param(1, "aot_eager", dict(window=5, conv_kernel=4), [16], marks=pytest.mark.full),
    (2, "aot_eager", dict(window=5, conv_kernel=4, conv_dilation=2), [16, 13]),      # L=8: w < L, halo 6
    pytest.param(2, "inductor", dict(window=8, conv_kernel=3, conv_form="pad", conv_depthwise=False), [16],
                 marks=pytest.mark.full),                                             # w = L
    pytest.param(4, "aot_eager", dict(window=10, n_layers=6, conv_kernel=(2, 3, 4, 5, 6, 7), conv_form="pad"),
                 [16, 14], marks=pytest.mark.full),                                   # L=4: w = 2.5 L, 3 hops
    pytest.param(4, "aot_eager", dict(conv_kernel=4, conv_dilation=2, kv_repeat="sdpa"), [8],
                 marks=pytest.mark.full),                                             # L=2: conv halo 6, 3 hops
    pytest.param(2, "aot_eager", dict(window=5, inplace_mask=True, conv_kernel=3), [16, 11],
                 marks=pytest.mark.full),                                             # band &= distance < w
    pytest.param(4, "aot_eager", dict(window=5, inplace_mask=True, conv_kernel=3), [16, 11],
                 marks=pytest.mark.full),                                             # L=4 and 3: w > L
]


@pytest.mark.parametrize("P,backend", [(2, "aot_eager"), pytest.param(4, "aot_eager", marks=pytest.mark.full),
                                       pytest.param(2, "inductor", marks=pytest.mark.full)])
def test_saved_keys_parity(pool, parity_report, P, backend):
    """CPSpec(gathered_keys="save"): the backward reads the gathered K/V autograd kept (the default gathers them
    again)."""
    seq_lens = [16, 13]
    per_rank = pool.run(toy_parity, P, backend=backend, config={}, seq_lens=seq_lens, pass_positions=False,
                        spec={"gathered_keys": "save"})
    for i, seq_len in enumerate(seq_lens):
        compare(f"ToyLlama-saved-keys-{backend}", [r[i] for r in per_rank], *toy_reference({}, seq_len, False),
                 seq_len, parity_report)


def _halo_id(case) -> str:
    p, backend, config, _ = case.values if hasattr(case, "values") else case
    return f"P{p}-{backend}-" + "-".join(f"{k}{v}" for k, v in config.items())


@pytest.mark.parametrize("P,backend,config,seq_lens", HALO_CASES,
                         ids=[_halo_id(c) for c in HALO_CASES])
def test_halo_parity(pool, parity_report, P, backend, config, seq_lens):
    per_rank = pool.run(toy_parity, P, backend=backend, config=config, seq_lens=seq_lens, pass_positions=False)
    name = "toy-" + ",".join(f"{k}={v}" for k, v in config.items()) + f"-{backend}"
    for i, seq_len in enumerate(seq_lens):
        compare(name, [r[i] for r in per_rank], *toy_reference(config, seq_len, False), seq_len, parity_report)
    rules = {rec[0] for rec in per_rank[-1][-1]["records"]}
    assert ("sdpa_window" in rules) == ("window" in config)
    assert any(r.startswith("causal_conv_") for r in rules)
    for rule, transport, moved, bound in per_rank[-1][-1]["records"]:
        if transport == "halo":
            assert moved == bound  # a halo moves exactly what the window needs


@pytest.mark.parametrize("P,config", [pytest.param(2, {}, marks=pytest.mark.full),
                                      (2, dict(window=5, conv_kernel=4, conv_dilation=2)),
                                      pytest.param(4, {}, marks=pytest.mark.full),
                                      pytest.param(4, dict(window=10, conv_kernel=3), marks=pytest.mark.full)],
                         ids=["P2-causal", "P2-window-conv", "P4-causal", "P4-window-conv"])
def test_contiguous_layout_parity(pool, parity_report, P, config):
    """CPSpec(layout="contiguous"): one range per rank, as before the balanced default (causal; a window and
    a conv whose halos span ranks)."""
    seq_lens = [16, 13]
    per_rank = pool.run(toy_parity, P, backend="aot_eager", config=config, seq_lens=seq_lens,
                        pass_positions=False, spec={"layout": "contiguous"})
    for i, seq_len in enumerate(seq_lens):
        compare("toy-contiguous-" + ",".join(f"{k}={v}" for k, v in config.items()), [r[i] for r in per_rank],
                 *toy_reference(config, seq_len, False), seq_len, parity_report)
        assert per_rank[0][i]["positions"].tolist() == list(range(per_rank[0][i]["positions"].numel()))


# (P, backend, lengths, mean_loss): mean_loss leaves out num_items_in_batch, so the model averages
# itself and cp_passes turns the mean into this rank's sum over the global count of valid labels.
# The default run's transformers Llama: test_hf_models_at_16k_parity (16,384 positions) and
# test_hf_llama_labels_shifted_in_the_model_parity (11, padded).
HF_CASES = [pytest.param(2, "aot_eager", [16, 11], False, marks=pytest.mark.full),
            pytest.param(4, "aot_eager", [16], False, marks=pytest.mark.full),
            pytest.param(2, "aot_eager", [16, 11], True, marks=pytest.mark.full)]  # the mean: labels= in the model


@pytest.mark.parametrize("P,backend,seq_lens,mean_loss", HF_CASES,
                         ids=[f"P{c[0]}-{c[1]}" + ("-mean" if c[3] else "")
                              for c in (getattr(case, "values", case) for case in HF_CASES)])
def test_hf_llama_parity(pool, parity_report, P, backend, seq_lens, mean_loss):
    per_rank = pool.run(hf_parity, P, backend=backend, seq_lens=seq_lens, mean_loss=mean_loss)
    name = f"hf-LlamaForCausalLM{'-meanloss' if mean_loss else ''}-{backend}"
    for i, seq_len in enumerate(seq_lens):
        compare(name, [r[i] for r in per_rank], *hf_reference(seq_len, mean_loss), seq_len, parity_report)


@pytest.mark.parametrize("P,seq_lens", [(2, [11]), pytest.param(2, [16, 11], marks=pytest.mark.full),
                                        pytest.param(4, [16, 13], marks=pytest.mark.full)])
def test_hf_llama_labels_shifted_in_the_model_parity(pool, parity_report, P, seq_lens):
    """model(input_ids, labels=input_ids): the model pads and slices the labels (each rank needs the next
    rank's first label: a shift of +1) and averages over the valid targets (a global mean)."""
    per_rank = pool.run(hf_parity, P, backend="aot_eager", seq_lens=seq_lens, labels_in_model=True)
    for i, seq_len in enumerate(seq_lens):
        compare("hf-LlamaForCausalLM-labels=-aot_eager", [r[i] for r in per_rank],
                 *hf_reference(seq_len, False, labels_in_model=True), seq_len, parity_report)


@pytest.mark.parametrize("P,seq_lens", [(2, [16]), pytest.param(2, [16, 11], marks=pytest.mark.full),
                                        pytest.param(4, [16, 11, 6], marks=pytest.mark.full)])
def test_hf_gemma2_eager_attention_parity(pool, parity_report, P, seq_lens):
    """Attention written by hand (Gemma2 eager: q @ k^T, soft-capping, a mask from position_ids added,
    softmax over keys, @ v), sliding and global layers, called with labels=. The sliding layers' K and V come
    as a halo of window - 1 = 3 rows (over two ranks at P = 4 and length 6), the global layers' as the causal
    prefix (only its rows moved); the masks are evaluated over the whole sequence and cut to the same keys."""
    per_rank = pool.run(hf_parity, P, backend="aot_eager", seq_lens=seq_lens, labels_in_model=True,
                        family="gemma2")
    for i, seq_len in enumerate(seq_lens):
        compare("hf-Gemma2ForCausalLM-eager-labels=-aot_eager", [r[i] for r in per_rank],
                 *hf_reference(seq_len, False, labels_in_model=True, family="gemma2"), seq_len, parity_report)
    rules = [rec[0] for rec in per_rank[0][-1]["records"]]
    assert rules.count("key_operand") == 4 and rules.count("key_mask") == 2  # K, V per layer; two masks
    row = 2 * 2 * 16 * 4  # a position of K or V before the head repeat: batch 2, 2 KV heads, head_dim 16, fp32
    layout, local = Layout(P, "balanced"), 16 // P  # the default spec's layout
    for rank, results in enumerate(per_rank):
        moved = sorted((b, bound) for rule, _, b, bound in results[0]["records"] if rule == "key_operand")
        halo = sum(layout.halo_counts(3, rank, local)[1]) * row  # the 3 rows before each chunk, from other ranks
        assert moved[:2] == [(halo, halo)] * 2, moved  # sliding K, V: exactly the window's rows
        assert all(b == bound == layout.seen_before(rank, local) * row for b, bound in moved[2:]), moved


@pytest.mark.parametrize("P,seq_lens", [(2, [16]), pytest.param(2, [16, 11], marks=pytest.mark.full),
                                        pytest.param(4, [16, 11], marks=pytest.mark.full)])
def test_hf_inkling2_parity(pool, parity_report, P, seq_lens):
    """Inkling2 as transformers writes it: the relative-position bias (query activations gathered by the
    query/key distance) and the masks are [q, k] blocks on the brought key axis; sinks extend the key axis;
    the dynamic short conv's pad + unfold takes a halo of k - 1 rows."""
    per_rank = pool.run(hf_parity, P, backend="aot_eager", seq_lens=seq_lens, labels_in_model=True,
                        family="inkling2")
    for i, seq_len in enumerate(seq_lens):
        compare("hf-Inkling2ForCausalLM-eager-labels=-aot_eager", [r[i] for r in per_rank],
                 *hf_reference(seq_len, False, labels_in_model=True, family="inkling2"), seq_len, parity_report)
    rules = [rec[0] for rec in per_rank[0][-1]["records"]]
    assert rules.count("causal_window_unfold") == 2 and rules.count("key_operand") == 4


@pytest.mark.parametrize("kind", ["contiguous", "balanced"])
@pytest.mark.parametrize("P", [2, 4])
def test_shard_batch_and_gather_sequence(pool, P, kind):
    """Each rank holds its ranges of the padded sequence (balanced: chunks r and 2P-1-r of 2P), padding at the
    end of the sequence; gather_sequence puts the rows back in order and returns each gradient to its owner."""
    seq_len = 13
    per_rank = pool.run(gather_roundtrip, P, seq_len=seq_len, kind=kind)
    layout = Layout(P, kind)
    ids = toy_batch(seq_len)["input_ids"].float()
    multiple = P * layout.chunks
    padded = -(-seq_len // multiple) * multiple
    local = padded // P
    for rank, r in enumerate(per_rank):
        assert r["layout"] == (seq_len, padded, tuple(layout.ranges(i, local) for i in range(P)))
        assert torch.equal(r["full"], ids)
        weights = torch.arange(1, padded + 1, dtype=torch.float32)
        weights[seq_len:] = 0
        positions = r["positions"]
        assert torch.equal(positions, layout.positions(rank, local))
        assert torch.equal(r["grad"], P * weights[positions].expand(2, local))
        padding = positions >= seq_len
        assert (r["local"]["labels"][:, padding] == -100).all() and (r["local"]["input_ids"][:, padding] == 0).all()


def _scan_reference(model: str, seq_len: int):
    torch.manual_seed(0)
    module = SCAN_MODELS[model]()
    loss, logits = module(**scan_batch(model, seq_len))
    loss.backward()
    return loss.detach(), logits.detach(), {n: p.grad for n, p in module.named_parameters()}


@pytest.mark.parametrize("P,backend,seq_lens", [(2, "aot_eager", [16]),
                                                pytest.param(2, "aot_eager", [16, 11], marks=pytest.mark.full),
                                                pytest.param(4, "inductor", [16, 13], marks=pytest.mark.full)])
def test_running_ops_over_activations_parity(pool, parity_report, P, backend, seq_lens):
    """cumsum, cumprod, logcumsumexp, cummax and cummin (values and indices) along the sequence: each rank's
    running value combined with the carry from the preceding ranks' last values (scan); diff: the previous
    position's row (shift), the prepended row at the first position."""
    per_rank = pool.run(scan_parity, P, backend=backend, seq_lens=seq_lens, model="running_scans")
    for i, seq_len in enumerate(seq_lens):
        compare(f"running-scans-{backend}", [r[i] for r in per_rank], *_scan_reference("running_scans", seq_len),
                 seq_len, parity_report)
    rules = {rule for rule, _ in per_rank[0][0]["records"]}
    scans = {f"{op}_scan" for op in ("cumsum", "cumprod", "logcumsumexp", "cummax", "cummin")}
    assert rules == scans | {"diff_shift", "partial_sum"}


def test_an_arange_and_a_cumsum_shared_by_activations_and_a_doc_mask_parity(pool, parity_report):
    """The positions and scan transports rewire the activations' uses only; the doc-id mask, evaluated over the
    whole sequence, keeps the model's own arange and cumsum (rewiring them crashed the mask's evaluation)."""
    seq_lens = [16, 11]
    per_rank = pool.run(scan_parity, 2, backend="aot_eager", seq_lens=seq_lens, model="shared_mask_inputs")
    for i, seq_len in enumerate(seq_lens):
        compare("shared-arange-cumsum-doc-mask-aot_eager", [r[i] for r in per_rank],
                 *_scan_reference("shared_mask_inputs", seq_len), seq_len, parity_report)
    assert {"arange_positions", "cumsum_scan", "sdpa_data_mask"} <= {rule for rule, _ in per_rank[0][0]["records"]}


@pytest.mark.parametrize("mix", ["decay_attention", "shared_position_mask", "sdpa_over_a_running_sum",
                                 "window_with_key_temperature", "top_k_attention", "top_k_over_a_running_sum",
                                 pytest.param("alibi_baddbmm", marks=pytest.mark.full)])
def test_hand_written_attention_parity(pool, parity_report, mix):
    """A key-side operand that a scan makes global is brought after the scan (by hand-written attention and
    by SDPA's gather alike); a mask shared by two attentions is evaluated for both (lengths divide P: full
    attention would see the padding keys); a window whose scores read a per-key temperature takes the
    gather's prefix (a halo's zero rows would divide by zero); a top-k mask picked under no_grad from the
    activations is evaluated over the whole sequence from the gathered activations (a running sum's as its
    carry makes them); Bloom's ``alibi.baddbmm`` brings the bias with the keys, through views of the scores."""
    _mixer_parity(pool, parity_report, mix, None)


@pytest.mark.parametrize("P,layout", [(2, "contiguous"), pytest.param(2, "balanced", marks=pytest.mark.full),
                                      pytest.param(4, "contiguous", marks=pytest.mark.full),
                                      pytest.param(4, "balanced", marks=pytest.mark.full)])
def test_a_prompt_unmasked_by_a_later_addition_parity(pool, parity_report, P, layout):
    """Causal ``finfo.min`` plus ``finfo.max`` on the prompt's later keys: the masks hide only what they hide
    together, so every key comes (contiguous: rank 0's prompt queries read rank 1's keys). The cut dropped them,
    and its check evaluated one of the two masks in place of the other."""
    _mixer_parity(pool, parity_report, "prompt_unmasked_by_addition", layout, P)


def _mixer_parity(pool, parity_report, mix, layout, P=2):
    seq_lens = [16, 12] if P == 2 else [16, 24]  # multiples of 2P: the summed loss would count padded rows
    per_rank = pool.run(mixer_parity, P, mix=mix, seq_lens=seq_lens, layout=layout)
    for i, seq_len in enumerate(seq_lens):
        torch.manual_seed(0)
        model = Mixer(mix)
        loss, out = model(**mixer_batch(seq_len))
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        compare(f"mixer-{mix}-aot_eager", [r[i] for r in per_rank], loss.detach(), out.detach(), grads, seq_len,
                 parity_report)


@pytest.mark.parametrize("sdpa", [False, pytest.param(True, marks=pytest.mark.full)])
def test_additive_mask_from_token_ids_parity(pool, parity_report, sdpa):
    """Hugging Face 4.x's float padding-and-causal mask, computed in the model from input_ids (pad id 0, at
    random places in mixer batches), added to hand-written scores; and as SDPA's boolean mask == 0."""
    seq_lens = [16, 12]
    per_rank = pool.run(ids_mask_parity, 2, sdpa=sdpa, seq_lens=seq_lens)
    for i, seq_len in enumerate(seq_lens):
        torch.manual_seed(0)
        model = AdditiveIdsMask(sdpa)
        batch = mixer_batch(seq_len)
        assert bool((batch["input_ids"] == 0).any())
        loss, out = model(**batch)
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        compare(f"ids-mask-{'sdpa' if sdpa else 'scores'}-aot_eager", [r[i] for r in per_rank], loss.detach(),
                 out.detach(), grads, seq_len, parity_report)


@pytest.mark.parametrize("kind", [pytest.param("contiguous", marks=pytest.mark.full), "balanced"])
def test_running_max_and_min_of_integers_booleans_and_nan(pool, kind):
    """The sequence's first positions hold the minimum 0, the next ones a larger one: later ranges carry the
    first's (uint8 and int64 cummin once compared negated values, which wrap); booleans; a NaN is the most
    extreme value and carries on; ties pick the later index. Contiguous: 4 ranges of 4; balanced: 8 of 2,
    each rank's tail carried from ranges of every rank."""
    ids = torch.tensor([[0, 9, 4, 4, 5, 8, 6, 5, 9, 9, 3, 6, 8, 7, 1, 2],
                        [4, 7, 2, 9, 5, 6, 0, 8, 3, 3, 9, 1, 7, 2, 4, 0]])
    per_rank = pool.run(running_extremes, 4, ids=ids, kind=kind)
    for k, want in enumerate(RunningExtremes()(ids)):
        for part, expected in (("values", want.values), ("indices", want.indices)):
            got = in_global_order(per_rank, f"{k}-{part}")
            assert torch.equal(got.isnan() if got.is_floating_point() else got, expected.isnan()
                               if expected.is_floating_point() else expected), (k, part, got, expected)
            if got.is_floating_point():
                assert torch.equal(got.nan_to_num(-1), expected.nan_to_num(-1)), (k, part, got, expected)


def test_max_min_any_and_all_of_integer_metadata_are_the_global_ones(pool):
    """Each extreme sits on one rank's rows (a 9 and a 0 in the balanced layout's last chunk of row 0, a 0 in row 1's
    first); on 4 gloo ranks every rank returns the single-device max, min, any and all, per row and whole."""
    ids = torch.tensor([[3, 4, 4, 5, 8, 6, 5, 1, 7, 3, 6, 8, 7, 1, 9, 0],
                        [0, 7, 2, 8, 5, 6, 2, 8, 3, 3, 8, 1, 7, 2, 4, 5]])
    per_rank = pool.run(global_extremes, 4, ids=ids)
    for rank, outputs in enumerate(per_rank):
        for k, (got, want) in enumerate(zip(outputs, GlobalExtremes()(ids))):
            assert got.dtype == want.dtype and torch.equal(got, want), (rank, k, got, want)


# Tasks the worker pool's ranks run (pool.run(task, P, ...)).


def gather_roundtrip(group, seq_len: int, kind: str = "auto") -> dict:
    """shard_batch then gather_sequence gives back the global tensor; gradients reach their owners."""
    global_batch = toy_batch(seq_len)
    local, layout = cp_passes.shard_batch(global_batch, group, cp_passes.CPSpec(layout=kind))
    x = local["input_ids"].float().requires_grad_()
    full = cp_passes.gather_sequence(x, group, layout=layout)
    (full * torch.arange(1, seq_len + 1)).sum().backward()
    return {"full": full.detach(), "grad": x.grad, "layout": (layout.seq_len, layout.padded_len, layout.slices),
            "local": local, "positions": layout.positions}


def mixer_parity(group, mix: str, seq_lens: list[int], layout: str | None = None) -> list[dict]:
    torch.manual_seed(0)
    return small_parity(group, Mixer(mix), cp_passes.CPSpec(layout=layout) if layout else None, seq_lens)


def ids_mask_parity(group, sdpa: bool, seq_lens: list[int]) -> list[dict]:
    torch.manual_seed(0)
    return small_parity(group, AdditiveIdsMask(sdpa), None, seq_lens)


def global_extremes(group, ids: torch.Tensor) -> tuple:
    compiled = cp_passes.cp_compile(GlobalExtremes(), mesh=group, backend="aot_eager", verbose=False)
    local, _ = cp_passes.shard_batch({"input_ids": ids}, group)
    return compiled(**local)


def running_extremes(group, ids: torch.Tensor, kind: str = "auto") -> dict:
    spec = cp_passes.CPSpec(layout=kind)
    compiled = cp_passes.cp_compile(RunningExtremes(), spec, mesh=group, backend="aot_eager", verbose=False)
    local, layout = cp_passes.shard_batch({"input_ids": ids}, group, spec)
    outputs = compiled(**local)
    return {"positions": layout.positions,
            **{f"{k}-{part}": getattr(r, part) for k, r in enumerate(outputs) for part in ("values", "indices")}}
