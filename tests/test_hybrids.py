"""The model classes users bring after the seed families, as transformers ships them: Mamba-2 and its hybrids
(the SSD chunked scan, a ``[batch, heads, head_dim, d_state]`` state with ``A``, ``D``, ``dt_bias`` beside the
sequence), gated DeltaNet and Kimi Delta Attention hybrids. ``cp_compile(model)`` picks the shipped spec by the
config's model_type; parity on real gloo processes against one device, structure on the fake process group."""

import math

import pytest
import torch

import cp_passes
import hybrid_models
from cp_passes.kernels import decode_options, encode_options
from hybrid_models import FAMILIES, build, reference, state_shape
from parity import compare_valid

DEFAULT = {("bamba", 2), ("jamba", 2), ("minimax", 2)}
"""One Mamba-2 hybrid, one Mamba-1 hybrid and MiniMax (a lifted forward) in the default run (the gated delta rule
takes KDA's carry, which the Glm5Next default case runs); every family at P = 2 and 4 in the full."""
CASES = [pytest.param(f, P, marks=() if (f, P) in DEFAULT else pytest.mark.full) for f in FAMILIES for P in (2, 4)]


SELECTIVE = ("mamba", "falcon_mamba", "jamba")
"""Mamba-1's selective scan: its state decays elementwise, so its ``[h, M]`` is twice the state."""


def _state_bytes(family: str) -> tuple[int, int]:
    """Bytes of one layer's recurrent state for a batch of 2 (fp32) and of its ``[h | M]`` (``M`` maps the key
    axis: K x K more per head; twice the state for the selective scan)."""
    heads, k, v = state_shape(family)
    state = 2 * heads * k * v * 4
    return state, 2 * state if family in SELECTIVE else 2 * heads * k * (v + k) * 4


@pytest.mark.parametrize("family,P", CASES, ids=[f"{c.values[0]}-P{c.values[1]}" for c in CASES])
def test_hybrid_matches_one_device(pool, parity_report, family, P):
    """spec=None: the shipped spec picked by model_type; an odd length at P = 2 in the full run (padded by
    shard_batch). Every
    rank after the first receives the predecessors' [h | M] per recurrent layer, whatever the length."""
    seq_lens = [16] if (family, P) in DEFAULT or P == 4 else [16, 11]
    per_rank = pool.run(hybrid_models.parity, P, family=family, seq_lens=seq_lens)
    assert per_rank[0][0]["origin"] == f"model_specs/{family}.py, picked by model_type {family!r}"
    for i, seq_len in enumerate(seq_lens):
        compare_valid(f"hf-{family}", [r[i] for r in per_rank], reference(family, seq_len), seq_len, parity_report)
    state, summary = _state_bytes(family)
    carries = [(b, bound) for _, transport, b, bound, _ in per_rank[-1][0]["records"] if transport == "carry"]
    assert carries and all(c == (summary * (P - 1), state) for c in carries), (carries, state, summary)


@pytest.mark.parametrize("P,seq_len", [(2, 16), pytest.param(4, 32, marks=pytest.mark.full)])
def test_recurrent_gemma_matches_one_device(pool, parity_report, P, seq_len):
    """RecurrentGemma as shipped (spec=None: model_specs/recurrent_gemma.py): the RG-LRU scan, a loop in a method,
    carried in P - 1 rounds; its clipped square root declared position-wise; the final state the model stores is
    the last rank's on every rank."""
    per_rank = pool.run(hybrid_models.parity, P, family="recurrent_gemma", seq_lens=[seq_len])
    compare_valid("hf-recurrent_gemma", [r[0] for r in per_rank], reference("recurrent_gemma", seq_len), seq_len,
                  parity_report)
    expected = hybrid_models.reference_states("recurrent_gemma", seq_len)
    assert len(expected) == 2 and all(len(r[0]["final_states"]) == 2 for r in per_rank)
    for r in per_rank:  # every rank stores the sequence's final state, the last rank's
        assert all(torch.allclose(got, want, atol=1e-5) for got, want in zip(r[0]["final_states"], expected))
    state = 2 * 64 * 4  # [batch, lru_width] fp32
    carries = [(b, bound) for rule, transport, b, bound, _ in per_rank[-1][0]["records"] if transport == "carry"]
    assert carries == [((P - 1) * (P - 1) * state + (P - 1) * state, state)] * 2, carries  # the bound: one state


def test_a_recurrence_whose_final_state_is_read_refuses_a_padded_batch(group):
    """The final state the model stores runs through shard_batch's padding at the end: refused, naming it."""
    from hybrid_models import batch, build

    compiled = cp_passes.cp_compile(build("recurrent_gemma"), mesh=group, backend="aot_eager", verbose=False)
    with pytest.raises(cp_passes.CPCompileError, match="a recurrence's final state read as the sequence's"):
        compiled(**compiled.shard_batch(batch(60))[0])


