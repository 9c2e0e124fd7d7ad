"""Bytes each rank receives for sliding-window attention and causal convolutions: halo against a gather of
the causal prefix (``window_transport="gather"``), next to the lower bound. Counted from the rewritten graphs
of a dry run (fake tensors, a fake process group), so any sequence length and world size plan in seconds on a
laptop.

    python benchmarks/halo_bytes.py                       # S = 32768, P = 8, window 1024, conv kernel 4
    python benchmarks/halo_bytes.py --seq-len 131072 --world-size 16 --window 4096
    python benchmarks/halo_bytes.py --layout contiguous   # one range per rank: one halo (default: balanced)
"""

import argparse

import torch
from tabulate import tabulate

from cp_passes.tools.dryrun import dry_run, fake_group
from cp_passes.tools.models import ToyLlama, ToyLlamaConfig
from cp_passes.spec import CPSpec


def mib(n: int) -> str:
    return f"{n / 2**20:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=32768, help="global sequence length (default: 32768)")
    parser.add_argument("--world-size", type=int, default=8, help="CP ranks (default: 8)")
    parser.add_argument("--window", type=int, default=1024, help="sliding-window width (default: 1024)")
    parser.add_argument("--conv-kernel", type=int, default=4, help="causal short-conv kernel (default: 4)")
    parser.add_argument("--batch", type=int, default=1, help="batch size (default: 1)")
    parser.add_argument("--layout", choices=("auto", "balanced", "contiguous"), default="auto",
                        help="CPSpec.layout (default: auto, which is balanced here: two ranges, a halo each)")
    args = parser.parse_args()
    if args.seq_len % (2 * args.world_size):
        raise SystemExit("--seq-len must be a multiple of 2 * --world-size")
    local = args.seq_len // args.world_size
    config = ToyLlamaConfig(window=args.window, conv_kernel=args.conv_kernel, n_layers=2)
    inputs = {"input_ids": ((args.batch, local), torch.long)}
    rows = []
    totals = {}
    for rank in sorted({1, args.world_size // 2, args.world_size - 1}):
        per = {}
        for transport in ("halo", "gather"):
            with fake_group(args.world_size, rank) as group:
                spec = CPSpec(window_transport=transport, layout=args.layout)
                record = dry_run(lambda: ToyLlama(config), inputs, spec, mesh=group).record
            per[transport] = [r for r in record.records if r.rule in ("sdpa_window", "causal_conv_slice")]
        for halo, gather in zip(per["halo"], per["gather"]):
            bound = halo.lower_bound_bytes
            gathered = gather.bytes if gather.rule == "sdpa_window" else None
            rows.append((rank, halo.module, halo.rule, mib(halo.bytes), mib(gathered) if gathered else "-",
                         mib(bound), f"{halo.bytes / bound:.2f}",
                         f"{gathered / bound:.1f}" if gathered else "-"))
            totals.setdefault(rank, [0, 0, 0])
            totals[rank][0] += halo.bytes
            totals[rank][1] += gathered if gathered else halo.bytes  # convs have no gather variant
            totals[rank][2] += bound
    print(f"S = {args.seq_len}, P = {args.world_size} ({local} tokens per rank), window {args.window}, conv kernel "
          f"{args.conv_kernel}, batch {args.batch}, fp32, layout {record.layout}; MiB received per rank per forward "
          f"(backward moves the same)")
    print(tabulate(rows, headers=("rank", "module", "rule", "halo MiB", "gather MiB", "lower bound MiB",
                                  "halo / bound", "gather / bound")))
    print()
    print(tabulate([(r, mib(h), mib(g), mib(b), f"{h / b:.2f}", f"{g / b:.1f}") for r, (h, g, b) in totals.items()],
                   headers=("rank", "halo total MiB", "gather total MiB", "bound MiB", "halo / bound",
                            "gather / bound")))


if __name__ == "__main__":
    main()
