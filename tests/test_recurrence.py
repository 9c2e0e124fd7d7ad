"""Recurrent kernels across ranks: a kernel declared in the spec runs as one op, and its state flows from
rank to rank (the carry transport, affine or sequential). Parity on real gloo processes against one device;
refusals on the fake process group."""


import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cp_passes
from cp_passes import CPCompileError
from cp_passes.data.batch import shard_for_rank
from cp_passes.kernels import install
from cp_passes.layout import resolve_layout
from family_models import GLM5_LAYERS, KDA_LAYERS, glm5_next_batch, glm5_next_parity, hf_glm5_next
from parity import GRAD_RTOL, compare, compare_small, glm5_next_reference, glm5_next_split_floor
from shared import mixer_batch, small_parity, step_result


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


SCAN_KERNEL = "test_recurrence:gated_scan"


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


def glm5_next_packed_batch(documents: list[list[int]]) -> dict:
    """Two packed rows of Glm5Next tokens, one per list of document lengths (each row's lengths sum alike)."""
    ids = torch.randint(1, 128, (len(documents), sum(documents[0])), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "seq_lens": torch.tensor(documents)}

STATE = 2 * 2 * 8 * 8 * 4  # DeltaRule's state: batch 2, 2 heads, K = V = 8, fp32


def _delta_rule_reference(seq_len):
    torch.manual_seed(0)
    model = DeltaRule()
    loss, out = model(**mixer_batch(seq_len))
    loss.backward()
    return loss.detach(), out.detach(), {n: p.grad for n, p in model.named_parameters()}


# P = 4 by default: at P = 2 the second rank starts from h alone and M (and the fold's order) go unchecked.
CASES = [(4, "affine"), pytest.param(1, "affine", marks=pytest.mark.full),
         pytest.param(2, "affine", marks=pytest.mark.full), pytest.param(2, "sequential", marks=pytest.mark.full),
         pytest.param(4, "sequential", marks=pytest.mark.full)]


@pytest.mark.parametrize("P,form", CASES)
def test_delta_rule_state_crosses_ranks(pool, parity_report, P, form):
    """transformers' chunk_kimi_delta_attention (a Python loop over chunks) behind its module attribute: each
    rank starts from the state the ranks before it leave, forward and backward. Bytes per rank are
    state-sized: affine gathers every rank's [h | M] once (K more columns than the state), sequential
    gathers the final states P - 1 times; the bound is the predecessor's state."""
    seq_lens = [16, 12]
    per_rank = pool.run(recurrence_parity, P, form=form, seq_lens=seq_lens)
    for i, seq_len in enumerate(seq_lens):
        compare(f"delta-rule-{form}-aot_eager", [r[i] for r in per_rank], *_delta_rule_reference(seq_len), seq_len,
                 parity_report)
    for rank, results in enumerate(per_rank):
        (carry,) = [rec for rec in results[0]["records"] if rec[1] == "carry"]
        moved = (P - 1) * 2 * STATE if form == "affine" else (P - 1) ** 2 * STATE
        assert carry == (f"carry_{form}", "carry", moved, STATE if rank else 0), carry


def _glm5_next_check(name, P, results_by_rank, batch, parity_report) -> None:
    """One device on ``batch`` against this step's results on every rank. The gradient tolerance is the larger
    of the suite's and twice the model's one-device floor (:func:`parity.glm5_next_split_floor`): computing as
    CP does moves the indexed layer's hyper-connection scale gradient, which cancels to a small total, by up to
    7.9e-4 of its size. (In fp64, where only the KDA fallback's own fp32 rounding remains, CP at P = 4 differs from one
    device by 3.80e-4, and one device computing as CP does by 3.76e-4.) Every KDA layer's short conv goes by
    halo and its recurrence by the affine carry; the indexed layer receives the other ranks' rows of what its
    indexer reads besides its own nodes (the layer input, 64 wide, and q's low-rank input, 16) and the earlier
    ranks' rows of the latent its K and V derive from (kv_lora_rank 16, moved in place of K and V's 2 heads x
    (16 + 16)): batch 2, fp32."""
    loss, out, grads = glm5_next_reference(batch, GLM5_LAYERS)
    seq_len = out.shape[1]
    # At P = 1 the split is no split; the model's sensitivity to rounding is read from a split in two.
    tolerance = max(GRAD_RTOL, 2 * glm5_next_split_floor(max(P, 2), batch, GLM5_LAYERS))
    compare(f"{name} (grad tol {tolerance:.1e})", results_by_rank, loss.detach(), out.detach(), grads, seq_len,
             parity_report, grad_rtol=tolerance)
    rules = [rec[0] for rec in results_by_rank[0]["records"]]
    assert rules.count("carry_affine") == 3 and rules.count("causal_conv_slice") == 3, rules
    assert rules.count("sdpa_data_mask") == 1, rules
    local = seq_len // P
    for rank, results in enumerate(results_by_rank):  # contiguous: rank r's causal prefix is r shards of the latent
        (indexed,) = [rec for rec in results["records"] if rec[0] == "sdpa_data_mask"]
        assert indexed[2] == indexed[3] == ((P - 1) * (64 + 16) + rank * 16) * local * 2 * 4, indexed


