"""Mamba-1 (transformers' MambaForCausalLM) and the models that run its selective scan.

Each mixer runs a short causal convolution (read from the graph: a halo of ``conv_kernel - 1`` rows) and
``mamba_selective_scan`` (``mamba_ssm``'s ``selective_scan_fn`` on GPU, a loop or ``associative_scan`` over the
sequence on CPU) on ``[batch, intermediate, seq]`` tensors, the sequence last. The kernel takes no initial
state; its state ``[batch, intermediate, d_state]`` decays elementwise, so ``form="selective"`` carries it:
each rank runs the kernel once from zeros, gathers every rank's final state and decay (twice the state), and
adds its predecessors' part to its output (:mod:`cp_passes.selective_scan`). ``A`` (``-exp(A_log)``), ``D`` and
the time-step bias are passed whole on every rank with their gradients. The kernel takes no document
boundaries: packed rows run the state across documents, as on one device.

In training on GPU with ``mamba_ssm`` installed, the mixer first tries ``mamba_inner_fn`` (the convolution, the
scan and both projections fused), which returns None on the torch path; with it installed, the fused call
is not declared here and is refused at its loop.

FalconMamba and Jamba carry their own copy of the function: their specs are this one with the kernel's
module changed (:func:`scan`).
"""

from cp_passes.spec import CPSpec, Recurrence


def scan(module: str) -> Recurrence:
    """The Recurrence of ``mamba_selective_scan`` as defined in transformers' ``module``."""
    return Recurrence(f"transformers.models.{module}:mamba_selective_scan", ("hidden_states", "dt", "B", "C", "z"),
                      form="selective", tensor_args=("A", "D", "delta_bias"), initial_state=None,
                      output_final_state="return_last_state", output_alone=True, seq_dim=2)


SPEC = CPSpec(name="mamba", recurrences=(scan("mamba.modeling_mamba"),))
