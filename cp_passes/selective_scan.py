"""Mamba-1's selective scan from an initial state it does not take (``Recurrence(form="selective")``).

The kernel (``mamba_ssm``'s ``selective_scan_fn`` and transformers' copies, ``mamba_selective_scan`` in Mamba,
FalconMamba and Jamba) runs ``s_t = exp(A * dt_t) * s_{t-1} + dt_t * B_t * u_t`` on a state ``[batch, D, N]``
from zeros and returns ``y_t = (C_t . s_t + D * u_t) * silu(z_t)``, ``dt = softplus(delta + delta_bias)``; its
signature has no initial state. The state's decay is elementwise, so from a state ``S0``

- the final state is ``M * S0 + h`` with ``M = exp(A * sum_t dt_t)`` and ``h`` the kernel's final state, and
- the output gains ``(C_t . (exp(A * cumsum(dt)_t) * S0)) * silu(z_t)`` (``cp_passes::selective_state_output``,
  a tile of positions at a time).

:func:`from_state` adds both to the kernel's own call (so the recurrence op runs "from a state" as for any other
kernel), :func:`state_map` is ``M`` (the carry gathers ``[h, M]``: twice the state). The kernel's arguments are
read by their place in its signature, ``selective_scan_fn``'s order.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

ROLES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "delta_softplus")
"""``selective_scan_fn``'s first parameters, in order."""

_TILE = 256
"""Positions per tile of the output correction (its ``[batch, D, N, tile]`` decays)."""


@functools.cache
def _role_names(fn) -> tuple[str, ...]:
    """The kernel's first parameter names, one per role (read once: the carry asks on every forward)."""
    return tuple(inspect.signature(fn).parameters)[:len(ROLES)]


def roles(fn, named: dict) -> dict:
    """The kernel's arguments in ``named`` (by parameter name) under their ``selective_scan_fn`` role."""
    return {role: named.get(name) for role, name in zip(ROLES, _role_names(fn))}


def signature_error(fn) -> str | None:
    """Why ``fn`` cannot be a selective scan (too few parameters), or None."""
    params = list(inspect.signature(fn).parameters)
    if len(params) < len(ROLES):
        return (f"form='selective' reads the kernel's parameters in selective_scan_fn's order {ROLES}, but it takes "
                f"only {params}")
    return None


def steps(r: dict) -> torch.Tensor:
    """``dt`` as the kernel uses it, fp32 ``[batch, D, L]``."""
    dt = r["delta"].float()
    if r["delta_bias"] is not None:
        dt = dt + r["delta_bias"].float()[..., None]
    return F.softplus(dt) if r["delta_softplus"] else dt


def state_map(r: dict) -> torch.Tensor:
    """``M``: the final state is ``M * S0 + h`` (fp32 ``[batch, D, N]``)."""
    return torch.exp(r["A"].float()[None] * steps(r).sum(-1)[..., None])


def _tile(c: torch.Tensor, cumulative: torch.Tensor, a: torch.Tensor, s0: torch.Tensor) -> torch.Tensor:
    """``C_t . (exp(A * cumulative_t) * S0)`` for the positions of one tile, ``[batch, D, t]``."""
    return torch.einsum("bdnt,bnt,bdn->bdt", torch.exp(a[None, :, :, None] * cumulative[:, :, None]), c, s0)


@torch.library.custom_op("cp_passes::selective_state_output", mutates_args=())
def state_output(c: torch.Tensor, cumulative: torch.Tensor, a: torch.Tensor, s0: torch.Tensor) -> torch.Tensor:
    """The output's part from the initial state ``s0`` (fp32 ``[batch, D, seq]``), a tile of positions at a time
    (its ``[batch, D, N, tile]`` decays bounded), as one op, so that the graph holds no loop over the length."""
    tiles = [_tile(c[..., lo:lo + _TILE], cumulative[..., lo:lo + _TILE], a, s0)
             for lo in range(0, cumulative.shape[-1], _TILE)]
    return torch.cat(tiles, -1) if tiles else torch.zeros_like(cumulative)


@state_output.register_fake
def _(c, cumulative, a, s0):
    return torch.empty_like(cumulative)


@torch.library.custom_op("cp_passes::selective_state_output_backward", mutates_args=())
def state_output_backward(c: torch.Tensor, cumulative: torch.Tensor, a: torch.Tensor, s0: torch.Tensor,
                          grad: torch.Tensor) -> list[torch.Tensor]:
    """Gradients of :func:`state_output` for its four inputs, a tile at a time (``torch.func.vjp`` of each)."""
    grads = [torch.zeros_like(c), torch.zeros_like(cumulative), torch.zeros_like(a), torch.zeros_like(s0)]
    for lo in range(0, cumulative.shape[-1], _TILE):
        hi = lo + _TILE
        _, vjp = torch.func.vjp(_tile, c[..., lo:hi], cumulative[..., lo:hi], a, s0)
        gc, gcum, ga, gs0 = vjp(grad[..., lo:hi])
        grads[0][..., lo:hi] += gc
        grads[1][..., lo:hi] += gcum
        grads[2] += ga
        grads[3] += gs0
    return grads


@state_output_backward.register_fake
def _(c, cumulative, a, s0, grad):
    return [torch.empty_like(c), torch.empty_like(cumulative), torch.empty_like(a), torch.empty_like(s0)]


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    return tuple(torch.ops.cp_passes.selective_state_output_backward(*ctx.saved_tensors, grad))


state_output.register_autograd(_backward, setup_context=_setup)


def from_state(r: dict, out: torch.Tensor, final: torch.Tensor, state: torch.Tensor):
    """The kernel's ``(out, final)`` from zeros turned into those from ``state``."""
    dt, a, c = steps(r), r["A"].float(), r["C"].float()
    if c.dim() != 3:
        raise NotImplementedError(f"form='selective' takes C as [batch, N, seq], got {tuple(c.shape)}")
    extra = torch.ops.cp_passes.selective_state_output(c.contiguous(), dt.cumsum(-1), a.contiguous(),
                                                        state.float().contiguous())
    if r["z"] is not None:
        extra = extra * F.silu(r["z"].float())
    final = final + (state_map(r) * state.float()).to(final.dtype)
    return out + extra.to(out.dtype), final