@pytest.mark.parametrize("P", [pytest.param(P, marks=pytest.mark.full) for P in (1, 2, 4)])
def test_glm5_next_matches_one_device(pool, parity_report, P):
    """Glm5NextTextModel (GLM-5.3-Flash's public relative) with model_specs/glm5_next.py and its default layer
    types: three KDA layers and an indexed-attention layer, whose top-k indexer (no gradient; pools of 4
    keys, the open pool's tail) is evaluated over the whole sequence from its gathered inputs: at length 16
    the last queries attend to 8 of their 16 causal keys. Hyper-connections throughout."""
    per_rank = pool.run(glm5_next_parity, P, seq_lens=[16], layer_types=GLM5_LAYERS)
    _glm5_next_check("hf-Glm5NextTextModel-kda-indexed-aot_eager", P, [r[0] for r in per_rank],
                     glm5_next_batch(16), parity_report)


@pytest.mark.full  # a recurrence over packed documents by default: test_packed_documents_restart_the_state...
@pytest.mark.parametrize("P", [2, 4])
def test_glm5_next_packed_rows_match_one_device(pool, parity_report, P):
    """Packed rows through shard_batch with the family spec: documents of 3, 9, 4 (the second across ranks 0,
    1 and 2 at P = 4, the third starting at rank 3's first position) and 8, 5, 3. The model takes the doc ids
    and per-document positions and, as its authors wrote it for CPU, reads neither: its KDA state and its
    indexer run across documents on one device too (transformers refuses cu_seqlens there, as it refuses it
    under cp_passes), so one device on the same packed rows is the reference."""
    documents = [[3, 9, 4], [8, 5, 3]]
    per_rank = pool.run(glm5_next_packed_parity, P, documents=documents, layer_types=GLM5_LAYERS)
    whole, _ = shard_for_rank(glm5_next_packed_batch(documents), 0, 1, "glm5_next")
    assert whole["doc_ids"][0].tolist() == [0] * 3 + [1] * 9 + [2] * 4, whole["doc_ids"]
    _glm5_next_check("hf-Glm5NextTextModel-packed-aot_eager", P, per_rank, whole, parity_report)


def _packed_reference(lengths: list[int]):
    """One device on the packed sequence; the kernel is first checked to restart at each document (its output
    on the packing is its output on each document alone)."""
    torch.manual_seed(0)
    model = PackedScan()
    batch = packed_scan_batch(lengths)
    loss, out = model(**batch)
    with torch.no_grad():
        bounds = batch["cu_seqlens"]
        alone = [model(batch["input_ids"][:, a:b])[1] for a, b in zip(bounds[:-1], bounds[1:])]
    torch.testing.assert_close(out.detach(), torch.cat(alone, 1), rtol=1e-6, atol=1e-6)
    loss.backward()
    return loss.detach(), out.detach(), {n: p.grad for n, p in model.named_parameters()}


PACKED = [(4, "affine"), pytest.param(1, "affine", marks=pytest.mark.full),
          pytest.param(2, "affine", marks=pytest.mark.full), pytest.param(4, "sequential", marks=pytest.mark.full)]


@pytest.mark.parametrize("P,form", PACKED)
def test_packed_documents_restart_the_state_across_ranks(pool, parity_report, P, form):
    """A kernel that takes cu_seqlens (flash-linear-attention's convention), called with the whole sequence's:
    each rank's kernel runs on its own shard's segments, the state carried into the first unless a document
    starts exactly there. At P = 4 (4 positions a rank) documents of 3, 9, 4 put the second across ranks 0, 1
    and 2 and start the third at rank 3's first position; 8, 5, 3 start one at rank 2's (at P = 2, rank 1's).
    Bytes stay state-sized."""
    documents = [[3, 9, 4], [8, 5, 3]]
    per_rank = pool.run(packed_scan_parity, P, form=form, documents=documents)
    for i, lengths in enumerate(documents):
        compare(f"packed-gated-scan-{form}-aot_eager", [r[i] for r in per_rank], *_packed_reference(lengths),
                 sum(lengths), parity_report)
    state = 2 * 8 * 8 * 4  # batch 1, 2 heads, K = V = 8, fp32
    for rank, results in enumerate(per_rank):
        (carry,) = [rec for rec in results[0]["records"] if rec[1] == "carry"]
        moved = (P - 1) * 2 * state if form == "affine" else (P - 1) ** 2 * state
        assert carry == (f"carry_{form}", "carry", moved, state if rank else 0), carry


