"""Train the built-in ToyLlama with FSDP2 over context parallelism: a dp x cp mesh, bf16 autocast, activation
checkpointing, and gradient accumulation over micro-batches of different lengths.

    torchrun --nproc-per-node 4 examples/train_fsdp_cp.py        # dp 2 x cp 2 on CPU (gloo)
    python examples/train_fsdp_cp.py                             # the same, 4 processes spawned here

cp_compile shards each sequence over the cp dim. fully_shard over the flattened (dp, cp) mesh shards the
parameters over every rank, as torchtitan does, and sums the gradients over all of them: over cp, where each
rank's gradient is its tokens' share, and over dp, because each summed loss is divided by the token count of
the whole step (global_token_count), which also weighs micro-batches of different lengths correctly.
"""

import argparse
import contextlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import cp_passes
from cp_passes.tools.launch import launch
from cp_passes.tools.models import ToyLlama, ToyLlamaConfig


def micro_batches(step: int, rows: int, lengths: list[int]) -> list[dict]:
    """The step's micro-batches for every replica (``rows`` each): token ids and labels shifted before
    sharding (-100 where there is no next token)."""
    batches = []
    for i, length in enumerate(lengths):
        ids = torch.randint(0, 256, (rows, length), generator=torch.Generator().manual_seed(100 * step + i))
        labels = torch.cat([ids[:, 1:], torch.full((rows, 1), -100)], dim=1)
        batches.append({"input_ids": ids, "labels": labels})
    return batches


def train(dp: int, steps: int, seq_len: int, micro: int, backend: str, bf16: bool, checkpoint: bool) -> None:
    world = dist.get_world_size()
    if world % dp:
        raise SystemExit(f"--dp {dp} does not divide the {world} ranks")
    mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "cp"))
    torch.manual_seed(0)
    model = ToyLlama(ToyLlamaConfig(checkpoint=checkpoint))
    compiled = cp_passes.cp_compile(model, "llama", mesh=mesh["cp"], backend=backend)
    fully_shard(compiled, mesh=mesh["dp", "cp"]._flatten("dp_cp"))
    cp_passes.sum_gradients(compiled)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    replica, rows = mesh["dp"].get_local_rank(), 2
    # Each micro-batch is shorter than the last: the sequence dim is symbolic, so the lengths share one graph.
    lengths = [max(2 * world, seq_len - i * seq_len // (2 * micro)) for i in range(micro)]
    for step in range(steps):
        local = []
        for batch in micro_batches(step, rows * dp, lengths):
            mine = {k: v[replica * rows:(replica + 1) * rows] for k, v in batch.items()}
            local.append(compiled.shard_batch(mine)[0])  # the spec and CP group cp_compile has
        count = cp_passes.global_token_count([b["labels"] for b in local], mesh)
        total = torch.zeros(())
        for batch in local:
            with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
                loss_sum, _ = compiled(**batch)
            loss = loss_sum / count  # this rank's share of the step's mean loss
            loss.backward()
            total += loss.detach().float()
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(total)
        if dist.get_rank() == 0:
            print(f"step {step}: loss {total.item():.4f} over {int(count)} tokens in micro-batches of lengths "
                  f"{lengths}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4, help="ranks to spawn when not under torchrun (default: 4)")
    parser.add_argument("--dp", type=int, default=2, help="data-parallel replicas; cp = ranks / dp (default: 2)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps (default: 3)")
    parser.add_argument("--seq-len", type=int, default=256, help="global length of the longest micro-batch "
                                                                  "(default: 256)")
    parser.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step (default: 2)")
    parser.add_argument("--backend", choices=("inductor", "aot_eager"), default="inductor",
                        help="compiler after the CP passes (default: inductor)")
    parser.add_argument("--fp32", action="store_true", help="no bf16 autocast")
    parser.add_argument("--no-checkpoint", action="store_true", help="no activation checkpointing")
    args = parser.parse_args()
    launch(train, args.nproc, args.dp, args.steps, args.seq_len, args.micro_batches, args.backend, not args.fp32,
           not args.no_checkpoint)


if __name__ == "__main__":
    main()
