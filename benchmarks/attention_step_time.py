"""Training-step time of CP attention on CPU ranks: gathered keys saved for the backward ("save") against
gathered again in the backward ("regather", the default), on contiguous shards, and regathered on the
balanced layout (the default), each as a ratio to the same step on one process.

Spawns P gloo ranks (one thread each) and runs, per mode, a compiled ToyLlama forward + backward on a
sharded sequence; the single-device step runs in this process with P threads, so every figure uses the
same cores. Ratios come from one run; absolute times depend on the machine.

    python benchmarks/attention_step_time.py                  # P = 2, S = 8192, aot_eager
    python benchmarks/attention_step_time.py --backend inductor --seq-len 16384
"""

import argparse
import os
import time

import torch
import torch.distributed as dist

import cp_passes
from cp_passes.tools.launch import launch
from cp_passes.tools.models import ToyLlama, ToyLlamaConfig

MODES = (("save", "contiguous"), ("regather", "contiguous"), ("regather", "balanced"))
"""(CPSpec.gathered_keys, CPSpec.layout)"""


def config(args) -> ToyLlamaConfig:
    return ToyLlamaConfig(vocab_size=1024, dim=args.dim, n_layers=args.layers, n_heads=args.dim // 32,
                          n_kv_heads=args.dim // 64, ffn_dim=2 * args.dim)


def timed_steps(step, warmup: int, steps: int, barrier=lambda: None) -> float:
    for _ in range(warmup):
        step()
    barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    barrier()
    return (time.perf_counter() - start) / steps


def rank_main(args, results) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    ids = torch.randint(0, 1024, (1, args.seq_len))
    for mode in MODES:
        torch.manual_seed(0)
        model = ToyLlama(config(args))
        spec = cp_passes.CPSpec(gathered_keys=mode[0], layout=mode[1])
        compiled = cp_passes.cp_compile(model, spec, mesh=dist.group.WORLD, backend=args.backend, verbose=False)
        local = cp_passes.shard_batch({"input_ids": ids}, dist.group.WORLD, spec)[0]["input_ids"]

        def step():
            loss, _ = compiled(local, labels=local)
            loss.backward()

        seconds = timed_steps(step, args.warmup, args.steps, dist.barrier)
        if rank == 0:
            results[mode] = seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="CP ranks to spawn (default: 2)")
    parser.add_argument("--seq-len", type=int, default=8192, help="global sequence length (default: 8192)")
    parser.add_argument("--dim", type=int, default=256, help="model width; heads of 32 (default: 256)")
    parser.add_argument("--layers", type=int, default=4, help="layers (default: 4)")
    parser.add_argument("--backend", choices=("aot_eager", "inductor"), default="aot_eager",
                        help="how the rewritten graph is lowered (default: aot_eager)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling (default: 2)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (default: 5)")
    args = parser.parse_args()
    if args.seq_len % (2 * args.world_size):
        raise SystemExit("--seq-len must be a multiple of 2 * --world-size (the balanced layout's chunks)")

    torch.set_num_threads(args.world_size)
    torch.manual_seed(0)
    model = torch.compile(ToyLlama(config(args)), backend=args.backend, dynamic=False)
    ids = torch.randint(0, 1024, (1, args.seq_len))

    def step():
        loss, _ = model(ids, labels=ids)
        loss.backward()

    single = timed_steps(step, args.warmup, args.steps)
    results = torch.multiprocessing.Manager().dict()
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    launch(rank_main, args.world_size, args, results)
    print(f"P = {args.world_size}, S = {args.seq_len}, ToyLlama dim {args.dim} x {args.layers} layers, "
          f"{args.backend}, mean of {args.steps} steps (forward + backward)")
    print(f"one process ({args.world_size} threads): {single * 1e3:.0f} ms")
    for mode in MODES:
        print(f"CP {mode[0]:<9} {mode[1]:<11} {results[mode] * 1e3:.0f} ms per step, "
              f"{results[mode] / single:.2f}x one process")
    save, regather, balanced = (results[mode] for mode in MODES)
    print(f"regather / save (contiguous): {regather / save:.2f}; balanced / contiguous (regather): "
          f"{balanced / regather:.2f}")


if __name__ == "__main__":
    main()