class ReadsTheFinalState(nn.Module):
    def __init__(self):
        super().__init__()
        self.rule = DeltaRule()

    def forward(self, input_ids):
        from transformers.models.glm5_next import modeling_glm5_next as glm

        h = self.rule.embed(input_ids).unflatten(-1, (2, 8))
        out, state = glm.chunk_kimi_delta_attention(h, h, h, g=-h.sigmoid(), beta=h[..., 0].sigmoid(),
                                                    output_final_state=True)
        return out.sum() + state.sum()


def test_a_final_state_read_is_the_last_rank_s(group):
    """The final state the model reads is the sequence's on every rank: the last rank's, gathered (RecurrentGemma's
    stored states match one device, tests/test_hybrids.py); it was refused."""
    compiled = cp_passes.cp_compile(ReadsTheFinalState(), kda_spec(), mesh=group, backend="aot_eager",
                                    verbose=False)
    compiled(torch.randint(0, 32, (2, 8)))
    (carry,) = [r for r in compiled.compile_records[-1].records if r.transport == "carry"]
    assert "the final state it returns is the last rank's" in carry.note and "all_gather final state" in \
        carry.collective


def test_auto_layout_keeps_a_carry_s_shards_contiguous_and_explain_names_the_node(group):
    """A spec declaring a recurrence resolves auto to contiguous shards (the state flows from rank to rank),
    decided from the spec so shard_batch agrees; explain says so and names the carry nodes. Without one, auto
    is balanced (one rank: contiguous)."""
    layout, why = resolve_layout(kda_spec(), 8)
    assert layout.kind == "contiguous" and why.startswith(f"auto: Recurrence {KDA_KERNEL!r}")
    assert resolve_layout(cp_passes.CPSpec(), 8)[0].kind == "balanced"
    assert resolve_layout(cp_passes.CPSpec(), 1)[0].kind == "contiguous"
    compiled = cp_passes.cp_compile(DeltaRule(), kda_spec(), mesh=group, backend="aot_eager", verbose=False)
    compiled(**mixer_batch(8))
    text = cp_passes.explain(compiled, print_table=False)
    (line,) = [line for line in text.splitlines() if line.startswith("layout: ")]
    assert line.startswith("layout: contiguous (auto: Recurrence") and "nodes whose transport needs it:" in line
    assert "(carry)" in line


def test_a_balanced_layout_with_a_carry_is_refused_naming_the_node(group):
    compiled = cp_passes.cp_compile(DeltaRule(), kda_spec().replace(layout="balanced"), mesh=group,
                                    backend="aot_eager", verbose=False)
    with pytest.raises(CPCompileError) as info:
        compiled(**mixer_batch(8))
    text = str(info.value)
    assert "its transport 'carry' supports the layouts ('contiguous',), not the 'balanced' layout" in text
    assert "cp_passes.recurrence" in text and "fix: set CPSpec(layout='contiguous')" in text


def test_a_batch_sharded_for_another_layout_is_refused(group):
    """shard_batch with the default spec cuts a balanced layout; a module compiled with a recurrence's spec
    runs on contiguous shards. Feeding it that batch would be silently wrong: it is refused, naming the fix."""
    compiled = cp_passes.cp_compile(DeltaRule(), kda_spec(), mesh=group, backend="aot_eager", verbose=False)
    local, _ = shard_for_rank(mixer_batch(64), 3, 8)
    with pytest.raises(ValueError, match="sharded by shard_batch for the balanced layout, but this module was "
                                         r"compiled for the contiguous layout .*compiled.shard_batch\(batch\)"):
        compiled(**local)
    compiled(**shard_for_rank(mixer_batch(64), 3, 8, kda_spec())[0])
    compiled(**shard_for_rank(mixer_batch(64), 3, 8, compiled)[0])  # the compiled module stands for its spec


def test_the_compiled_module_shards_its_own_batches(group):
    """spec=None: cp_compile picks the shipped spec by model_type (mamba2: contiguous shards, for its recurrence);
    compiled.shard_batch cuts the batch for that spec on the module's group, so the first call runs, where
    shard_batch(batch, group) alone cuts for the default (balanced) layout and is refused."""
    from hybrid_models import batch, build

    compiled = cp_passes.cp_compile(build("mamba2"), mesh=group, backend="aot_eager", verbose=False)
    local, layout = compiled.shard_batch(batch(64))
    assert layout.layout.kind == "contiguous" and local["input_ids"].shape == (2, 8)
    compiled(**local)
    with pytest.raises(ValueError, match=r"compiled.shard_batch\(batch\)"):
        compiled(**cp_passes.shard_batch(batch(64), group)[0])


