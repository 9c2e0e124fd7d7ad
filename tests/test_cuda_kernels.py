"""Block attention's CUDA path on fake CUDA tensors: under ``FakeTensorMode`` a ``device="cuda"`` tensor runs the
CUDA kernels' meta implementations (flash and memory-efficient attention, forward and backward) with their real
signatures, shapes and dtypes, on a machine without a GPU. Every pair kind, mask kind, dtype and grouped-query
shape runs forward and backward through cp_passes' own code; a wrong argument, shape or dtype fails, and so does
any read of a tensor's values on the host (a fake tensor has none)."""

import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cp_passes.key_plan import CAUSAL, FULL, SKIP
from cp_passes.transports import attention_kernels, block_attention
from cp_passes.transports.attention_kernels import CPU_FLASH, CUDA_EFFICIENT, CUDA_FLASH, MATH, kernel_for


def _qkv(device, dtype, heads=8, kv_heads=2, rows=64, keys=64, dk=64, dv=64):
    return (torch.empty(2, heads, rows, dk, device=device, dtype=dtype),
            torch.empty(2, kv_heads, keys, dk, device=device, dtype=dtype),
            torch.empty(2, kv_heads, keys, dv, device=device, dtype=dtype))


@pytest.mark.parametrize("device,dtype,shape,masked,causal,kernel", [
    ("cuda", torch.bfloat16, {}, False, False, CUDA_FLASH),
    ("cuda", torch.float16, {}, False, True, CUDA_FLASH),
    ("cuda", torch.bfloat16, {"keys": 128}, False, True, CUDA_EFFICIENT),  # flash refuses a non-square causal pair
    ("cuda", torch.bfloat16, {}, True, False, CUDA_EFFICIENT),
    ("cuda", torch.float32, {}, False, True, CUDA_EFFICIENT),
    ("cuda", torch.bfloat16, {"dk": 64, "dv": 128}, False, False, CUDA_EFFICIENT),
    ("cuda", torch.bfloat16, {"dk": 320, "dv": 320}, False, False, CUDA_EFFICIENT),
    ("cuda", torch.float16, {"dk": 6, "dv": 6}, False, False, MATH),
    ("cuda", torch.float64, {}, False, False, MATH),
    ("cuda", torch.bfloat16, {"heads": 6, "kv_heads": 4}, False, False, MATH),
    ("cpu", torch.float32, {}, True, False, CPU_FLASH),
    ("cpu", torch.float32, {"dk": 64, "dv": 128}, False, False, MATH),
])
def test_one_table_picks_each_pair_s_kernel(device, dtype, shape, masked, causal, kernel):
    with FakeTensorMode():
        q, k, v = _qkv(device, dtype, **shape)
        assert kernel_for(q, k, v, masked, causal) == kernel
        assert kernel_for(q, k, v, masked, causal, math=True) == MATH


PIECES = {"causal": ([0, 64], [0, 64, 128], [FULL, CAUSAL]),
          "balanced": ([0, 32, 64], [0, 32, 64], [CAUSAL, SKIP, FULL, CAUSAL]),
          "masked": ([0, 64], [0, 64, 128], [FULL, FULL])}
CASES = list(itertools.product(PIECES, (torch.bfloat16, torch.float16, torch.float32), (True, False)))


@pytest.mark.parametrize("pieces,dtype,gqa", CASES, ids=[f"{p}-{str(d)[6:]}-{'gqa' if g else 'mha'}"
                                                         for p, d, g in CASES])
