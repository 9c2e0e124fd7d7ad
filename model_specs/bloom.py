"""BigScience's BLOOM (transformers' BloomForCausalLM): ALiBi attention written by hand on ``[batch * heads, S, S]``.

The attention scores are ``alibi.baddbmm(query, key^T)``: the ALiBi bias (slopes times each key's position,
counted from the ``attention_mask``'s cumulative sum) is brought to the key axis with the keys, the causal mask
is read from the model's own, and the softmax and ``bmm`` with the values follow from the graph (hand-written
attention, README). The one declaration: the MLP's ``GeLUFunction``, an ``autograd.Function`` with a
hand-written backward that cp_passes would otherwise refuse, is position-wise and runs as one op with its own
backward.
"""

from cp_passes.spec import CPSpec

SPEC = CPSpec(name="bloom",
              positionwise_functions=("transformers.models.bloom.modeling_bloom:GeLUFunction",))
