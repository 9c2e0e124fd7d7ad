"""DeepSeek V4.1's public relative in transformers: DeepseekV4ForCausalLM.

Its compressed attention groups the sequence into windows: heavily compressed attention (HCA) pools
windows of ``compress_rates["heavily_compressed_attention"]`` (128) positions, compressed sparse attention
(CSA) windows of ``compress_rates["compressed_sparse_attention"]`` (4), each paired with the previous window.
Every shard must hold whole windows of both, so ``pad_multiple`` is their least common multiple, which
``shard_batch`` pads to, and packed documents start at multiples of it. Everything else is read from the
graph: the windows' positions become global, the CSA pairing a one-window halo, and each attention's keys
(the raw positions and the compressed entries, concatenated) are brought part by part with its masks
(sliding window, the HCA causal block rule, the CSA indexer's top-k) evaluated over the whole sequence.
The MoE layers (routed and hash-routed) run on transformers' default experts implementation, grouped_mm,
which cp_passes proves local to each rank.
``cp_compile(model, "deepseek_v4")`` reads the rates from ``model.config`` (:func:`for_config`); shard with the
compiled module's spec, ``shard_batch(batch, group, compiled.spec)``, or ``load_spec("deepseek_v4",
config=model.config)``: the name alone gives ``SPEC``, for the released rates.
"""

import math

from cp_passes.spec import CPSpec

SPEC = CPSpec(
    name="deepseek_v4",
    seq_inputs=("input_ids", "position_ids", "labels", "shift_labels", "doc_ids"),
    position_keys=("position_ids",),
    pad_multiple=128,
    packed_alignment=128,
    # Contiguous shards until the balanced layout is shown exact here: at P = 4 on packed rows its head's
    # hyper-connection scale gradient (a sum that cancels) differs from one device by 1.9e-3 of itself,
    # above twice the balanced cut's one-device rounding floor (1.4e-3); logits and loss match.
    layout="contiguous",
)


def for_config(config) -> CPSpec:
    """``SPEC`` for ``config``'s compression rates: shards and packed documents in whole windows of every rate
    (their least common multiple)."""
    rates = [int(r) for r in (getattr(config, "compress_rates", None) or {}).values() if r]
    multiple = math.lcm(*rates) if rates else 1
    return SPEC.replace(pad_multiple=multiple, packed_alignment=multiple)
