"""The demo: a few CP training steps of the built-in ToyLlama beside the same steps on one device."""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ..compiler.backend import cp_compile
from ..data_parallel import global_loss
from ..helpers import all_reduce_gradients
from ..report.explain import explain
from ..layout import resolve_layout
from ..spec import resolve_spec
from .models import ToyLlama, ToyLlamaConfig

TOLERANCE = 1e-4
"""Largest relative loss difference the demo accepts after several Adam steps in fp32."""


def demo_batch(step: int, seq_len: int, batch: int = 2, vocab: int = 256) -> dict:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, vocab, (batch, seq_len), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((batch, 1), -100)], dim=1)
    return {"input_ids": ids, "labels": labels}


def demo_rank(steps: int, seq_len: int, backend: str, dump_dir) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"]
    torch.manual_seed(0)
    model = ToyLlama(ToyLlamaConfig())
    reference = copy.deepcopy(model)  # the single-device run, on every rank so all ranks agree on it
    spec = resolve_spec("llama")
    compiled = cp_compile(model, spec, mesh=mesh, backend=backend, dump_dir=dump_dir)
    layout, why = resolve_layout(spec, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    if rank == 0:
        print(f"cp_passes demo: ToyLlama, P={world} ranks (gloo), {steps} AdamW steps, global sequence {seq_len} "
              f"(padded to a multiple of {world * layout.chunks}), backend {backend}\n"
              f"layout: {layout.describe()} ({why})", flush=True)
    worst = 0.0
    for step in range(steps):
        batch = demo_batch(step, seq_len)
        n_tokens = (batch["labels"] != -100).sum()
        local, _layout = compiled.shard_batch(batch)
        loss_sum, _logits = compiled(**local)  # this rank's share of the summed token loss
        (loss_sum / n_tokens).backward()
        all_reduce_gradients(model, mesh)
        opt.step()
        opt.zero_grad()
        cp_loss = (global_loss(loss_sum, mesh) / n_tokens).item()  # the ranks' shares added

        ref_loss = reference(**batch)[0] / n_tokens
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        diff = abs(cp_loss - ref_loss.item()) / abs(ref_loss.item())
        worst = max(worst, diff)
        if rank == 0:
            print(f"step {step}: CP loss {cp_loss:.6f}   single-device loss {ref_loss.item():.6f}   "
                  f"rel diff {diff:.1e}", flush=True)
    param_diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    if rank == 0:
        print(f"after {steps} steps: max |param diff| {param_diff:.1e}\n", flush=True)
    dist.barrier()
    if rank == world - 1:  # the last rank needs every earlier rank's K/V: its table shows the full transport
        explain(compiled)
        if worst > TOLERANCE:
            print(f"PARITY FAILED: relative loss difference {worst:.1e} > {TOLERANCE:.0e}", file=sys.stderr, flush=True)
    if worst > TOLERANCE:
        raise SystemExit(1)
