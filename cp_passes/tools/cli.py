"""Command line: ``python -m cp_passes {demo,explain,specs}``."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import warnings


def _demo(args) -> int:
    from .demo import demo_rank
    from .launch import launch

    if args.seq_len < 2 * args.nproc:
        raise SystemExit(f"--seq-len {args.seq_len} is too short for {args.nproc} ranks (need >= 2 tokens per rank)")
    launch(demo_rank, args.nproc, args.steps, args.seq_len, args.backend, args.dump)
    return 0


def _explain(args) -> int:
    import torch

    from .dryrun import dry_run, fake_group
    from ..report.dump import write_dump
    from ..report.explain import format_bytes, format_record, wrap
    from ..report.memory import format_memory
    from ..report.overlap import format_overlap
    from ..spec import CPSpec, load_spec, resolve_spec

    world, seq_len = args.world_size, args.seq_len
    if seq_len % world or seq_len // world < 2:
        raise SystemExit(f"--seq-len {seq_len} must be a multiple of --world-size {world} with >= 2 tokens per rank")
    rank = world - 1 if args.rank is None else args.rank
    if not 0 <= rank < world:
        raise SystemExit(f"--rank {rank} is outside 0..{world - 1}")
    build, config, name, description = _explain_model(args, getattr(torch, args.dtype))
    hf = args.hf_config is not None
    spec = load_spec(args.spec, config) if args.spec else resolve_spec(None, config) if hf else CPSpec()
    local = seq_len // world
    columns = sorted({0, 1, world // 4, world // 2, (3 * world) // 4, world - 1} if args.ranks is None
                     else set(args.ranks)) if world > 1 else [0]

    print(f"cp_passes: planning {name} {'with each repeated block once ' if args.regions else ''}and partitioning "
          f"its backward on fake tensors...", file=sys.stderr, flush=True)
    with _warnings_summarised(), fake_group(world, rank) as group:
        run = dry_run(build, _step_inputs(args, local), spec, mesh=group,
                      plan_ranks=[r for r in columns if r != rank], memory=True, regions=args.regions or None)
    run.per_rank[rank] = run.record.records
    width = None if args.wide or not sys.stdout.isatty() else shutil.get_terminal_size().columns
    print("\n".join(wrap([
        f"cp_passes plan: {name} ({description}), spec {spec.name}",
        f"P = {world}, S = {seq_len} ({local} tokens per rank), batch {args.batch}, {args.dtype}"
        f"{', packed documents' if args.packed else ''}, with labels (a training step); a dry run with "
        f"fake tensors and a fake process group (nothing allocated, no processes)"], width)) + "\n")
    print(format_record(run.record, width))
    if any(r.collective for r in run.record.records) and len(columns) > 1:
        _print_bytes_by_rank(run, columns, width)
    print()
    print("\n".join(wrap(format_memory(run.memory, rank, local, format_bytes), width)))
    print("\n".join(wrap([format_overlap(run.overlap, format_bytes)], width)))
    if args.dump:
        files = write_dump(args.dump, run.record, 0)
        print(f"\nwrote {len(files)} files to {args.dump}/rank{rank}/graph0/ (index.txt lists them)")
    return 0


@contextlib.contextmanager
def _warnings_summarised():
    """The warnings torch and the model's code raise while the dry run traces (dynamo's notes on what it traces
    through, a library's deprecations), counted in one line on stderr instead of printed whole; ``python -W`` or
    ``PYTHONWARNINGS`` shows them as usual."""
    if sys.warnoptions:
        yield
        return
    with warnings.catch_warnings(record=True) as heard:
        try:
            yield
        finally:
            if heard:
                first = str(heard[0].message).strip().splitlines()[0]
                count = f"{len(heard)} warning{'' if len(heard) == 1 else 's'}"
                print(f"cp_passes: {count} while tracing, hidden (the first, from "
                      f"{os.path.basename(heard[0].filename)}: {first}); python -W default shows them",
                      file=sys.stderr, flush=True)


def _explain_model(args, dtype) -> tuple:
    """``(build, config, name, description)`` of the model ``explain`` plans: a built-in example, a
    ``module:factory``, or ``--hf-config`` (then ``config`` is its transformers config, else None)."""
    from .models import EXAMPLES, built_in, factory_model, hf_model

    if (args.model is None) == (args.hf_config is None):
        raise SystemExit("give a MODEL (a built-in example or module:factory) or --hf-config, not both")
    if args.hf_config is not None:
        build, config, name = hf_model(args.hf_config, dtype)
        text = getattr(config, "text_config", None) or config
        description = f"transformers' {name}, {getattr(text, 'num_hidden_layers', '?')} layers, its config's defaults"
        return build, config, name, description
    if args.model in EXAMPLES:
        name, (description, example) = args.model, EXAMPLES[args.model]
        return (lambda: built_in(example, dtype)), None, name, description
    if ":" in args.model:
        return factory_model(args.model, dtype), None, args.model, "built by the factory"
    raise SystemExit(f"MODEL {args.model!r} is neither a built-in example ({', '.join(sorted(EXAMPLES))}) nor "
                     f"module:factory; for a transformers model use --hf-config")


def _step_inputs(args, local: int):
    """The dry run's inputs for a model: what a training step passes, tokens and labels, and with --packed what
    shard_batch's packing passes (the doc-id map, where the model reads it, and per-document positions)."""
    import inspect

    import torch

    def inputs(model):
        takes = inspect.signature(model.forward).parameters
        kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in takes.values())
        wanted = ["input_ids", "labels"] + (["doc_ids", "position_ids"] if args.packed else [])
        return {key: ((args.batch, local), torch.long) for key in wanted
                if key in takes or (kwargs and key != "doc_ids")}

    return inputs


