"""Llama-family causal LMs (cp_passes' ToyLlama, Hugging Face LlamaForCausalLM and look-alikes).

Everything else is read from the graph: causal attention from SDPA's is_causal, GQA from
enable_gqa or the K/V head repeat, positions from position_ids or an arange over the sequence.
``doc_ids`` is the document map that shard_batch adds to packed batches (models that mask by
document read it).
"""

from cp_passes.spec import CPSpec

SPEC = CPSpec(
    name="llama",
    seq_inputs=("input_ids", "position_ids", "labels", "shift_labels", "doc_ids"),
    label_keys=("labels", "shift_labels"),
    position_keys=("position_ids",),
)

MODEL_TYPES = ()
"""Picked by name only: a Llama model compiled with spec=None gets the default CPSpec(), which reads the same
from the graph and shards every sequence input it finds (attention masks too)."""