def test_a_recurrence_declaration_is_checked():
    with pytest.raises(ValueError, match="package.module:function"):
        cp_passes.Recurrence("no_colon", ("query",))
    with pytest.raises(ValueError, match="needs value_arg"):
        cp_passes.Recurrence("m:f", ("q", "v"))
    with pytest.raises(ValueError, match="'affine', 'sequential' or 'selective'"):
        cp_passes.Recurrence("m:f", ("key", "value"), form="parallel")
    with pytest.raises(ValueError, match="without an initial state .*form='selective'"):
        cp_passes.Recurrence("m:f", ("key", "value"), initial_state=None)
    with pytest.raises(ValueError, match="form='selective'"):
        cp_passes.Recurrence("m:f", ("u", "delta"), form="selective")


def test_the_carry_moves_state_sized_bytes_whatever_the_length(group):
    """Rank 3 of 8: the affine carry receives the other 7 ranks' [h | M] (K more columns than the state), the
    same at every sequence length; the bound is one predecessor's state."""
    records = []
    for local in (2, 8):  # this rank's shard of 16 and of 64 positions
        torch.manual_seed(0)
        compiled = cp_passes.cp_compile(DeltaRule(), kda_spec(), mesh=group, backend="aot_eager", verbose=False)
        compiled(**mixer_batch(local))
        (carry,) = [r for r in compiled.compile_records[-1].records if r.transport == "carry"]
        records.append((carry.bytes, carry.lower_bound_bytes))
    assert records == [(7 * 2 * STATE, STATE)] * 2


def test_a_declaration_is_checked_against_the_kernel_and_packed_calls_are_refused():
    from transformers.models.glm5_next import modeling_glm5_next as glm

    args = ("query", "key", "value", "g", "beta")
    with pytest.raises(ValueError, match="initial_state='init' is not a parameter"):
        install((cp_passes.Recurrence(KDA_KERNEL, args, initial_state="init"),))
    with pytest.raises(ValueError, match=r"sequence_args \['bias'\] are not parameters of the kernel"):
        install((cp_passes.Recurrence(KDA_KERNEL, ("key", "query", "value", "g", "bias")),))
    install(kda_spec().recurrences)
    x = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="called with cu_seqlens"):
        glm.chunk_kimi_delta_attention(x, x, x, g=-x.sigmoid(), beta=x[..., 0].sigmoid(),
                                       cu_seqlens=torch.tensor([0, 2, 4]))
    with pytest.raises(ValueError, match=r"its argument 'chunk_size' is \[64\]"):
        glm.chunk_kimi_delta_attention(x, x, x, g=-x.sigmoid(), beta=x[..., 0].sigmoid(), chunk_size=[64])


def test_glm5_next_called_with_cu_seqlens_is_refused_as_on_one_device(group):
    """transformers' CPU fallbacks cannot keep packed documents apart and raise; under cp_compile that is a
    refusal that carries their message, not a crash."""
    compiled = cp_passes.cp_compile(hf_glm5_next(), "glm5_next", mesh=group, backend="aot_eager", verbose=False)
    local, _ = cp_passes.shard_batch(glm5_next_batch(16), group, "glm5_next")
    with pytest.raises(CPCompileError, match="can't keep packed sequences apart"):
        compiled(**local, cu_seqlens=torch.tensor([0, 5, 16]))


def test_a_call_with_one_state_per_document_runs_the_kernel_itself():
    """cu_seqlens with initial states or final states per document (generation with a cache) is not what
    the op carries: the installed wrapper calls the kernel as it is, so a call outside CP is unchanged."""
    raw = getattr(gated_scan, "__wrapped__", gated_scan)  # installed by an earlier test
    install(scan_spec().recurrences)
    x = torch.randn(1, 6, 2, 8)
    g, cu, states = -x[..., 0].sigmoid(), torch.tensor([0, 2, 6]), torch.randn(2, 2, 8, 8)
    got = gated_scan(x, x, x, g, initial_state=states, output_final_state=True, cu_seqlens=cu)
    want = raw(x, x, x, g, initial_state=states, output_final_state=True, cu_seqlens=cu)
    assert gated_scan is not raw
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# Tasks the worker pool's ranks run (pool.run(task, P, ...)).


def recurrence_parity(group, form: str, seq_lens: list[int]) -> list[dict]:
    torch.manual_seed(0)
    return small_parity(group, DeltaRule(), kda_spec(form), seq_lens)


def packed_scan_parity(group, form: str, documents: list[list[int]]) -> list[dict]:
    """PackedScan under CP, one forward/backward per packing: this rank's results."""
    torch.manual_seed(0)
    model = PackedScan()
    compiled = cp_passes.cp_compile(model, scan_spec(form), mesh=group, backend="aot_eager", verbose=False)
    results = []
    for lengths in documents:
        batch = packed_scan_batch(lengths)
        local, layout = cp_passes.shard_batch({"input_ids": batch["input_ids"]}, group, scan_spec(form))
        model.zero_grad()
        loss, out = compiled(**local, cu_seqlens=batch["cu_seqlens"])
        loss.backward()
        results.append(step_result(model, compiled, loss, out, layout))
    return results


