"""Real sizes: planning and compiling time, and how much of the collectives' traffic can hide behind compute.
Three ratios, measured in one run:

- plan 32/4 layers: CPU seconds of ``python -m cp_passes explain``'s dry run (fake tensors, a fake process group of
  --world-size ranks, S = --seq-len, bf16: capture, planning for six ranks, the rewrite, and the memory estimate's
  two AOTAutograd partitions) of the Llama-3-8B-shaped ToyLlama with 32 layers, against the same model with 4
  layers, after an untimed dry run of one layer (imports and first-use caches); each is timed twice, alternating,
  and the lesser time kept (CPU time on a shared machine varies by a few percent from run to run). Each repeated
  block is planned once (``regions``); ``--no-regions`` measures every layer traced.
- compile cp/plain: wall seconds of the first training step (forward and backward, Inductor) of the demo's ToyLlama
  with 4 layers: ``cp_compile`` on a gloo group of one process against ``torch.compile`` of the same model, each
  in a fresh process with an empty Inductor cache. Both lower the first graph for its call's length (cp_passes
  plans with the length symbolic, then fixes it for Inductor), so the gap is cp_passes' own work: capture,
  planning, the rewrite and the ranks' agreement.
- overlapped: of the bytes llama-8b's collectives receive (32 layers, the same dry run), the fraction waited for
  only after compute that does not need them (:mod:`cp_passes.report.overlap`).

    python benchmarks/compile_time.py                  # P = 8, S = 131072; about 6 minutes on 2 cores

With ``--hf-config NAME`` (a transformers model class or type, as ``explain --hf-config`` takes) it times the
dry run of that model's default config (P = --world-size, S = --seq-len) against the same config cut to one
layer of each kind (the distinct tuples of its per-layer lists: ``layer_types``, ``mlp_layer_types``...) and
to two of each: planning time should follow the kinds, not the depth. With one layer a kind no block repeats,
so nothing is a region; two of each is the smallest config planned as the full one is (a region per kind,
which AOTAutograd traces several times: forward, schema, joint, backward).

    python benchmarks/compile_time.py --hf-config Glm5NextTextModel --world-size 16 --seq-len 1048576
"""

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
import time

import torch

from cp_passes.report.explain import format_bytes
from cp_passes.report.overlap import format_overlap
from cp_passes.tools.dryrun import dry_run, fake_group
from cp_passes.tools.models import EXAMPLES, built_in

COLUMNS = [0, 1, 2, 4, 6, 7]
"""Ranks explain plans by default at P = 8."""


def plan_seconds(layers: int, world: int, seq_len: int, regions: bool):
    """CPU seconds of explain's dry run of llama-8b with ``layers`` layers, and the run."""
    config = dataclasses.replace(EXAMPLES["llama-8b"][1], n_layers=layers)
    local = seq_len // world
    inputs = {"input_ids": ((1, local), torch.long), "labels": ((1, local), torch.long)}
    start = time.process_time()
    with fake_group(world, world - 1) as group:
        run = dry_run(lambda: built_in(config, torch.bfloat16), inputs, mesh=group, memory=True,
                      plan_ranks=[r for r in COLUMNS if r < world - 1], regions=regions or None)
    return time.process_time() - start, run


def hf_plan_seconds(name: str, world: int, seq_len: int, per_kind: int | None):
    """CPU seconds of explain's dry run of a transformers config (regions on), and how many layers it has; with
    ``per_kind``, the config cut to each kind's first ``per_kind`` layers, in the model's order."""
    from cp_passes.spec import resolve_spec
    from cp_passes.tools.models import hf_model

    build, config, _ = hf_model(name, torch.bfloat16)
    layers = config.num_hidden_layers
    per_layer = [key for key, value in config.to_dict().items() if isinstance(value, list) and len(value) == layers]
    if per_kind:
        kinds = list(zip(*(getattr(config, key) for key in per_layer))) if per_layer else [()] * layers
        keep = sorted(i for kind in set(kinds) for i in [j for j, k in enumerate(kinds) if k == kind][:per_kind])
        for key in per_layer:
            setattr(config, key, [getattr(config, key)[i] for i in keep])
        config.num_hidden_layers = len(keep)
    local = seq_len // world
    inputs = {"input_ids": ((1, local), torch.long), "labels": ((1, local), torch.long)}
    start = time.process_time()
    with fake_group(world, world - 1) as group:
        dry_run(build, inputs, resolve_spec(None, config), mesh=group, memory=True,
                plan_ranks=[r for r in COLUMNS if r < world - 1], regions=True)
    return time.process_time() - start, config.num_hidden_layers


