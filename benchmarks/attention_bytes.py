"""Bytes each rank receives for attention's keys and values: causal, sliding-window and packed-document
attention at P = 8 and 16 on both layouts, against the lower bound and against an all-gather.

Planned on fake tensors and a fake process group (``dry_run`` with every rank planned), one ToyLlama layer
(2 KV heads of 16, fp32, batch 1). The bound is computed here from positions alone, not from the transports:
the keys rank r's queries can see that another rank holds (causal: every earlier position; a window: the
``w - 1`` before each query; packed documents: the earlier positions of each query's own document, for
``--docs`` documents of random lengths, seed 0). Causal and windowed bytes are the planned records. For
packed documents what moves depends on the data: the bytes are the transport's own count
(``prefix_cost`` with every rank's ``first_keys``, as ``cp_passes::prefix_gather`` all-gathers them), read
from the document mask the model builds, at each rank's queries and its causal prefix of keys. One line per
layout, kind, P and rank; the last line is the worst ratio of bytes to bound.

    python benchmarks/attention_bytes.py                       # S = 131072, window 4096, 32 documents
    python benchmarks/attention_bytes.py --seq-len 32768 --world-sizes 8

With ``--hf-config NAME`` (a transformers model class or type, as ``explain --hf-config`` takes) it plans that
model's default config cut to ``--layers`` layers (bf16) instead, and prints each rank's bytes received for its
attentions' keys against the bound cp_passes computes: the narrowest tensors the keys derive from position by
position (for MLA, DeepSeek-V3's latent of ``kv_lora_rank + qk_rope_head_dim`` a position, not K and V). Where
``CPSpec.moved_keys`` moves those tensors (MLA's latent: 1.000 of the bound; K and V were 71.1x), each rank
computes K and V again on the rows it receives; where it does not (Llama's K and V projections cost more to
compute again than their bytes to move), K and V move.

    python benchmarks/attention_bytes.py --hf-config deepseek_v3 --seq-len 4096 --world-sizes 8
"""

import argparse

import torch
from tabulate import tabulate

from cp_passes.layout import Layout
from cp_passes.spec import CPSpec
from cp_passes.tools.dryrun import dry_run, fake_group
from cp_passes.tools.models import ToyLlama, ToyLlamaConfig, hf_model
from cp_passes.transports.prefix_exchange import prefix_cost
from cp_passes.transports.masks import first_keys

KINDS = ("causal", "window", "packed")


def document_starts(seq_len: int, docs: int) -> torch.Tensor:
    """The first position of each position's document, for ``docs`` documents of random lengths (seed 0)."""
    cuts = torch.randperm(seq_len - 1, generator=torch.Generator().manual_seed(0))[:docs - 1].sort().values + 1
    starts = torch.zeros(seq_len, dtype=torch.long)
    starts[cuts] = cuts
    return torch.cummax(starts, 0).values


def needed_keys(layout: Layout, rank: int, local: int, kind: str, window: int, starts: torch.Tensor) -> int:
    """How many key positions rank ``rank``'s queries can see that another rank holds."""
    seen = torch.zeros(layout.global_len(local), dtype=torch.bool)
    for start, stop in layout.ranges(rank, local):
        first = {"causal": 0, "window": max(0, start - window + 1), "packed": int(starts[start])}[kind]
        seen[first:stop] = True
    seen[layout.positions(rank, local)] = False
    return int(seen.sum())


def packed_received(world: int, kind: str, local: int, starts: torch.Tensor, row: int) -> dict[int, int]:
    """Each rank's K/V bytes received per forward for packed documents: the gather's count from every rank's
    first keys, read by ``first_keys`` from the model's document mask (same document, causal)."""
    config = ToyLlamaConfig(n_layers=1)
    inputs = {"input_ids": ((1, local), torch.long), "doc_ids": ((1, local), torch.long)}
    with fake_group(world, world - 1) as group:
        run = dry_run(lambda: ToyLlama(config), inputs, CPSpec(layout=kind), mesh=group)
    planned = [r.collective for r in run.record.records if r.rule.startswith("sdpa")]
    if not planned or not all("first key its mask shows" in c for c in planned):
        raise SystemExit(f"packed documents are not gathered from their first keys: {planned}")
    layout, firsts = Layout(world, kind), []
    for rank in range(world):
        q_pos = layout.positions(rank, local)
        k_pos = torch.arange(layout.visible_prefix(rank, local))
        mask = (starts[q_pos][:, None] == starts[k_pos][None, :]) & (k_pos[None, :] <= q_pos[:, None])
        firsts.append(tuple(first_keys(mask, torch.empty(local, 1), world, kind).tolist()))
        del mask
    return {rank: prefix_cost(layout, rank, local, row, 4, "K+V", firsts=tuple(firsts)).bytes
            for rank in range(world)}


