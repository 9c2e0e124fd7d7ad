"""Command line: ``python -m cp_passes {demo,explain,specs}``."""

from __future__ import annotations

import argparse
import sys


def _demo(args) -> int:
    from .demo import demo_rank
    from .launch import launch

    if args.seq_len < 2 * args.nproc:
        raise SystemExit(f"--seq-len {args.seq_len} is too short for {args.nproc} ranks (need >= 2 tokens per rank)")
    launch(demo_rank, args.nproc, args.steps, args.seq_len, args.backend, args.dump)
    return 0


def _explain(args) -> int:
    import torch
    from tabulate import tabulate

    from .dryrun import dry_run, fake_group
    from ..report.dump import write_dump
    from ..report.explain import format_bytes, format_record
    from ..report.memory import format_memory
    from .models import EXAMPLES, built_in
    from ..spec import CPSpec, load_spec

    world, seq_len = args.world_size, args.seq_len
    if seq_len % world or seq_len // world < 2:
        raise SystemExit(f"--seq-len {seq_len} must be a multiple of --world-size {world} with >= 2 tokens per rank")
    rank = world - 1 if args.rank is None else args.rank
    if not 0 <= rank < world:
        raise SystemExit(f"--rank {rank} is outside 0..{world - 1}")
    description, config = EXAMPLES[args.model]
    spec = load_spec(args.spec) if args.spec else CPSpec()
    local = seq_len // world
    columns = sorted({0, 1, world // 4, world // 2, (3 * world) // 4, world - 1} if args.ranks is None
                     else set(args.ranks)) if world > 1 else [0]
    dtype = getattr(torch, args.dtype)
    inputs = {"input_ids": ((args.batch, local), torch.long), "labels": ((args.batch, local), torch.long)}
    if args.packed:  # what shard_batch's packing passes: the doc-id map and per-document positions
        inputs["doc_ids"] = inputs["position_ids"] = ((args.batch, local), torch.long)
    print(f"cp_passes: planning {args.model} and partitioning its backward on fake tensors (about a minute for "
          f"llama-8b)...", file=sys.stderr, flush=True)
    with fake_group(world, rank) as group:
        run = dry_run(lambda: built_in(config, dtype), inputs, spec, mesh=group,
                      plan_ranks=[r for r in columns if r != rank], memory=True)
    run.per_rank[rank] = run.record.records
    print(f"cp_passes plan: {args.model} ({description}), spec {spec.name}")
    print(f"P = {world}, S = {seq_len} ({local} tokens per rank), batch {args.batch}, {args.dtype}"
          f"{', packed documents (doc_ids, position_ids)' if args.packed else ''}, with labels (a training step); a dry run with "
          f"fake tensors and a fake process group (nothing allocated, no processes)\n")
    print(format_record(run.record))
    moved = [r for r in run.record.records if r.collective]
    if moved and len(columns) > 1:
        print("\nreceived / lower bound per forward, by rank (--ranks to choose; the backward moves the same bytes "
              "back):")

        def cell(records):
            return f"{format_bytes(sum(r.bytes for r in records))} / {format_bytes(sum(r.lower_bound_bytes for r in records))}"

        rows = [[rec.module, rec.rule] + [cell([r for r in run.per_rank[c] if r.node == rec.node]) for c in columns]
                for rec in moved]
        rows.append(["total", ""] + [cell(run.per_rank[c]) for c in columns])
        print(tabulate(rows, headers=["module", "rule"] + [f"rank {c}" for c in columns]))
    print()
    print("\n".join(format_memory(run.memory, rank, local, format_bytes)))
    if args.dump:
        files = write_dump(args.dump, run.record, 0)
        print(f"\nwrote {len(files)} files to {args.dump}/rank{rank}/graph0/ (index.txt lists them)")
    return 0


def _specs(args) -> int:
    from ..spec import available_specs, load_spec, model_types

    for name in available_specs():
        types = model_types(name)
        picked = f" (picked for model_type {', '.join(types)})" if types else ""
        print(f"{name}{picked}: {load_spec(name)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m cp_passes",
        description="cp_passes: context parallelism as a torch.compile backend.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser(
        "demo",
        help="train the built-in ToyLlama with CP on CPU ranks and check it against one device",
        description="Spawn --nproc CPU ranks (gloo), compile the built-in ToyLlama with cp_compile, run --steps "
                    "AdamW steps on sharded batches, and print each step's CP loss beside the single-device loss, "
                    "then the table of rewrites. Exits 1 if the losses differ by more than 1e-4 (relative). Under "
                    "torchrun (torchrun --nproc-per-node 2 -m cp_passes demo) it uses torchrun's ranks instead.",
    )
    demo.add_argument("--nproc", type=int, default=2, help="number of CP ranks to spawn (default: 2)")
    demo.add_argument("--steps", type=int, default=3, help="optimizer steps (default: 3)")
    demo.add_argument("--seq-len", type=int, default=255,
                      help="global sequence length; padded to a multiple of --nproc (default: 255)")
    demo.add_argument("--backend", choices=("inductor", "aot_eager"), default="inductor",
                      help="inductor compiles real kernels (~30 s on 2 cores); aot_eager runs the same rewritten "
                           "graph without Inductor (default: inductor)")
    demo.add_argument("--dump", metavar="DIR", default=None,
                      help="write every graph, the AOT forward/backward graphs, Inductor's code and the rewrite "
                           "table under DIR/rank<r>/graph<i>/")
    demo.set_defaults(run=_demo)
    from .models import EXAMPLES

    explain = sub.add_parser(
        "explain",
        help="plan a built-in example for any world size and sequence length, without processes or memory",
        description="Trace a built-in example with fake tensors on a fake process group of --world-size ranks, run "
                    "cp_passes' analysis, planning and transport passes as cp_compile would, and print the rewrite "
                    "table for --rank, the bytes each of several ranks receives per layer, and --rank's memory: "
                    "what its training step saves for the backward (AOTAutograd's partition, by module) against "
                    "one device's divided by P, its largest collective buffer and [sequence x sequence] tensor, "
                    "and the parameters. Examples: " + "; ".join(f"{k}: {v[0]}" for k, v in EXAMPLES.items()) + ".",
    )
    explain.add_argument("model", choices=sorted(EXAMPLES), help="built-in example to plan")
    explain.add_argument("--world-size", type=int, default=8, help="CP ranks (default: 8)")
    explain.add_argument("--seq-len", type=int, default=131072,
                         help="global sequence length, a multiple of --world-size (default: 131072)")
    explain.add_argument("--batch", type=int, default=1, help="batch size (default: 1)")
    explain.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16",
                         help="parameter and activation dtype (default: bfloat16)")
    explain.add_argument("--packed", action="store_true",
                         help="pass doc_ids and position_ids, as shard_batch packs documents: attention within each "
                              "(the mask reads doc_ids), positions restarting at each")
    explain.add_argument("--rank", type=int, default=None,
                         help="rank whose rewrite table, graphs and memory are shown (default: the last rank, which "
                              "receives the most)")
    explain.add_argument("--ranks", type=int, nargs="+", default=None, metavar="R",
                         help="ranks compared in the bytes-per-layer table (default: 0, 1, P/4, P/2, 3P/4, P-1)")
    explain.add_argument("--spec", default=None,
                         help="a spec name from model_specs/ or a .py file defining SPEC (default: CPSpec())")
    explain.add_argument("--dump", metavar="DIR", default=None,
                         help="write --rank's graphs (exported, ATen, after each pass) and the table under "
                              "DIR/rank<r>/graph0/")
    explain.set_defaults(run=_explain)
    specs = sub.add_parser("specs", help="list the model specs shipped in model_specs/",
                           description="Print every spec in model_specs/, the transformers model types cp_compile(model) "
                                       "picks it for, and its fields.")
    specs.set_defaults(run=_specs)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)