def first_step(kind: str) -> float:
    """Wall seconds of the first forward and backward of the 4-layer ToyLlama (run in a fresh process)."""
    import torch.distributed as dist

    import cp_passes
    from cp_passes.tools.models import ToyLlama, ToyLlamaConfig

    torch.manual_seed(0)
    model = ToyLlama(ToyLlamaConfig(n_layers=4))
    ids = torch.randint(0, 256, (2, 256))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    if kind == "cp":
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29571")
        dist.init_process_group("gloo", rank=0, world_size=1)
        compiled = cp_passes.cp_compile(model, mesh=dist.group.WORLD, verbose=False)
    else:
        compiled = torch.compile(model)
    start = time.perf_counter()
    loss, _ = compiled(ids, labels=labels)
    loss.backward()
    return time.perf_counter() - start


def compile_seconds(kind: str) -> float:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        out = subprocess.run([sys.executable, __file__, "--first-step", kind], env=env, check=True,
                             capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=131072)
    parser.add_argument("--no-regions", dest="regions", action="store_false",
                        help="trace and plan every layer (the dry run before regions)")
    parser.add_argument("--hf-config", metavar="NAME",
                        help="time the dry run of this transformers model's default config against one layer of each "
                             "of its layer kinds, instead")
    parser.add_argument("--first-step", choices=("cp", "plain"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.first_step:
        print(first_step(args.first_step))
        return 0
    if args.hf_config:
        plan_seconds(1, args.world_size, 64 * args.world_size, True)  # imports and first-use caches, not timed
        one, kinds = hf_plan_seconds(args.hf_config, args.world_size, args.seq_len, per_kind=1)
        two, repeated = hf_plan_seconds(args.hf_config, args.world_size, args.seq_len, per_kind=2)
        many, layers = hf_plan_seconds(args.hf_config, args.world_size, args.seq_len, per_kind=None)
        print(f"plan {args.hf_config}, P = {args.world_size}, S = {args.seq_len}: one layer of each of its {kinds} "
              f"kinds {one:.1f} CPU-s, two of each ({repeated} layers) {two:.1f} CPU-s, all {layers} layers "
              f"{many:.1f} CPU-s")
        print(f"plan {layers}/{repeated} layers: {many / two:.2f}; {layers}/{kinds}: {many / one:.2f}")
        return 0
    plan_seconds(1, args.world_size, 64 * args.world_size, args.regions)  # imports and first-use caches, not timed
    times: dict[int, list[float]] = {4: [], 32: []}
    for _ in range(2):  # each twice, alternating; the least of each (a shared machine only adds time)
        for layers in times:
            seconds, run = plan_seconds(layers, args.world_size, args.seq_len, args.regions)
            times[layers].append(seconds)
    few, many = min(times[4]), min(times[32])
    print(f"plan llama-8b, P = {args.world_size}, S = {args.seq_len}: 4 layers {few:.1f} CPU-s, 32 layers "
          f"{many:.1f} CPU-s (the least of {', '.join(f'{t:.1f}' for t in times[4])} and "
          f"{', '.join(f'{t:.1f}' for t in times[32])})")
    cp, plain = compile_seconds("cp"), compile_seconds("plain")
    print(f"first training step of the 4-layer ToyLlama, Inductor: cp_compile {cp:.1f} s, torch.compile {plain:.1f} s")
    print(f"llama-8b (32 layers): {format_overlap(run.overlap, format_bytes)}")
    print(f"plan 32/4 layers: {many / few:.2f}; compile cp/plain: {cp / plain:.2f}; "
          f"overlapped: {run.overlap.fraction:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
