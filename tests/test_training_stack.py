"""The training stack around CP, on real gloo process groups: activation checkpointing, FSDP2 and DDP on a
dp x cp mesh, bf16, gradient accumulation over micro-batches of different lengths. Each is checked against
the single-device model, forward and gradients, as in test_parity.py."""

import pytest

from test_parity import _compare, _hf_reference, _toy_reference

# A causal layer (K/V gather) and a layer with a causal convolution (halo) before its attention, both
# checkpointed: the backward's recomputation issues both transports again.
CHECKPOINTED = dict(checkpoint=True, conv_kernel=(0, 4))


@pytest.mark.parametrize("P,backend", [(2, "aot_eager"), pytest.param(4, "aot_eager", marks=pytest.mark.full),
                                       pytest.param(2, "inductor", marks=pytest.mark.full)])
def test_checkpointed_blocks_parity(pool, parity_report, P, backend):
    seq_lens = [16, 13]
    per_rank = pool.run("toy_parity", P, backend=backend, config=CHECKPOINTED, seq_lens=seq_lens,
                        pass_positions=False)
    for i, seq_len in enumerate(seq_lens):
        _compare(f"ToyLlama-checkpointed-{backend}", [r[i] for r in per_rank],
                 *_toy_reference(CHECKPOINTED, seq_len, False), seq_len, parity_report)


@pytest.mark.parametrize("P", [2, pytest.param(4, marks=pytest.mark.full)])
def test_hf_activation_checkpointing_parity(pool, parity_report, P):
    """transformers' activation_checkpointing_enable() (use_reentrant=False on every decoder layer), against
    the model without it."""
    seq_lens = [16, 11]
    per_rank = pool.run("hf_parity", P, backend="aot_eager", seq_lens=seq_lens, checkpointing=True)
    for i, seq_len in enumerate(seq_lens):
        _compare("hf-LlamaForCausalLM-checkpointed", [r[i] for r in per_rank], *_hf_reference(seq_len, False),
                 seq_len, parity_report)