PACKED = [pytest.param(f, P, marks=pytest.mark.full) for f in ("bamba", "qwen3_next", "nemotron_h") for P in (2, 4)]


@pytest.mark.parametrize("family,P", PACKED, ids=[f"{c.values[0]}-P{c.values[1]}" for c in PACKED])
def test_hybrid_on_packed_rows_matches_one_device(pool, parity_report, family, P):
    """Packed rows (positions restarting at each document; transformers masks attention by them, and the CPU
    scans, which take no boundaries, run across documents as on one device): documents of 3, 9 and 4, one
    across three ranks at P = 4."""
    documents = [[3, 9, 4], [8, 5, 3]]
    per_rank = pool.run(hybrid_models.parity, P, family=family, seq_lens=[16], documents=documents)
    compare_valid(f"hf-{family}-packed", [r[0] for r in per_rank], reference(family, 16, documents), 16,
                  parity_report)


def test_the_shipped_spec_is_picked_by_model_type_and_explain_names_it(group):
    model = build("mamba2")
    compiled = cp_passes.cp_compile(model, mesh=group, backend="aot_eager", verbose=False)
    assert compiled.spec.name == "mamba2" and compiled.spec.recurrences
    explained = cp_passes.explain(compiled, print_table=False)
    assert "spec 'mamba2' (model_specs/mamba2.py, picked by model_type 'mamba2')" in explained
    given = cp_passes.cp_compile(model, cp_passes.CPSpec(), mesh=group, backend="aot_eager", verbose=False)
    assert given.spec.recurrences == () and "spec 'default' (given)" in cp_passes.explain(given, print_table=False)
    llama = cp_passes.cp_compile(torch.nn.Linear(2, 2), mesh=group, backend="aot_eager", verbose=False)
    assert "no shipped spec serves this model" in cp_passes.explain(llama, print_table=False)


def test_a_causal_mask_no_layer_reads_is_dropped(group):
    """Bamba's default config has no attention layer, yet transformers builds the causal mask (from positions, a
    packed-sequence check included); only dynamo's metadata checks read it. It used to be refused at the mask's
    ops; it is removed before planning, and the Mamba layers plan."""
    from transformers import BambaConfig, BambaForCausalLM

    from cp_passes.tools.dryrun import dry_run

    def build_model():
        torch.manual_seed(0)
        return BambaForCausalLM(BambaConfig(**hybrid_models.TINY, **hybrid_models.ATTENTION, **hybrid_models.MAMBA,
                                            num_hidden_layers=2, attn_layer_indices=None))

    inputs = {"input_ids": ((1, 64), torch.long), "labels": ((1, 64), torch.long)}
    rules = [r.rule for r in dry_run(build_model, inputs, cp_passes.load_spec("bamba"), mesh=group).record.records]
    assert rules.count("carry_affine") == 2 and not any(rule.startswith("sdpa") for rule in rules), rules


def test_without_its_spec_a_mamba2_scan_is_refused_naming_the_scan(group):
    """CPSpec() asks for the defaults: the chunk loop splits the local sequence, refused at the scan's lines."""
    model = build("mamba2")
    compiled = cp_passes.cp_compile(model, cp_passes.CPSpec(), mesh=group, backend="aot_eager", verbose=False)
    ids = torch.randint(1, 128, (2, 2))
    with pytest.raises(cp_passes.CPCompileError, match="mamba2_chunk_scan"):
        compiled(input_ids=ids, labels=ids)


def test_a_recurrence_names_its_tensor_arguments():
    with pytest.raises(ValueError, match="both sequence_args and tensor_args"):
        cp_passes.Recurrence("m:f", ("x", "value"), tensor_args=("x",))
    from model_specs.mamba2 import scan

    bad = scan("mamba2.modeling_mamba2").__class__(
        "transformers.models.mamba2.modeling_mamba2:mamba2_chunk_scan", ("hidden_states", "dt", "B", "C"),
        value_arg="hidden_states", tensor_args=("A", "E"), initial_state="initial_states",
        output_final_state="return_final_states")
    with pytest.raises(ValueError, match=r"tensor_args \['E'\] are not parameters"):
        cp_passes.kernels.install([bad])


def test_constant_options_round_trip_tuples_and_infinities():
    options = {"dt_limit": (0.0, math.inf), "chunk_size": 4, "dt_softplus": True, "low": -math.inf, "one": (1,)}
    assert decode_options(encode_options("k", options)) == options
    with pytest.raises(ValueError, match="plain constants"):
        encode_options("k", {"nan": math.nan})
