"""Bytes each rank receives for the same attention written by hand (transformers' eager attention,
key_gather) and as scaled_dot_product_attention (sequence_gather or halo), next to the lower bound: the
keys before the rank's last query (causal Llama), or the window - 1 rows before its first (Mistral with a
sliding window). Causal attention all-gathers K/V either way and keeps the visible prefix; a window takes a
halo of exactly the rows it needs. Counted from the rewritten graphs of a dry run of small Hugging Face
models (fake tensors, a fake process group), so long sequences plan in seconds.

    python benchmarks/eager_attention_bytes.py                    # S = 4096, P = 4, window 1024
    python benchmarks/eager_attention_bytes.py --seq-len 32768 --world-size 8 --window 4096
"""

import argparse

import torch
from tabulate import tabulate

from cp_passes.tools.dryrun import dry_run, fake_group


def model(family: str, attn_implementation: str, window: int):
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    sizes = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1 << 20, attn_implementation=attn_implementation,
                 use_cache=False)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**sizes))
    return MistralForCausalLM(MistralConfig(sliding_window=window, **sizes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096, help="global sequence length (default: 4096)")
    parser.add_argument("--world-size", type=int, default=4, help="CP ranks (default: 4)")
    parser.add_argument("--window", type=int, default=1024, help="Mistral's sliding window (default: 1024)")
    args = parser.parse_args()
    if args.seq_len % args.world_size:
        raise SystemExit("--seq-len must be a multiple of --world-size")
    local = args.seq_len // args.world_size
    inputs = {"input_ids": ((1, local), torch.long), "position_ids": ((1, local), torch.long)}
    rows = []
    for family in ("llama", f"mistral (window {args.window})"):
        for rank in range(args.world_size):
            received = {}
            for implementation in ("sdpa", "eager"):
                with fake_group(args.world_size, rank) as group:
                    record = dry_run(lambda: model(family.split()[0], implementation, args.window), inputs,
                                     mesh=group).record
                attention = [r for r in record.records if r.rule.startswith(("sdpa", "key_"))]
                received[implementation] = (sum(r.bytes for r in attention),
                                            sum(r.lower_bound_bytes for r in attention))
            (sdpa, sdpa_bound), (eager, eager_bound) = received["sdpa"], received["eager"]
            rows.append((family, rank, sdpa, sdpa_bound, eager, eager_bound,
                         f"{eager / sdpa:.2f}" if sdpa else "-", f"{eager / eager_bound:.2f}" if eager_bound else "-"))
    print(f"S = {args.seq_len}, P = {args.world_size}, 2 layers (2 KV heads of 64), fp32, batch 1: bytes received "
          f"per forward for attention (K/V and mask metadata)")
    print(tabulate(rows, headers=("model", "rank", "SDPA", "SDPA bound", "eager (hand-written)", "eager bound",
                                  "eager / SDPA", "eager / bound")))


if __name__ == "__main__":
    main()
