"""Train the built-in ToyLlama with context parallelism: the whole user-side change is three calls.

    torchrun --nproc-per-node 2 examples/train_toy_llama.py     # or: python examples/train_toy_llama.py

The model is written for one device. cp_compile rewrites its graph, shard_batch gives each rank its
positions of the (padded) sequence in the spec's layout (balanced: a head and a tail chunk), and
all_reduce_gradients sums the ranks' gradients.
"""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import cp_passes
from cp_passes.tools.launch import launch
from cp_passes.tools.models import ToyLlama


def train(steps: int, seq_len: int, backend: str) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))["cp"]
    torch.manual_seed(0)
    model = ToyLlama()
    compiled = cp_passes.cp_compile(model, "llama", mesh=mesh, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(steps):
        ids = torch.randint(0, 256, (4, seq_len), generator=torch.Generator().manual_seed(step))
        labels = torch.cat([ids[:, 1:], torch.full((4, 1), -100)], dim=1)  # shift before sharding
        local, _ = compiled.shard_batch({"input_ids": ids, "labels": labels})  # cut for the compiled spec
        loss_sum, _ = compiled(**local)
        n_tokens = (labels != -100).sum()
        (loss_sum / n_tokens).backward()
        cp_passes.all_reduce_gradients(model, mesh)
        opt.step()
        opt.zero_grad()
        loss = cp_passes.global_loss(loss_sum, mesh) / n_tokens  # the ranks' shares added: one device's value
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not under torchrun (default: 2)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps (default: 5)")
    parser.add_argument("--seq-len", type=int, default=512, help="global sequence length (default: 512)")
    parser.add_argument("--backend", choices=("inductor", "aot_eager"), default="inductor",
                        help="compiler after the CP passes (default: inductor)")
    args = parser.parse_args()
    launch(train, args.nproc, args.steps, args.seq_len, args.backend)


if __name__ == "__main__":
    main()
