"""Step-5's public relative in transformers: Step3p7TextModel (the language model of
Step3p7ForConditionalGeneration).

It alternates sliding-window and full-attention layers, both SDPA with the masks transformers builds from the
positions (packed documents included): the sliding layers take a halo of ``window - 1`` rows, the full ones the
causal prefix of K and V (the sequence gather), and nothing else needs declaring. The masks are evaluated at
this rank's query rows and the keys brought (the sliding layers' where the mask splits into per-position terms,
else over the whole sequence) and checked at run time; ``python -m cp_passes explain`` says which. Per-head q/k
norms, partial RoPE and the gated attention output are position-wise.

MoE layers route each token on its own. transformers 5.24 generates ``Step3p7Experts`` without its
experts-implementation switch, so its forward loops over the experts ``nonzero()`` selects, which dynamo cannot
trace; the spec names them in ``experts``, and they run through transformers' ``grouped_mm`` experts forward
(the same per-token sum from the same weights: sort the (token, expert) pairs, grouped matmuls, put the rows
back), which cp_passes proves local to each rank: no bytes move for the experts. Without ``experts`` the
refusal names the module and that one-line fix.

Packed rows: ``shard_batch`` with this spec adds doc ids and per-document positions; transformers' mask
functions read the positions' restarts as document starts, as on one device.
"""

from cp_passes.spec import CPSpec

SPEC = CPSpec(
    name="step5",
    seq_inputs=("input_ids", "position_ids", "labels", "shift_labels", "doc_ids"),
    position_keys=("position_ids",),
    experts=("*mlp.experts",),
)

MODEL_TYPES = ('step3p7', 'step3p5')
"""transformers' model types this spec serves: ``cp_compile(model)`` picks it for them."""
