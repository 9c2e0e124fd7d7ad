"""The one-GPU check of block attention's CUDA path (under 8 minutes on one H100 or H200):

1. parity: every pair kind (a causal prefix with its causal diagonal, the balanced layout's pairs with a skipped
   one, bidirectional, a document mask) with grouped-query heads, forward and backward, against
   ``F.scaled_dot_product_attention`` on the same device, in fp32 and bf16. Both are measured against an fp64
   reference; a line passes when block attention's error is within twice SDPA's own (or a small floor);
2. throughput: rank 7's pieces at P = 8 and S = 131,072 with Llama-8B's heads (32 query heads, 8 key/value heads
   of 128), forward and backward, against flash SDPA on a causal sequence of the same work (as many visible
   query-key pairs), as one ratio line ``block/flash throughput: R``;
3. memory: the peak of one rank's training step (rank 7 of a fake group of 8: collectives move nothing) of a
   Llama-8B-shaped ToyLlama of 2 layers in bf16 at S = 131,072.

    python benchmarks/gpu_check.py                      # on one GPU: the figures above
    python benchmarks/gpu_check.py --device cpu --seq-len 4096 --heads 4 --kv-heads 2 --head-dim 32 \\
        --dim 128 --ffn 256 --vocab 512                 # the smoke test the suite runs, on CPU

It exits non-zero when a parity line fails.
"""

import argparse
import time

import torch
import torch.nn.functional as F

from cp_passes.key_plan import attention_pieces
from cp_passes.layout import Layout
from cp_passes.transports.attention_kernels import kernel_for
from cp_passes.transports.block_attention import block_attention_op

CASES = {
    "causal prefix (contiguous, rank 2 of 4)": (Layout(4, "contiguous"), 2, True, False),
    "balanced pairs, one skipped (rank 1 of 4)": (Layout(4, "balanced"), 1, True, False),
    "bidirectional (rank 0 of 2)": (Layout(2, "contiguous"), 0, False, False),
    "document mask (rank 2 of 4)": (Layout(4, "contiguous"), 2, True, True),
}
"""name -> (layout, rank, causal, masked)."""

FLOOR = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _documents(positions: torch.Tensor) -> torch.Tensor:
    """Document ids: documents of 37, 300, 5 and the rest of the sequence (one crosses ranks)."""
    return torch.bucketize(positions, torch.tensor([37, 337, 342], device=positions.device), right=True)


def rank_problem(layout: Layout, rank: int, causal: bool, masked: bool, local: int, device):
    """``(q_pos, k_pos, q_bounds, k_bounds, kinds, visible)`` of ``rank``: its query positions, the positions of
    the keys gathered for it, the pieces in rows, and which key each query sees."""
    q_units, k_units, kinds = attention_pieces(layout, rank, causal, masked)
    unit = local // layout.chunks
    q_pos = layout.positions(rank, local, device)
    if causal:
        k_pos = torch.arange(layout.prefix_chunks(rank) * unit, device=device)
    else:
        k_pos = layout.gathered_positions(local, device)
    visible = (q_pos[:, None] >= k_pos[None, :]) if causal else torch.ones(len(q_pos), len(k_pos), dtype=torch.bool,
                                                                           device=device)
    if masked:
        visible = visible & (_documents(q_pos)[:, None] == _documents(k_pos)[None, :])
    return q_pos, k_pos, [u * unit for u in q_units], [u * unit for u in k_units], kinds, visible


def _grads(out, inputs, grad):
    return torch.autograd.grad(out, inputs, grad)


def parity(device, heads: int, kv_heads: int, dim: int, local: int) -> bool:
    """Print one line per case and dtype; True when all pass."""
    ok = True
    for name, (layout, rank, causal, masked) in CASES.items():
        q_pos, k_pos, q_bounds, k_bounds, kinds, visible = rank_problem(layout, rank, causal, masked, local, device)
        g = torch.Generator(device="cpu").manual_seed(0)
        q64, k64, v64, grad64 = (torch.randn(n, generator=g, dtype=torch.float64).to(device) for n in (
            (1, heads, len(q_pos), dim), (1, kv_heads, len(k_pos), dim), (1, kv_heads, len(k_pos), dim),
            (1, heads, len(q_pos), dim)))
        mask = visible[None, None] if masked else None
        rep = heads // kv_heads

        def sdpa(q, k, v):
            return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                                  attn_mask=visible)

        inputs64 = [t.requires_grad_() for t in (q64, k64, v64)]
        want = sdpa(*inputs64)
        want_grads = _grads(want, inputs64, grad64)
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q64, k64, v64))
            grad = grad64.to(dtype)
            got, _ = block_attention_op(q, k, v, mask, q_bounds, k_bounds, kinds, dim ** -0.5)
            got_grads = _grads(got, (q, k, v), grad)
            base = sdpa(q, k, v)
            base_grads = _grads(base, (q, k, v), grad)
            errors = [(float((a.double() - w).abs().max()), float((b.double() - w).abs().max()))
                      for a, b, w in zip((got.detach(), *got_grads), (base.detach(), *base_grads),
                                         (want.detach(), *want_grads))]
            passed = all(e <= max(2 * s, FLOOR[dtype]) for e, s in errors)
            ok &= passed
            kernel = kernel_for(q[..., :1, :], k[..., :1, :], v[..., :1, :], masked, False)
            worst = max(errors, key=lambda e: e[0] / max(e[1], FLOOR[dtype]))
            print(f"parity {name:44s} {str(dtype)[6:]:9s} {kernel:15s} block err {worst[0]:.2e}  sdpa err "
                  f"{worst[1]:.2e}  {'PASS' if passed else 'FAIL'}")
    return ok


