"""Attention work per rank, contiguous against balanced layout: the slowest rank against the ideal.

Work is the (query, key) score pairs the attention calls of a training step compute, masked or not, times
the per-pair cost (forward and backward). The ideal is what one device's causal (or document) mask allows,
divided by P. Every step waits for the slowest rank, so "max-rank / ideal" is the figure that counts.

- Causal (unpacked): each rank's rewritten forward and backward run on fake tensors, on a fake process group,
  under ``torch.utils.flop_counter.FlopCounterMode``; ``cp_passes::block_attention`` (and its backward) count
  every attention call they make, dense, as FlopCounterMode counts SDPA. A Llama-8B-shaped ToyLlama with one
  layer (attention work per layer does not depend on the depth).
- Packed documents: which key blocks a call computes depends on the doc ids, which fake tensors do not hold.
  The same pieces (``attention_pieces``) and the op's own rectangles (``pair_shapes``: the rows and keys a
  mask block lets anything through) are computed from a real mask at each rank's query and key positions.
  "documents interleaved" is the row ``shard_batch(..., balance="documents")`` makes: every document padded to
  a multiple of 2P and dealt out head and tail (``interleaved_order``), on the balanced layout.

    python benchmarks/attention_work.py                        # P = 8, S = 131072, 32 documents
    python benchmarks/attention_work.py --world-size 4 --seq-len 16384
"""

import argparse
import dataclasses
import sys

import torch
from tabulate import tabulate
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from cp_passes.graph.analysis import hint
from cp_passes.data.packing import Document, interleaved_order
from cp_passes.key_plan import attention_pieces
from cp_passes.layout import BALANCED, CONTIGUOUS, Layout
from cp_passes.spec import CPSpec
from cp_passes.tools.dryrun import dry_run, fake_group
from cp_passes.tools.models import EXAMPLES, built_in
from cp_passes.transports.block_attention import pair_shapes

TARGET = 1.10
DOCUMENTS = "balanced, documents interleaved"
ATTENTION = ("cp_passes.block_attention", "cp_passes.block_attention_backward")


def pair_cost(config, batch: int) -> int:
    """Flops of one (query, key) pair of one layer, forward and backward, over batch and heads."""
    head = config.dim // config.n_heads
    q, kv = (batch, config.n_heads, 1, head), (batch, config.n_kv_heads, 1, head)
    return sdpa_flop_count(q, kv, kv) + sdpa_backward_flop_count(q, q, kv, kv)


def counted_flops(run) -> int:
    """The attention flops of the rewritten graph's forward and backward on fake tensors."""
    with torch._guards.detect_fake_mode(run.fakes):
        fakes = [f.detach().requires_grad_() if f.is_floating_point() else f for f in run.fakes]
        with FlopCounterMode(display=False) as counter:
            outputs = torch.utils._pytree.tree_leaves(run.graph(*fakes))
            sum(o.float().sum() for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad).backward()
    counts = counter.get_flop_counts()["Global"]
    return hint(sum(flops for op, flops in counts.items() if str(op) in ATTENTION))  # shapes are symbolic


def causal_work(args, config, kind: str) -> list[int]:
    """Every rank's attention flops per step, from its rewritten graph."""
    local = args.seq_len // args.world_size
    inputs = {"input_ids": ((args.batch, local), torch.long), "labels": ((args.batch, local), torch.long)}
    flops = []
    for rank in range(args.world_size):
        print(f"  {kind}: rank {rank}", file=sys.stderr, flush=True)
        with fake_group(args.world_size, rank) as group:
            run = dry_run(lambda: built_in(config, torch.bfloat16), inputs, CPSpec(layout=kind), mesh=group)
        flops.append(counted_flops(run))
    return flops


