"""Command line: ``python -m cp_passes {demo,specs}``."""

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


def _specs(args) -> int:
    from .spec import available_specs, load_spec

    for name in available_specs():
        print(f"{name}: {load_spec(name)}")
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
    specs = sub.add_parser("specs", help="list the model specs shipped in model_specs/",
                           description="Print every spec in model_specs/ with its fields.")
    specs.set_defaults(run=_specs)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
