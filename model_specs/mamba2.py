"""Mamba-2 (transformers' Mamba2ForCausalLM) and the state-space hybrids that run its chunked scan.

Each Mamba-2 mixer runs a short causal convolution (read from the graph: a halo of ``conv_kernel - 1`` rows)
and ``mamba2_chunk_scan``, the SSD scan, which the model calls as a Python function looping over chunks of the
sequence. Its state is ``[batch, heads, head_dim, d_state]`` (the value axis, ``head_dim``, before the key
axis, ``d_state``) and a shard's final state is ``S0 * decay + h`` with one decay per head: the affine carry
hands it from rank to rank (one all-gather of every rank's ``[h | M]`` per layer, state-sized; the decay is
read as a ``[d_state, d_state]`` map). ``A`` (``-exp(A_log)``), ``D`` and ``dt_bias`` are passed whole on every
rank with their gradients.

The torch path takes no document boundaries: packed rows run the state across documents, as on one device.
On GPU the same module attribute dispatches to ``mamba_ssm``'s kernels when they are installed; in training
without a cache the mixer first tries ``mamba2_split_conv1d_scan_combined`` (a fused hub kernel), which
returns None on the torch path.

The hybrids (Bamba, NemotronH, FalconH1, Zamba2, GraniteMoeHybrid) carry their own copy of the function:
their specs are this one with the kernel's module changed (:func:`scan`).
"""

from cp_passes.spec import CPSpec, Recurrence


def scan(module: str) -> Recurrence:
    """The Recurrence of ``mamba2_chunk_scan`` as defined in transformers' ``module``."""
    return Recurrence(f"transformers.models.{module}:mamba2_chunk_scan", ("hidden_states", "dt", "B", "C"),
                      form="affine", value_arg="hidden_states", tensor_args=("A", "D", "dt_bias"),
                      initial_state="initial_states", output_final_state="return_final_states", output_alone=True)


SPEC = CPSpec(name="mamba2", recurrences=(scan("mamba2.modeling_mamba2"),))