def _timed(step, device, repeats: int = 3) -> float:
    step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    sync()
    return (time.perf_counter() - start) / repeats


def throughput(device, dtype, world: int, seq_len: int, heads: int, kv_heads: int, dim: int) -> float:
    """Block attention's TFLOP/s over flash SDPA's on the same work; prints both and the ratio line."""
    layout, rank, local = Layout(world, "balanced"), world - 1, seq_len // world
    q_pos, k_pos, q_bounds, k_bounds, kinds, visible = rank_problem(layout, rank, True, False, local, device)
    pairs = int(visible.sum())
    del visible
    equal = int(((8 * pairs + 1) ** 0.5 - 1) / 2)  # a causal length with as many visible pairs
    flops = 3.5 * 4 * heads * dim  # forward (two matmuls) and backward (2.5 times it), per visible pair

    def inputs(rows, keys):
        return [torch.randn(1, h, n, dim, device=device, dtype=dtype, requires_grad=True)
                for h, n in ((heads, rows), (kv_heads, keys), (kv_heads, keys))]

    q, k, v = inputs(len(q_pos), len(k_pos))

    def block():
        out, _ = block_attention_op(q, k, v, None, q_bounds, k_bounds, kinds, dim ** -0.5)
        out.backward(torch.ones_like(out))

    block_s = _timed(block, device)
    del q, k, v
    q, k, v = inputs(equal, equal)

    def flash():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.backward(torch.ones_like(out))

    flash_s = _timed(flash, device)
    block_tflops, flash_tflops = flops * pairs / block_s / 1e12, flops * (equal * (equal + 1) // 2) / flash_s / 1e12
    print(f"throughput rank {rank} of {world} at S = {seq_len}: block attention {block_tflops:.3g} TFLOP/s "
          f"({block_s * 1e3:.1f} ms), flash SDPA on a causal {equal} {flash_tflops:.3g} TFLOP/s "
          f"({flash_s * 1e3:.1f} ms)")
    ratio = block_tflops / flash_tflops
    print(f"block/flash throughput: {ratio:.2f}")
    return ratio


def memory(device, args) -> None:
    """The peak memory of rank 7 of 8's training step (a fake group), or the step run for its own sake on CPU."""
    import cp_passes
    from cp_passes.tools.dryrun import fake_group
    from cp_passes.tools.models import ToyLlamaConfig, built_in

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = ToyLlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=2, n_heads=args.heads,
                            n_kv_heads=args.kv_heads, ffn_dim=args.ffn)
    with fake_group(args.world_size, args.world_size - 1) as group:
        model = built_in(config, dtype).to(device)
        compiled = cp_passes.cp_compile(model, mesh=group, backend=args.backend, verbose=False)
        ids = torch.randint(0, args.vocab, (1, args.seq_len), device=device)
        local = compiled.shard_batch({"input_ids": ids, "labels": ids})[0]
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        loss, _ = compiled(local["input_ids"], labels=local["labels"])
        loss.backward()
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2 ** 30
        print(f"memory: rank {args.world_size - 1} of {args.world_size}'s 2-layer step at S = {args.seq_len}: "
              f"peak {peak:.1f} GiB")
    else:
        print(f"memory: rank {args.world_size - 1} of {args.world_size}'s 2-layer step ran (peak measured on CUDA "
              f"only)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke test at small sizes)")
    parser.add_argument("--world-size", type=int, default=8, help="CP ranks of the throughput and memory parts "
                                                                  "(default: 8)")
    parser.add_argument("--seq-len", type=int, default=131072, help="global length of those parts (default: 131072)")
    parser.add_argument("--heads", type=int, default=32, help="query heads (default: 32, Llama-8B's)")
    parser.add_argument("--kv-heads", type=int, default=8, help="key/value heads (default: 8)")
    parser.add_argument("--head-dim", type=int, default=128, help="head dim (default: 128)")
    parser.add_argument("--dim", type=int, default=4096, help="model width of the memory step (default: 4096)")
    parser.add_argument("--ffn", type=int, default=14336, help="MLP width of the memory step (default: 14336)")
    parser.add_argument("--vocab", type=int, default=128256, help="vocabulary of the memory step (default: 128256)")
    parser.add_argument("--parity-len", type=int, default=1024, help="positions per rank in the parity cases "
                                                                    "(default: 1024)")
    parser.add_argument("--backend", default=None, help="the memory step's backend (default: inductor on CUDA, "
                                                        "aot_eager on CPU)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU, or pass --device cpu for the smoke test")
    args.backend = args.backend or ("inductor" if device.type == "cuda" else "aot_eager")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}")
    ok = parity(device, args.heads, args.kv_heads, args.head_dim, args.parity_len)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    throughput(device, dtype, args.world_size, args.seq_len, args.heads, args.kv_heads, args.head_dim)
    memory(device, args)
    if not ok:
        raise SystemExit("a parity line failed")


if __name__ == "__main__":
    main()
