"""Bytes each rank receives for the same causal attention written by hand (transformers' eager
attention, key_gather) and as scaled_dot_product_attention (sequence_gather), next to the causal lower
bound (the keys before the rank's last query). Both all-gather K/V; the eager form then computes over every
key, SDPA over the visible prefix. Counted from the rewritten graphs of a dry run of a small Hugging Face
Llama (fake tensors, a fake process group), so long sequences plan in seconds.

    python benchmarks/eager_attention_bytes.py                    # S = 4096, P = 4
    python benchmarks/eager_attention_bytes.py --seq-len 32768 --world-size 8
"""

import argparse

import torch
from tabulate import tabulate

from cp_passes.tools.dryrun import dry_run, fake_group


def llama(attn_implementation: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1 << 20,
                         attn_implementation=attn_implementation, use_cache=False)
    return LlamaForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096, help="global sequence length (default: 4096)")
    parser.add_argument("--world-size", type=int, default=4, help="CP ranks (default: 4)")
    args = parser.parse_args()
    if args.seq_len % args.world_size:
        raise SystemExit("--seq-len must be a multiple of --world-size")
    local = args.seq_len // args.world_size
    inputs = {"input_ids": ((1, local), torch.long), "position_ids": ((1, local), torch.long)}
    rows = []
    for rank in range(args.world_size):
        received = {}
        for implementation in ("sdpa", "eager"):
            with fake_group(args.world_size, rank) as group:
                record = dry_run(lambda: llama(implementation), inputs, mesh=group).record
            attention = [r for r in record.records if r.rule.startswith(("sdpa", "key_"))]
            received[implementation] = (sum(r.bytes for r in attention), sum(r.lower_bound_bytes for r in attention))
        (sdpa, sdpa_bound), (eager, _) = received["sdpa"], received["eager"]
        rows.append((rank, sdpa, sdpa_bound, eager, f"{eager / sdpa:.2f}" if sdpa else "-",
                     f"{eager / sdpa_bound:.2f}" if sdpa_bound else "-"))
    print(f"S = {args.seq_len}, P = {args.world_size}, a 2-layer Llama (2 KV heads of 64), fp32, batch 1: bytes "
          f"received per forward for attention (K/V and mask metadata)")
    print(tabulate(rows, headers=("rank", "SDPA", "causal bound", "eager (hand-written)", "eager / SDPA",
                                  "eager / bound")))


if __name__ == "__main__":
    main()
