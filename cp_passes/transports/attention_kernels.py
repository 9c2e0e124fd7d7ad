"""Which fused kernel one attention pair of :mod:`.block_attention` runs, and its forward and backward calls.

One table decides, from the pair's device, dtype, head dims and mask kind (:func:`kernel_for`):

=========  ================  =======================================  ==============  ===========================
device     dtype             shapes                                   mask            kernel
=========  ================  =======================================  ==============  ===========================
cpu        any float         4-D, values as wide as keys              none, boolean   ``cpu_flash``
cuda       fp16, bf16        4-D, K = V <= 256, K % 8 == 0; a causal   none            ``cuda_flash``
                             pair square
cuda       fp16, bf16, fp32  4-D, K and V multiples of 8 (4 in fp32)  none, boolean   ``cuda_efficient``
any        any               anything else, or ``math=True``          any             ``math``
=========  ================  =======================================  ==============  ===========================

``cpu_flash`` is ``aten._scaled_dot_product_flash_attention_for_cpu`` (a mask as an additive bias, grouped-query
heads as they come), ``cuda_flash`` ``aten._scaled_dot_product_flash_attention`` (FlashAttention-2: grouped-query
heads as they come, no mask; PyTorch refuses its causal flag on a non-square pair), ``cuda_efficient``
``aten._scaled_dot_product_efficient_attention`` (an additive bias, its last dim allocated to a multiple of 16 as
the kernel reads it; grouped-query keys and values repeated, their gradients summed back). Each returns the pair's
logsumexp in fp32 (fp64 for fp64 inputs in ``math``), and each backward takes the merged output and logsumexp of
the pair's rows, which is exactly the pair's share of the gradient. ``math`` is :mod:`.block_attention`'s exact
matmul-softmax in blocks of query rows.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten

CPU_FLASH, CUDA_FLASH, CUDA_EFFICIENT, MATH = "cpu_flash", "cuda_flash", "cuda_efficient", "math"
KERNELS = (CPU_FLASH, CUDA_FLASH, CUDA_EFFICIENT, MATH)

_HALF = (torch.float16, torch.bfloat16)
_BIAS_ALIGNMENT = 16
"""The efficient kernel reads an additive bias whose rows start every multiple of 16 elements."""
_LSE_ALIGNMENT = 32
"""The efficient kernel's logsumexp is ``[.., ceil(queries / 32) * 32]``."""


def kernel_for(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: bool, causal: bool,
               math: bool = False, device: str | None = None) -> str:
    """The kernel one pair runs (the module's table): ``q`` ``[.., queries, K]``, ``k`` and ``v`` its keys and
    values, ``masked`` whether a boolean mask comes with it, ``causal`` whether it is a causal triangle; on
    ``device`` (a type, ``"cuda"``) in place of the tensors' own."""
    if math or q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.dtype != k.dtype or k.dtype != v.dtype:
        return MATH
    dk, dv, device = q.shape[-1], v.shape[-1], device or q.device.type
    if device == "cpu":
        return CPU_FLASH if dk == k.shape[-1] == dv else MATH
    if device != "cuda" or q.shape[-3] % k.shape[-3] or k.shape[-3] != v.shape[-3]:
        return MATH
    if (q.dtype in _HALF and not masked and dk == dv <= 256 and dk % 8 == 0
            and (not causal or q.shape[-2] == k.shape[-2])):
        return CUDA_FLASH
    alignment = 8 if q.dtype in _HALF else 4
    if q.dtype in (*_HALF, torch.float32) and dk % alignment == 0 and dv % alignment == 0:
        return CUDA_EFFICIENT
    return MATH


def describe(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: bool) -> str:
    """The table's note on an attention's pairs: the kernel they run on the tensors' device and, planned elsewhere,
    on CUDA (a causal diagonal pair is square, so it runs what the others do)."""
    here = kernel_for(q, k, v, masked, False)
    if q.device.type == "cuda":
        return f"kernel {here}"
    return f"kernel {here} here, {kernel_for(q, k, v, masked, False, device='cuda')} on CUDA in {str(q.dtype)[6:]}"


def repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``x`` ``[.., kv heads, rows, dim]`` with each key/value head repeated for the query heads it serves."""
    return x if x.shape[-3] == heads else x.repeat_interleave(heads // x.shape[-3], dim=-3)


def fold_heads(grad: torch.Tensor, heads: int) -> torch.Tensor:
    """The gradient of :func:`repeat_heads`: the sum over each group of repeated heads."""
    if grad.shape[-3] == heads:
        return grad
    shape = grad.shape
    return grad.reshape(*shape[:-3], heads, shape[-3] // heads, *shape[-2:]).sum(-3)


def bias(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask as the additive bias the CPU kernel takes (0 where True, -inf where False)."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask.logical_not(), float("-inf"))


def _aligned_bias(mask: torch.Tensor | None, q: torch.Tensor, keys: int) -> torch.Tensor | None:
    """The mask as the efficient kernel's bias ``[batch, heads, queries, keys]`` (broadcast where the mask is), its
    rows allocated to a multiple of 16 elements."""
    if mask is None:
        return None
    width = -(-keys // _BIAS_ALIGNMENT) * _BIAS_ALIGNMENT
    full = torch.zeros(*mask.shape[:-1], width, dtype=q.dtype, device=q.device)
    view = full.narrow(-1, 0, keys)
    view.masked_fill_(mask.logical_not(), float("-inf"))
    lead = (1,) * (4 - view.dim()) + tuple(view.shape)
    return view.view(lead).expand(*q.shape[:-2], q.shape[-2], keys)


def _rng(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Random-state arguments for a backward without dropout (which the kernels do not read)."""
    return (torch.zeros(2, dtype=torch.uint64, device=q.device), torch.zeros((), dtype=torch.uint64, device=q.device))


def forward(kernel: str, q, k, v, mask, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(output, fp32 logsumexp)`` of one pair by ``kernel`` (not ``math``). A row the mask lets see no key may
    hold anything: the caller sets its logsumexp to -inf, which weighs it out of the merge."""
    if kernel == CPU_FLASH:
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias(mask, q.dtype),
                                                                scale=scale)
    if kernel == CUDA_FLASH:
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
        return out, lse
    heads = q.shape[-3]
    out, lse = aten._scaled_dot_product_efficient_attention(
        q, repeat_heads(k, heads), repeat_heads(v, heads), _aligned_bias(mask, q, k.shape[-2]), True, 0.0, causal,
        scale=scale)[:2]
    if mask is not None:  # a row that sees no key: its output is weighed out, but must not be NaN
        out = torch.where(mask.any(-1, keepdim=True), out, 0)
    return out, lse.narrow(-1, 0, q.shape[-2])


def backward(kernel: str, grad, q, k, v, mask, out, lse, causal: bool, scale: float):
    """``(dq, dk, dv)`` of one pair by ``kernel`` (not ``math``), given the merged ``out`` and ``lse`` of its rows
    (``lse`` finite: 0 where a row sees nothing anywhere)."""
    if kernel == CPU_FLASH:
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, causal, attn_mask=bias(mask, q.dtype), scale=scale)
    seed, offset = _rng(q)
    if kernel == CUDA_FLASH:
        return aten._scaled_dot_product_flash_attention_backward(
            grad, q, k, v, out, lse.contiguous(), None, None, q.shape[-2], k.shape[-2], 0.0, causal, seed, offset,
            scale=scale)
    heads, rows = k.shape[-3], q.shape[-2]
    padded = torch.cat([lse, lse.new_zeros(*lse.shape[:-1], -rows % _LSE_ALIGNMENT)], -1)
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        grad, q, repeat_heads(k, q.shape[-3]), repeat_heads(v, q.shape[-3]), _aligned_bias(mask, q, k.shape[-2]),
        out, padded, seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
    return dq, fold_heads(dk, heads), fold_heads(dv, heads)