def plan(kind: str, world: int, layout: str, local: int, window: int) -> dict[int, int]:
    """Each rank's K/V bytes received per forward for one attention layer, as the transports count them."""
    config = ToyLlamaConfig(n_layers=1, window=window if kind == "window" else None)
    inputs = {"input_ids": ((1, local), torch.long)}
    with fake_group(world, 0) as group:
        run = dry_run(lambda: ToyLlama(config), inputs, CPSpec(layout=layout), mesh=group, plan_ranks=range(world))
    return {rank: sum(r.bytes - r.metadata_bytes for r in records if r.rule.startswith("sdpa"))
            for rank, records in run.per_rank.items()}


def hf_rows(name: str, layers: int, world: int, seq_len: int) -> list[tuple]:
    """(model, P, rank, bytes, bound, bytes / bound) of the attentions' keys of ``name``'s default config cut to
    ``layers`` layers, every rank planned."""
    build, config, cls = hf_model(name, torch.bfloat16)
    text = getattr(config, "text_config", None) or config
    text.num_hidden_layers = layers
    local = seq_len // world
    inputs = {"input_ids": ((1, local), torch.long), "labels": ((1, local), torch.long)}
    with fake_group(world, 0) as group:
        run = dry_run(build, inputs, mesh=group, plan_ranks=range(1, world))
    run.per_rank[0] = run.record.records
    rows = []
    for rank in range(world):
        keys = [r for r in run.per_rank[rank] if r.rule.startswith("sdpa")]
        moved, bound = sum(r.bytes - r.metadata_bytes for r in keys), sum(r.lower_bound_bytes for r in keys)
        rows.append((cls, world, rank, moved, bound, f"{moved / bound:.3f}" if bound else "-"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=131072, help="global sequence length (default: 131072)")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[8, 16], help="CP ranks (default: 8 16)")
    parser.add_argument("--window", type=int, default=4096, help="sliding-window width (default: 4096)")
    parser.add_argument("--docs", type=int, default=32, help="packed documents (default: 32)")
    parser.add_argument("--hf-config", metavar="NAME", default=None,
                        help="a transformers model's default config instead of ToyLlama's layer (see above)")
    parser.add_argument("--layers", type=int, default=2, help="layers of --hf-config's model (default: 2)")
    args = parser.parse_args()
    if args.hf_config is not None:
        rows = [row for world in args.world_sizes for row in hf_rows(args.hf_config, args.layers, world,
                                                                      args.seq_len)]
        print(f"S = {args.seq_len}, {args.layers} layers of {args.hf_config}'s default config, bf16: bytes each rank "
              f"receives per forward for its attentions' keys, against the narrowest tensors they derive from")
        print(tabulate(rows, headers=("model", "P", "rank", "bytes", "bound", "bytes / bound")))
        return
    row = 2 * 2 * 16 * 4  # K and V, 2 KV heads of 16, fp32, batch 1
    starts = document_starts(args.seq_len, args.docs)
    rows, worst = [], (0.0, "")
    for layout in ("contiguous", "balanced"):
        for kind in KINDS:
            for world in args.world_sizes:
                if args.seq_len % (2 * world):
                    raise SystemExit(f"--seq-len must be a multiple of 2 * {world}")
                local = args.seq_len // world
                received = (packed_received(world, layout, local, starts, row) if kind == "packed"
                            else plan(kind, world, layout, local, args.window))
                for rank in range(world):
                    bound = needed_keys(Layout(world, layout), rank, local, kind, args.window, starts) * row
                    gathered = (world - 1) * local * row
                    ratio = received[rank] / bound if bound else (1.0 if received[rank] == 0 else float("inf"))
                    rows.append((layout, kind, world, rank, received[rank], bound, f"{ratio:.3f}",
                                 f"{received[rank] / gathered:.3f}"))
                    worst = max(worst, (ratio, f"{layout} {kind} P={world} rank {rank}"))
    print(f"S = {args.seq_len}, window {args.window}, {args.docs} packed documents; K/V bytes received per forward "
          f"for one layer (2 KV heads of 16, fp32, batch 1)")
    print(tabulate(rows, headers=("layout", "attention", "P", "rank", "bytes", "bound", "bytes / bound",
                                  "bytes / all-gather"), floatfmt=".3f"))
    print(f"worst bytes/bound: {worst[0]:.3f} ({worst[1]})")


if __name__ == "__main__":
    main()