def _print_bytes_by_rank(run, columns: list[int], width: int | None) -> None:
    """The bytes each moving record receives per forward on the ranks ``columns`` (as many as ``width`` fits;
    with no width, each against its lower bound)."""
    from tabulate import tabulate

    from ..report.explain import collapse_layers, format_bytes, wrap

    bound = " / lower bound" if width is None else ""
    print("\n" + "\n".join(wrap([f"received{bound} per forward, by rank (--ranks to choose; the backward moves "
                                 f"the same bytes back{'' if bound else '; the lower bound: --wide'}):"], width)))

    def cell(records):
        got = format_bytes(sum(r.bytes for r in records))
        return got if width is not None else f"{got} / {format_bytes(sum(r.lower_bound_bytes for r in records))}"

    fit = max(2, (width - 40) // 11) if width is not None else len(columns)
    shown = columns if len(columns) <= fit else columns[:fit - 1] + columns[-1:]
    rows = [row[1:] for row in collapse_layers(
        [[rec.node, rec.module, rec.rule] + [cell([r for r in run.per_rank[c] if r.node == rec.node]) for c in shown]
         for rec in run.record.records if rec.collective], 1)]
    rows.append(["total", ""] + [cell(run.per_rank[c]) for c in shown])
    print(tabulate(rows, headers=["module", "rule"] + [f"rank {c}" for c in shown]))


def _specs(args) -> int:
    from ..spec import available_specs, describe_spec, load_spec, model_types

    print("Each shipped spec's fields that differ from CPSpec()'s; help(cp_passes.CPSpec) documents them all.")
    for name in available_specs():
        types = model_types(name)
        picked = f" (picked for model_type {', '.join(types)})" if types else ""
        print(f"\n{name}{picked}:\n{describe_spec(load_spec(name))}")
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
    _add_explain(sub)
    specs = sub.add_parser("specs", help="list the model specs shipped in model_specs/",
                           description="Print every spec in model_specs/, the transformers model types "
                                       "cp_compile(model) picks it for, and its fields.")
    specs.set_defaults(run=_specs)
    return parser


def _add_explain(sub) -> None:
    from .models import EXAMPLES

    explain = sub.add_parser(
        "explain",
        help="plan any model for any world size and sequence length, without processes or memory",
        description="Build a model with fake tensors (nothing allocated) on a fake process group of --world-size "
                    "ranks, capture it as cp_compile does, run cp_passes' analysis, planning and transport passes, "
                    "and print the rewrite table for --rank, the bytes each of several ranks receives per layer, "
                    "and --rank's memory: what its training step saves for the backward (AOTAutograd's partition, "
                    "by module) against one device's divided by P, its largest collective buffer and [sequence x "
                    "sequence] tensor, and the parameters. The model is a built-in example (" +
                    "; ".join(f"{k}: {v[0]}" for k, v in EXAMPLES.items()) + "), a module:factory that returns "
                    "your model, or a transformers model (--hf-config). Each repeated block is planned once "
                    "(--no-regions plans every layer): seconds for 60 layers.",
    )
    explain.add_argument("model", nargs="?", default=None, metavar="MODEL",
                         help="a built-in example, or module:factory (a function, importable from the current "
                              "directory, that returns the model; its forward takes input_ids and labels)")
    explain.add_argument("--hf-config", metavar="NAME", default=None,
                         help="a transformers model with its config's defaults: a model class "
                              "(DeepseekV4ForCausalLM), a model type (llama: its causal LM) or a config.json path; "
                              "the shipped spec for its model type unless --spec")
    explain.add_argument("--no-regions", dest="regions", action="store_false",
                         help="trace and plan every layer, not each repeated block once")
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
                         help="a spec name from model_specs/ or a .py file defining SPEC (default: the shipped spec "
                              "for a transformers model's type, else CPSpec())")
    explain.add_argument("--dump", metavar="DIR", default=None,
                         help="write --rank's graphs (exported, ATen, after each pass) and the table under "
                              "DIR/rank<r>/graph0/")
    explain.add_argument("--wide", action="store_true",
                         help="every column of the tables and whole lines, however wide (the default when the output "
                              "is not a terminal); in a terminal the tables fit its width")
    explain.add_argument("--traceback", action="store_true",
                         help="when the dry run fails other than by a refusal (the model's own code raised, or "
                              "cp_passes or torch failed), print the whole traceback, not its one-line summary")
    explain.set_defaults(run=_explain)


def _failure(error: BaseException) -> str:
    """An exception the dry run raised that is not a refusal, in a few lines: its type and first line, and the
    last line of the model's code dynamo names."""
    text = str(error).strip().splitlines()
    frames = [i for i, line in enumerate(text) if line.strip().startswith('File "')]
    where = "" if not frames else f"\n  at {text[frames[-1]].strip()}" + (
        f"\n     {text[frames[-1] + 1].strip()}" if frames[-1] + 1 < len(text) else "")
    return (f"cp_passes explain: the dry run failed with {type(error).__name__}: {text[0] if text else ''}{where}\n"
            f"(not a refusal: the model's code, torch or cp_passes raised; --traceback shows where)")


def main(argv=None) -> int:
    from ..errors import CPCompileError

    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except CPCompileError as error:  # a refusal is the answer, not a crash: its problems alone, exit status 1
        print(error, file=sys.stderr)
        return 1
    except Exception as error:  # one readable message, not a traceback every rank prefixes
        if getattr(args, "traceback", True):
            raise
        print(_failure(error), file=sys.stderr)
        return 2