def glm5_next_packed_parity(group, documents: list[list[int]], layer_types: tuple[str, ...] = KDA_LAYERS) -> dict:
    """The model with model_specs/glm5_next.py on packed rows sharded by shard_batch (doc ids and per-document
    positions added, which the model takes and does not read); the loss as in glm5_next_parity."""
    model = hf_glm5_next(layer_types=tuple(layer_types))
    compiled = cp_passes.cp_compile(model, "glm5_next", mesh=group, backend="aot_eager", verbose=False)
    local, layout = cp_passes.shard_batch(glm5_next_packed_batch(documents), group, "glm5_next")
    out = compiled(**local).last_hidden_state
    loss = out.pow(2).sum()
    loss.backward()
    return step_result(model, compiled, loss, out, layout)


@pytest.mark.parametrize("declared,why", [
    (dict(sequence_args=("query", "key", "value")),
     r"^the model raised ValueError while dynamo traced it: the recurrent kernel test_recurrence:gated_scan was called "
     r"with the tensor 'g' \(2, s\d+, 2\), which its Recurrence declares in neither .* add it to sequence_args"),
    (dict(sequence_args=("query", "key", "value"), tensor_args=("g",)),
     r"called with 'g' \(2, s\d+, 2\), which its Recurrence declares in tensor_args .* move it to sequence_args"),
    (dict(sequence_args=("query", "key", "value", "g"), value_arg="key"),
     r"^Recurrence test_recurrence:gated_scan: value_arg='key' must name the sequence argument whose last dim is "
     r"the state's V .* einsum"),
])
def test_a_declaration_that_does_not_fit_the_call_is_refused_naming_the_argument(group, declared, why):
    """A tensor the declaration leaves out (the gate), one declared whole that carries the sequence, and a
    value_arg that is not the value: refusals that name the argument and the fix, not failures inside dynamo
    (sorting a tensor among the constants), the length specialized, or the fake kernel's error."""
    spec = cp_passes.CPSpec(recurrences=(cp_passes.Recurrence(SCAN_KERNEL, documents="cu_seqlens", **declared),))
    compiled = cp_passes.cp_compile(PackedScan(), spec, mesh=group, backend="aot_eager", verbose=False)
    with pytest.raises(CPCompileError, match=why):
        compiled(torch.randint(0, 32, (2, 8)))


def reverse_scan(query, key, value, g, initial_state=None, output_final_state=False):
    """gated_scan from the last position to the first: a recurrence, but not one a left-to-right carry composes."""
    flipped = gated_scan(query.flip(1), key.flip(1), value.flip(1), g.flip(1), initial_state, output_final_state)
    return flipped[0].flip(1), flipped[1]


def tanh_scan(query, key, value, g, initial_state=None, output_final_state=False):
    """gated_scan with the state squashed by a tanh at every step: a left-to-right recurrence whose final state is
    no affine map of the initial one."""
    state = initial_state if initial_state is not None else key.new_zeros(key.shape[0], key.shape[2], key.shape[3],
                                                                          value.shape[-1])
    outs = []
    for t in range(key.shape[1]):
        state = torch.tanh(g[:, t].exp()[..., None, None] * state + key[:, t, :, :, None] * value[:, t, :, None, :])
        outs.append(torch.einsum("bhk,bhkv->bhv", query[:, t], state))
    return torch.stack(outs, 1), (state if output_final_state else None)


class ScanWith(nn.Module):
    """One call of the kernel ``test_recurrence:<name>`` on projections of the embeddings."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.embed = nn.Embedding(32, 16)
        self.qkv = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.gate = nn.Linear(16, 2)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        q, k, v = [layer(h).unflatten(-1, (2, 8)) for layer in self.qkv]
        o, _ = _SCANS[self.name](q, k, v, F.logsigmoid(self.gate(h)))
        return o.pow(2).sum()


_SCANS = {"reverse_scan": lambda *args: reverse_scan(*args), "tanh_scan": lambda *args: tanh_scan(*args),
          "gated_scan": lambda *args: gated_scan(*args)}
"""Each kernel by name, read from the module when called (a declaration replaces the module's attribute)."""


@pytest.mark.parametrize("name,form,refused", [
    ("reverse_scan", "affine", True), ("reverse_scan", "sequential", True), ("tanh_scan", "affine", True),
    ("tanh_scan", "sequential", False), ("gated_scan", "affine", False), ("gated_scan", "sequential", False)])
def test_a_kernel_that_does_not_compose_as_declared_is_refused(group, name, form, refused):
    """The carry's algorithm runs once on random inputs cut in two (from a random state) against the whole: a
    right-to-left scan is refused in either form (1.08 off before), a tanh state declared affine too (exact at
    P = 2, where the second rank starts from h alone, 7.4e-3 off at P = 4); declared sequential it composes, and
    the linear scan passes in both forms."""
    rec = cp_passes.Recurrence(f"test_recurrence:{name}", ("query", "key", "value", "g"), form=form)
    spec = cp_passes.CPSpec(recurrences=(rec,), layout="contiguous")
    compiled = cp_passes.cp_compile(ScanWith(name), spec, mesh=group, backend="aot_eager", verbose=False)
    if not refused:
        compiled(torch.randint(0, 32, (2, 8)))
        return
    with pytest.raises(CPCompileError) as info:
        compiled(torch.randint(0, 32, (2, 8)))
    (problem,) = info.value.problems
    assert problem.reason.startswith(f"the recurrent kernel test_recurrence:{name} does not compose as its "
                                     f"Recurrence(form={form!r}) declares"), problem.reason
    assert "form='sequential' for any other state" in problem.fix


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, return_last_state=False):
    """Mamba-1's selective scan as ``selective_scan_fn`` computes it (``[batch, D, seq]``, the sequence last), one
    position at a time from a zero state: the kernel takes none."""
    dt = delta if delta_bias is None else delta + delta_bias[..., None]
    dt = F.softplus(dt) if delta_softplus else dt
    state = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for t in range(u.shape[2]):
        state = torch.exp(A * dt[:, :, t, None]) * state + dt[:, :, t, None] * B[:, None, :, t] * u[:, :, t, None]
        ys.append((state * C[:, None, :, t]).sum(-1))
    y = torch.stack(ys, -1) + (0 if D is None else u * D[:, None])
    y = y if z is None else y * F.silu(z)
    return (y, state) if return_last_state else y


