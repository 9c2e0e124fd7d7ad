"""GLM-5.3-Flash's public relative in transformers: Glm5NextTextModel and Glm5NextForConditionalGeneration.

Its linear-attention layers run Kimi Delta Attention: a short causal convolution (read from the graph: a
halo of kernel - 1 rows) and ``chunk_kimi_delta_attention``, a recurrence with a ``[K, V]`` state per head
that the model calls as a Python function looping over chunks. The spec declares it (a ``Recurrence``
without ``documents``: transformers' CPU fallback takes no ``cu_seqlens``): cp_passes captures each
call as one op and hands the state on across ranks with the affine carry (one all-gather of every rank's
``[h | M]`` per layer, state-sized). On GPU the same module attribute dispatches to flash-linear-attention's
``chunk_kda`` when it is installed. Its indexed-attention layers need nothing declared: the indexer's
top-k mask carries no gradient, so it is evaluated over the whole sequence from gathered activations, and
MLA's ``expand_kv`` (copies into slices of an empty tensor) is rewritten out of place. Its MoE layers run
on transformers' default experts implementation (grouped_mm), which cp_passes proves local to each rank.

With images, every rank passes its slice of ids, positions and labels and the whole ``pixel_values`` and
``image_grid_thw``. The vision tower (``model.visual``) splits its attention by lengths from ``.tolist()`` and
branches on them, which neither dynamo nor fake tensors can follow, so it runs eagerly on every rank
(``eager_modules``; its output sizes are measured on the real pixels when the graph compiles, so batches of
the same pixel shape must keep their grids). Its features are spliced into each rank's tokens by the count of
image tokens before them.

Packed rows: ``shard_batch`` with this spec adds doc ids and per-document positions, which the model takes
and does not read (it uses no positions, and its indexer masks padding only), so its state and its indexer
run across documents, as on one device. To keep documents apart the model must be called with
``cu_seqlens``, which transformers' CPU fallbacks refuse ("can't keep packed sequences apart"), under
cp_passes as on one device.
"""

from cp_passes.spec import CPSpec, Recurrence

SPEC = CPSpec(
    name="glm5_next",
    seq_inputs=("input_ids", "position_ids", "labels", "shift_labels", "doc_ids"),
    position_keys=("position_ids",),
    eager_modules=("model.visual",),
    recurrences=(
        Recurrence("transformers.models.glm5_next.modeling_glm5_next:chunk_kimi_delta_attention",
                   ("query", "key", "value", "g", "beta"), form="affine"),
    ),
)

MODEL_TYPES = ('glm5_next', 'glm5_next_text')
"""transformers' model types this spec serves: ``cp_compile(model)`` picks it for them."""
