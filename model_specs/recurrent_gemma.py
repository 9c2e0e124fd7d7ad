"""Google's RecurrentGemma (Griffin; transformers' RecurrentGemmaForCausalLM): RG-LRU recurrent blocks, short
causal convolutions and local attention.

The RG-LRU's scan is a Python loop over positions in the method ``RecurrentGemmaRglru._rnn_scan`` (``h_t = a_t *
h_{t-1} + x_t``, ``a`` zeroed where ``position_ids == 0``), declared by its class path: it computes from its
arguments alone and always returns ``(output, final state)``. Its state ``[batch, lru_width]`` is carried
sequentially (P - 1 rounds of handing each rank's final state on). The model stores the final state on the
module (``self.recurrent_states``) after every forward: every rank stores the last rank's, the sequence's.
``SqrtBoundDerivative`` (a square root whose gradient is clipped) is position-wise. The convolutions and the
local attention's window are read from the graph.
"""

from cp_passes.spec import CPSpec, Recurrence

_MODULE = "transformers.models.recurrent_gemma.modeling_recurrent_gemma"

SPEC = CPSpec(
    name="recurrent_gemma",
    recurrences=(Recurrence(f"{_MODULE}:RecurrentGemmaRglru._rnn_scan", ("hidden_states", "recurrent_gate", "reset"),
                            form="sequential", initial_state="recurrent_states", output_final_state=None),),
    positionwise_functions=(f"{_MODULE}:SqrtBoundDerivative",),
)