def reverse_selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                           return_last_state=False):
    """selective_scan from the last position to the first."""
    y, state = selective_scan(u.flip(-1), delta.flip(-1), A, B.flip(-1), C.flip(-1), D, z.flip(-1), delta_bias,
                              delta_softplus, True)
    return (y.flip(-1), state) if return_last_state else y.flip(-1)


class SelectiveWith(nn.Module):
    """One call of the selective kernel ``test_recurrence:<name>`` as Mamba-1's mixer makes it: ``[batch, D, seq]``
    projections, ``A`` negative, a time-step bias and softplus, ``D`` and a gate."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.embed = nn.Embedding(32, 16)
        self.proj = nn.Linear(16, 16 * 3 + 2 * 4)
        self.A_log = nn.Parameter(torch.rand(16, 4))
        self.D = nn.Parameter(torch.ones(16))
        self.dt_bias = nn.Parameter(torch.rand(16))

    def forward(self, input_ids):
        u, delta, z, B, C = self.proj(self.embed(input_ids)).transpose(1, 2).split([16, 16, 16, 4, 4], 1)
        kernel = selective_scan if self.name == "selective_scan" else reverse_selective_scan
        y = kernel(u, delta, -torch.exp(self.A_log), B, C, D=self.D, z=z, delta_bias=self.dt_bias,
                   delta_softplus=True)
        return y.pow(2).sum()


@pytest.mark.parametrize("name,refused", [("selective_scan", False), ("reverse_selective_scan", True)])
def test_a_selective_kernel_is_checked_against_the_scan_s_math(group, name, refused):
    """form='selective' adds the initial state's part by the selective scan's math, which the kernel never sees:
    the split check runs that math against the kernel itself (on random inputs cut in two), so a kernel that is not
    a left-to-right selective scan is refused."""
    rec = cp_passes.Recurrence(f"test_recurrence:{name}", ("u", "delta", "B", "C", "z"), form="selective",
                               tensor_args=("A", "D", "delta_bias"), initial_state=None,
                               output_final_state="return_last_state", output_alone=True, seq_dim=2)
    spec = cp_passes.CPSpec(recurrences=(rec,), layout="contiguous")
    compiled = cp_passes.cp_compile(SelectiveWith(name), spec, mesh=group, backend="aot_eager", verbose=False)
    if not refused:
        for length in (8, 12, 600):  # the state's part is one op, tiled inside: no loop pins the length
            compiled(torch.randint(0, 32, (2, length)))
        assert len(compiled.compile_records) == 1
        (carry,) = [r for r in compiled.compile_records[-1].records if r.transport == "carry"]
        assert carry.bytes == 7 * 2 * (2 * 16 * 4 * 4)  # 7 other ranks' [h, M], each twice a [2, 16, 4] fp32 state
        return
    with pytest.raises(CPCompileError) as info:
        compiled(torch.randint(0, 32, (2, 8)))
    (problem,) = info.value.problems
    assert problem.reason.startswith(f"the recurrent kernel test_recurrence:{name} does not compose as its "
                                     "Recurrence(form='selective') declares"), problem.reason


class ShiftedScan(nn.Module):
    """gated_scan fed token-shifted inputs, as RWKV feeds its WKV kernel: ``"value"`` shifted by one position
    (a pad, then the first positions), ``"key"`` the same with the sequence last, ``"both"``; ``"crop"`` both by
    a pad that crops (a negative width: RWKV's ``nn.ZeroPad2d((0, 0, 1, -1))``, and ``F.pad``)."""

    def __init__(self, shift: str):
        super().__init__()
        self.shift = shift
        self.embed = nn.Embedding(32, 16)
        self.qkv = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.gate = nn.Linear(16, 2)
        self.out = nn.Linear(16, 8)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        q, k, v = [layer(h).unflatten(-1, (2, 8)) for layer in self.qkv]
        if self.shift in ("value", "both"):
            v = F.pad(v, (0, 0, 0, 0, 1, 0))[:, :-1]
        if self.shift in ("key", "both"):
            k = F.pad(k.transpose(1, 3), (1, 0))[..., :k.shape[1]].transpose(1, 3)
        if self.shift == "crop":  # RWKV's time shift: nn.ZeroPad2d((0, 0, 1, -1)) on [B, T, C]
            k = nn.ZeroPad2d((0, 0, 1, -1))(k.flatten(2)).unflatten(-1, (2, 8))
            v = F.pad(v, (0, 0, 0, 0, 1, -1))
        o, _ = gated_scan(q, k, v, F.logsigmoid(self.gate(h)))
        out = self.out(o.flatten(-2))
        return out.pow(2).sum(), out


def shifted_scan_parity(group, shift: str, form: str) -> list[dict]:
    torch.manual_seed(0)
    return small_parity(group, ShiftedScan(shift), scan_spec(form), [16])


SHIFTED = [(2, "affine", "crop")] + [  # P = 4 folds M: the delta rule's and the packed scan's default cases
    pytest.param(P, form, shift, marks=pytest.mark.full) for P, form, shift in (
        (4, "affine", "both"), (4, "affine", "value"), (4, "affine", "key"), (2, "affine", "both"),
        (4, "sequential", "both"), (4, "affine", "crop"))]


@pytest.mark.parametrize("P,form,shift", SHIFTED)
def test_a_kernel_fed_a_token_shift_carries_its_state(pool, parity_report, P, form, shift):
    """The kernel's sequence arguments straight from a token shift (the shift's halo rewrites them before the
    carry reads them): the value, the key, both, and both by cropping pads, as on one device."""
    per_rank = pool.run(shifted_scan_parity, P, shift=shift, form=form)
    compare_small(f"shifted-{shift}-gated-scan-{form}-aot_eager", [r[0] for r in per_rank],
                  lambda: ShiftedScan(shift), 16, parity_report)


class MethodScan(nn.Module):
    """A scan written as a method (RecurrentGemma's ``_rnn_scan`` shape): ``h_t = a_t * h_{t-1} + x_t``, the decay
    ``a`` from an argument, or (``reads_self``) from the instance."""

    def __init__(self, reads_self: bool):
        super().__init__()
        self.reads_self = reads_self
        self.embed = nn.Embedding(32, 8)
        self.gate = nn.Linear(8, 8)
        self.scale = 0.5

    def _scan(self, hidden_states, gate, states=None):
        h = hidden_states.new_zeros(hidden_states[:, 0].shape) if states is None else states
        out = torch.zeros_like(hidden_states)
        for t in range(hidden_states.shape[1]):
            h = gate[:, t] * h + hidden_states[:, t]
            out[:, t] = h
        return out, h

    def _scaled_scan(self, hidden_states, gate, states=None):
        return MethodScan._scan(None, hidden_states, gate * self.scale, states)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        scan = self._scaled_scan if self.reads_self else self._scan
        out, _ = scan(x, torch.sigmoid(self.gate(x)))
        return out.pow(2).sum()


@pytest.mark.parametrize("reads_self", [False, True])
def test_a_scan_written_as_a_method_is_declared_by_its_class_path(group, reads_self):
    """``module:Class.method`` replaces the class attribute; the method runs without its instance, so one that reads
    ``self`` is refused naming the attribute, not run with a wrong value."""
    method = "_scaled_scan" if reads_self else "_scan"
    rec = cp_passes.Recurrence(f"test_recurrence:MethodScan.{method}", ("hidden_states", "gate"), form="sequential",
                               initial_state="states", output_final_state=None)
    spec = cp_passes.CPSpec(recurrences=(rec,), layout="contiguous")
    compiled = cp_passes.cp_compile(MethodScan(reads_self), spec, mesh=group, backend="aot_eager", verbose=False)
    if not reads_self:
        compiled(torch.randint(0, 32, (2, 8)))
        assert [r.transport for r in compiled.compile_records[-1].records].count("carry") == 1
        return
    with pytest.raises(CPCompileError, match="is a method that reads its instance .*'scale'"):
        compiled(torch.randint(0, 32, (2, 8)))


class InlineLoop(nn.Module):
    """A decayed linear attention written as a loop over blocks of 4 positions inline in the forward (MiniMax's
    lightning attention's shape); :func:`lifted_inline_loop` is the forward with the loop lifted into
    :func:`block_scan`."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.qkv = nn.Linear(8, 24)

    def forward(self, input_ids):
        q, k, v = self.qkv(self.embed(input_ids)).chunk(3, dim=-1)
        state, out = q.new_zeros(q.shape[0], 8, 8), []
        for i in range((q.shape[1] + 3) // 4):
            b = slice(i * 4, i * 4 + 4)
            out.append(q[:, b] @ state + (q[:, b] @ k[:, b].transpose(1, 2)).tril() @ v[:, b])
            state = 0.9 * state + k[:, b].transpose(1, 2) @ v[:, b]
        return torch.cat(out, 1).pow(2).sum()


def block_scan(query, key, value, initial_state=None, output_final_state=False):
    state, out = initial_state if initial_state is not None else query.new_zeros(
        query.shape[0], key.shape[-1], value.shape[-1]), []
    for i in range((query.shape[1] + 3) // 4):
        b = slice(i * 4, i * 4 + 4)
        out.append(query[:, b] @ state + (query[:, b] @ key[:, b].transpose(1, 2)).tril() @ value[:, b])
        state = 0.9 * state + key[:, b].transpose(1, 2) @ value[:, b]
    return torch.cat(out, 1), state if output_final_state else None


def lifted_inline_loop(self, input_ids):
    q, k, v = self.qkv(self.embed(input_ids)).chunk(3, dim=-1)
    return block_scan(q, k, v)[0].pow(2).sum()


_INLINE = "test_recurrence:InlineLoop.forward"


def _inline_spec(sha: str) -> cp_passes.CPSpec:
    return cp_passes.CPSpec(
        recurrences=(cp_passes.Recurrence("test_recurrence:block_scan", ("query", "key", "value")),),
        lifted_forwards=(cp_passes.LiftedForward(_INLINE, "test_recurrence:lifted_inline_loop", sha),))


def test_a_loop_inline_in_a_forward_is_lifted_by_its_class_path(group, monkeypatch):
    """A LiftedForward puts the copy on the class once the shipped forward's source is the one it names: the loop
    is then one op whose state the carry moves (the refusal without it: test_refusals.py); another source is
    refused naming both, and the class keeps its forward."""
    from cp_passes.lifted import source_sha256

    monkeypatch.setattr(InlineLoop, "forward", InlineLoop.forward)
    with pytest.raises(CPCompileError, match=r"InlineLoop.forward is not the code test_recurrence:lifted_inline_"
                                             r"loop was lifted from \(source sha256 [0-9a-f]{16}, the copy's "
                                             r"0123456789abcdef\)"):
        cp_passes.cp_compile(InlineLoop(), _inline_spec("0123456789abcdef"), mesh=group, backend="aot_eager",
                             verbose=False)
    assert InlineLoop.forward is not lifted_inline_loop
    compiled = cp_passes.cp_compile(InlineLoop(), _inline_spec(source_sha256(InlineLoop.forward)), mesh=group,
                                    backend="aot_eager", verbose=False)
    compiled(torch.randint(0, 32, (2, 8)))
    assert InlineLoop.forward is lifted_inline_loop
    assert [r.transport for r in compiled.compile_records[-1].records].count("carry") == 1
    with pytest.raises(ValueError, match="must name a method"):
        cp_passes.LiftedForward("test_recurrence:block_scan", "test_recurrence:lifted_inline_loop", "0" * 16)


def test_minimax_s_lifted_forward_computes_the_shipped_one(monkeypatch):
    """model_specs/minimax.py's copy of MiniMaxLightningAttention.forward, its block loop run as the recurrence op,
    gives the shipped forward's logits and gradients on one device, at a length that ends in a partial block."""
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    from cp_passes.kernels import install as install_kernels
    from cp_passes.lifted import install as install_lifted
    from hybrid_models import build

    monkeypatch.setattr(MiniMaxLightningAttention, "forward", MiniMaxLightningAttention.forward)
    ids = torch.randint(1, 128, (2, 11), generator=torch.Generator().manual_seed(0))
    shipped_model, lifted_model = build("minimax"), build("minimax")
    shipped_out = shipped_model(input_ids=ids, labels=ids)
    spec = cp_passes.load_spec("minimax")
    install_kernels(spec.recurrences)
    install_lifted(spec.lifted_forwards)
    lifted_out = lifted_model(input_ids=ids, labels=ids)
    assert MiniMaxLightningAttention.forward.__name__ == "lightning_forward"
    assert torch.equal(shipped_out.logits, lifted_out.logits)
    shipped_out.loss.backward()
    lifted_out.loss.backward()
    for (name, a), b in zip(shipped_model.named_parameters(), lifted_model.parameters()):
        assert (a.grad is None) == (b.grad is None), name
        assert a.grad is None or torch.allclose(a.grad, b.grad, atol=1e-7), name
