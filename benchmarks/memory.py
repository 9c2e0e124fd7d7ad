"""Per-rank memory of a CP training step against one device's divided by P: what the forward saves for the
backward, and the largest [sequence x sequence] tensor (a mask) per rank and layer against ``L x keys
brought``. From dry runs (fake tensors, a fake process group): AOTAutograd partitions the rewritten graph and
the single-device one with min-cut, as ``cp_compile`` lowers them. Shapes decide these figures, so a packed
batch's document lengths do not: they change which key blocks attention computes, not what is kept.

    python benchmarks/memory.py                              # llama-8b, P = 8, S = 131072, bf16, batch 1
    python benchmarks/memory.py --world-size 64 --seq-len 1048576
"""

import argparse
import sys

import torch
from tabulate import tabulate

from cp_passes.report.explain import format_bytes
from cp_passes.spec import CPSpec
from cp_passes.tools.dryrun import dry_run, fake_group
from cp_passes.tools.models import EXAMPLES, built_in

TARGET = 1.25


def measure(args, packed: bool):
    world, local = args.world_size, args.seq_len // args.world_size
    rank = world - 1  # brings the most keys
    inputs = {"input_ids": ((args.batch, local), torch.long), "labels": ((args.batch, local), torch.long)}
    if packed:
        inputs["doc_ids"] = ((args.batch, local), torch.long)
    config = EXAMPLES[args.model][1]
    with fake_group(world, rank) as group:
        run = dry_run(lambda: built_in(config, getattr(torch, args.dtype)), inputs,
                      CPSpec(gathered_keys=args.gathered_keys, layout=args.layout), mesh=group, memory=True)
    return run.memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(EXAMPLES), default="llama-8b", help="built-in example")
    parser.add_argument("--world-size", type=int, default=8, help="CP ranks (default: 8)")
    parser.add_argument("--seq-len", type=int, default=131072, help="global sequence length (default: 131072)")
    parser.add_argument("--batch", type=int, default=1, help="batch size (default: 1)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--gathered-keys", choices=("regather", "save"), default="regather",
                        help="CPSpec.gathered_keys (default: regather, the default)")
    parser.add_argument("--layout", choices=("auto", "balanced", "contiguous"), default="auto",
                        help="CPSpec.layout (default: auto: balanced here)")
    args = parser.parse_args()
    if args.seq_len % args.world_size:
        raise SystemExit("--seq-len must be a multiple of --world-size")
    local = args.seq_len // args.world_size
    rows, ok = [], True
    for packed in (False, True):
        print(f"partitioning {'packed' if packed else 'unpacked'} ... (about a minute)", file=sys.stderr, flush=True)
        memory = measure(args, packed)
        bound = args.batch * local * args.seq_len  # the last rank's queries x its causal prefix: every key
        ok &= memory.ratio <= TARGET and memory.quadratic.elements <= bound
        rows.append(["packed (doc_ids)" if packed else "unpacked", format_bytes(memory.saved_bytes),
                     format_bytes(memory.single_share), f"{memory.ratio:.3f}",
                     f"{format_bytes(memory.quadratic.bytes)} {memory.quadratic.what.split(' in ')[0]}",
                     f"{memory.quadratic.elements / bound:.3f}", format_bytes(memory.single_quadratic.bytes),
                     format_bytes(memory.collective.bytes)])
    print(f"{args.model}, P = {args.world_size}, S = {args.seq_len} ({local} per rank), batch {args.batch}, "
          f"{args.dtype}, gathered_keys={args.gathered_keys}; rank {args.world_size - 1} (brings every key)")
    print(tabulate(rows, headers=["batch", "saved / rank", "one device / P", "saved ratio", "largest mask / rank",
                                  "mask elements / (L x keys)", "one device's mask", "largest collective"]))
    print(f"target: saved ratio <= {TARGET}, mask elements <= L x keys brought per layer: "
          f"{'met' if ok else 'NOT met'}")


if __name__ == "__main__":
    main()
