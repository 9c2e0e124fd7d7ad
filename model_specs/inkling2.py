"""Inkling2 in transformers: Inkling2ForCausalLM and Inkling2ForConditionalGeneration.

The text model's attention is written by hand (eager): its relative-position bias, sinks concatenated on the
key axis and sliding-window masks are read from the graph, and each layer brings only the keys its masks
let a query see (a halo for the sliding layers). Short causal convolutions, written with pad + slice or
pad + unfold, take halos; log-scaled queries read ``position_ids``.

With images, every rank passes its slice of ids, positions and labels and the whole ``pixel_values`` and
``image_grid_thw``. The vision tower sizes its attention from ``image_grid_thw.tolist()``, which AOT autograd
cannot differentiate (plain ``torch.compile(fullgraph=True)`` cannot train it either), so it runs eagerly on
every rank (``eager_modules``); its features are spliced into each rank's tokens by the count of image tokens
before them.
"""

from cp_passes.spec import CPSpec

SPEC = CPSpec(
    name="inkling2",
    seq_inputs=("input_ids", "position_ids", "labels", "shift_labels", "doc_ids"),
    position_keys=("position_ids",),
    eager_modules=("model.vision_tower",),
)

MODEL_TYPES = ('inkling2', 'inkling2_text')
"""transformers' model types this spec serves: ``cp_compile(model)`` picks it for them."""