def documents(seq_len: int, count: int, seed: int) -> torch.Tensor:
    """Doc ids of ``count`` documents of random lengths (at least 1) filling ``seq_len`` positions."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(seq_len - 1, generator=g)[:count - 1].sort().values + 1
    lengths = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([seq_len])]))
    return torch.repeat_interleave(torch.arange(count), lengths)


def interleaved(doc: torch.Tensor, world: int) -> torch.Tensor:
    """The doc ids of ``doc``'s row as ``shard_batch(..., balance="documents")`` lays it out: each document
    padded (doc id -1) to a multiple of ``2 * world``, then interleaved."""
    pieces, ids, docs = 2 * world, [], []
    for d, length in enumerate(torch.bincount(doc).tolist()):
        slot = -(-length // pieces) * pieces
        docs.append(Document(sum(len(i) for i in ids), length, slot))
        ids.append(torch.cat([torch.full((length,), d), torch.full((slot - length,), -1)]))
    row = torch.cat(ids)
    return row[interleaved_order(docs, len(row), pieces)]


def packed_work(args, config, kind: str, doc: torch.Tensor) -> list[int]:
    """Every rank's attention pairs with a document mask (causal within each document; padding, doc id -1, sees
    nothing): the rectangles ``cp_passes::block_attention`` computes from the mask at this rank's queries and the
    keys it brings."""
    layout, local = Layout(args.world_size, kind), len(doc) // args.world_size
    size = layout.chunk_len(local)
    pairs = []
    for rank in range(args.world_size):
        q_pos = layout.positions(rank, local)
        k_pos = torch.arange(layout.visible_prefix(rank, local))  # the causal prefix gather: global order
        mask = (doc[q_pos][:, None] == doc[k_pos][None, :]) & (k_pos[None, :] <= q_pos[:, None]) & (doc[k_pos] >= 0)
        q_units, k_units, kinds = attention_pieces(layout, rank, True, True)
        meta = torch.empty(1, 1, local, 1, device="meta"), torch.empty(1, 1, len(k_pos), 1, device="meta")
        shapes = pair_shapes(meta[0], meta[1], meta[1], mask, [u * size for u in q_units],
                             [u * size for u in k_units], kinds)
        pairs.append(sum(q[2] * k[2] for q, k, _ in shapes))
        del mask
    return [p * pair_cost(config, args.batch) for p in pairs]


def row(name: str, work: list[int], ideal: float) -> list:
    return [name, f"{max(work) / ideal:.3f}", f"{min(work) / ideal:.3f}", f"{sum(work) / len(work) / ideal:.3f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=8, help="CP ranks (default: 8)")
    parser.add_argument("--seq-len", type=int, default=131072, help="global sequence length (default: 131072)")
    parser.add_argument("--batch", type=int, default=1, help="batch size (default: 1)")
    parser.add_argument("--documents", type=int, default=32, help="documents in the packed row (default: 32)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the document lengths (default: 0)")
    args = parser.parse_args()
    if args.seq_len % (2 * args.world_size):
        raise SystemExit("--seq-len must be a multiple of 2 * --world-size (the balanced layout's chunks)")
    config = dataclasses.replace(EXAMPLES["llama-8b"][1], n_layers=1)
    cost, S, P = pair_cost(config, args.batch), args.seq_len, args.world_size
    print(f"attention work per rank, llama-8b shape (one layer), P = {P}, S = {S}, batch {args.batch}; "
          f"ideal = pairs one device's mask allows / P", flush=True)
    rows, results = [], {}
    ideal = S * (S + 1) // 2 * cost / P
    for kind in (CONTIGUOUS, BALANCED):
        print(f"causal, {kind}: planning every rank on fake tensors ...", file=sys.stderr, flush=True)
        results[("causal", kind)] = work = causal_work(args, config, kind)
        rows.append(row(f"causal, {kind}", work, ideal))
    doc = documents(S, args.documents, args.seed)
    lengths = torch.bincount(doc)
    packed_ideal = int((lengths * (lengths + 1) // 2).sum()) * cost / P
    for kind, row_doc in ((CONTIGUOUS, doc), (BALANCED, doc), (DOCUMENTS, interleaved(doc, P))):
        print(f"packed, {kind}: cutting the document mask per rank ...", file=sys.stderr, flush=True)
        layout = BALANCED if kind == DOCUMENTS else kind
        results[("packed", kind)] = work = packed_work(args, config, layout, row_doc)
        rows.append(row(f"packed {args.documents} docs, {kind}", work, packed_ideal))
    print(tabulate(rows, headers=("batch, layout", "max-rank / ideal", "min-rank / ideal", "mean / ideal")))
    for case, kinds in (("causal", (BALANCED, CONTIGUOUS)), ("packed", (DOCUMENTS, BALANCED, CONTIGUOUS))):
        for kind in kinds:
            work = results[(case, kind)]
            base = ideal if case == "causal" else packed_ideal
            print(f"{case}: {kind} max-rank / ideal = {max(work) / base:.3f}")
    causal, packed = (max(results[key]) / base for key, base in ((("causal", BALANCED), ideal),
                                                                 (("packed", DOCUMENTS), packed_ideal)))
    met = causal <= TARGET and packed <= TARGET
    print(f"target: max-rank / ideal <= {TARGET} (causal, balanced: {causal:.3f}; packed, {DOCUMENTS}: "
          f"{packed:.3f}): {'met' if met else 'NOT met'}")


if __name__ == "__main__":
    main()