def test_the_cuda_path_runs_forward_and_backward_on_fake_cuda_tensors(monkeypatch, pieces, dtype, gqa):
    """Each computed pair through the kernel the table picks (flash for unmasked half-precision pairs, the
    memory-efficient kernel for masked or fp32 ones), forward and backward: outputs in the inputs' dtype,
    logsumexp in fp32, gradients shaped as the inputs (grouped-query keys' summed back). A masked pair runs
    its tiles whole on CUDA, so nothing is read on the host."""
    used = []
    forward, backward = attention_kernels.forward, attention_kernels.backward
    monkeypatch.setattr(attention_kernels, "forward", lambda kernel, *a: used.append(kernel) or forward(kernel, *a))
    monkeypatch.setattr(attention_kernels, "backward", lambda kernel, *a: used.append(kernel) or backward(kernel, *a))
    q_bounds, k_bounds, kinds = PIECES[pieces]
    with FakeTensorMode():
        q, k, v = _qkv("cuda", dtype, kv_heads=2 if gqa else 8, keys=k_bounds[-1])
        mask = torch.empty(2, 1, 64, k_bounds[-1], device="cuda", dtype=torch.bool) if pieces == "masked" else None
        pairs = list(block_attention._pairs(q, mask, q_bounds, k_bounds, kinds))
        out, lse = block_attention.forward_pairs(q, k, v, pairs, 0.125, False)
        assert (out.shape, out.dtype, out.device.type) == (q.shape, dtype, "cuda")
        assert (lse.shape, lse.dtype) == (q.shape[:-1], torch.float32)
        dq, dk, dv = block_attention.backward_pairs(torch.empty_like(out), q, k, v, out, lse, pairs, 0.125, False)
        assert [(g.shape, g.dtype) for g in (dq, dk, dv)] == [(t.shape, t.dtype) for t in (q, k, v)]
    computed = sum(kind != SKIP for kind in kinds)
    half_unmasked = dtype != torch.float32 and mask is None
    assert used == [CUDA_FLASH if half_unmasked else CUDA_EFFICIENT] * (2 * computed), used


def test_a_cuda_masked_pair_is_cut_into_tiles_without_reading_the_mask():
    """On CUDA a masked pair's tiles are CUDA_TILE_ROWS rows against all its keys, whatever the mask holds (the
    CPU cuts rectangles out of what the mask lets through, reading it on the host)."""
    with FakeTensorMode():
        q, k, _ = _qkv("cuda", torch.bfloat16, rows=1200, keys=1200)
        mask = torch.empty(1, 1, 1200, 1200, device="cuda", dtype=torch.bool)
        pairs = list(block_attention._pairs(q, mask, [0, 1200], [0, 1200], [FULL]))
    tile = block_attention.CUDA_TILE_ROWS
    assert [(r.start, r.stop, c.start, c.stop) for r, c, _, _ in pairs] == [
        (a, min(a + tile, 1200), 0, 1200) for a in range(0, 1200, tile)]


def test_the_table_s_note_names_each_attention_s_kernel_here_and_on_cuda():
    """explain's note on an attention planned on CPU says what its pairs run here and what they would run on CUDA
    (the matmul-softmax named where no kernel applies)."""
    from cp_passes.transports.attention_kernels import describe

    q, k, v = _qkv("cpu", torch.bfloat16, rows=4, keys=4)
    assert describe(q, k, v, masked=False) == "kernel cpu_flash here, cuda_flash on CUDA in bfloat16"
    assert describe(q, k, v, masked=True) == "kernel cpu_flash here, cuda_efficient on CUDA in bfloat16"
    q, k, v = _qkv("cpu", torch.float32, rows=4, keys=4, dk=6, dv=6)
    assert describe(q, k, v, masked=False) == "kernel cpu_flash here, math on CUDA in float32"


def test_explain_s_note_on_a_compiled_attention_names_its_kernels(group):
    """The note reaches the rewrite table of a compiled model: causal SDPA over fp32 grouped-query heads of 16."""
    import cp_passes
    from cp_passes.tools.models import ToyLlama, ToyLlamaConfig

    torch.manual_seed(0)
    compiled = cp_passes.cp_compile(ToyLlama(ToyLlamaConfig()), mesh=group, backend="aot_eager", verbose=False)
    compiled(torch.randint(0, 256, (1, 16)))
    notes = [r.note for r in compiled.compile_records[0].records if r.rule == "sdpa_causal"]
    assert notes and all("kernel cpu_flash here, cuda_efficient on CUDA in float32" in n for n in notes), notes
