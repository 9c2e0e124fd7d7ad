"""Mamba-1's selective scan from an initial state it does not take (``Recurrence(form="selective")``).

The kernel (``mamba_ssm``'s ``selective_scan_fn`` and transformers' copies, ``mamba_selective_scan`` in Mamba,
FalconMamba and Jamba) runs ``s_t = exp(A * dt_t) * s_{t-1} + dt_t * B_t * u_t`` on a state ``[batch, D, N]``
from zeros and returns ``y_t = (C_t . s_t + D * u_t) * silu(z_t)``, ``dt = softplus(delta + delta_bias)``; its
signature has no initial state. The state's decay is elementwise, so from a state ``S0``

- the final state is ``M * S0 + h`` with ``M = exp(A * sum_t dt_t)`` and ``h`` the kernel's final state, and
- the output gains ``(C_t . (exp(A * cumsum(dt)_t) * S0)) * silu(z_t)``.

:func:`from_state` adds both to the kernel's own call (so the recurrence op runs "from a state" as for any other
kernel), :func:`state_map` is ``M`` (the carry gathers ``[h, M]``: twice the state). The kernel's arguments are
read by their place in its signature, ``selective_scan_fn``'s order.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

ROLES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "delta_softplus")
"""``selective_scan_fn``'s first parameters, in order."""

_TILE = 256
"""Positions per tile of the output correction (its ``[batch, D, N, tile]`` decays)."""


def roles(fn, named: dict) -> dict:
    """The kernel's arguments in ``named`` (by parameter name) under their ``selective_scan_fn`` role."""
    params = list(inspect.signature(fn).parameters)[:len(ROLES)]
    return {role: named.get(name) for role, name in zip(ROLES, params)}


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


def from_state(r: dict, out: torch.Tensor, final: torch.Tensor, state: torch.Tensor):
    """The kernel's ``(out, final)`` from zeros turned into those from ``state``."""
    dt, a, c = steps(r), r["A"].float(), r["C"].float()
    if c.dim() != 3:
        raise NotImplementedError(f"form='selective' takes C as [batch, N, seq], got {tuple(c.shape)}")
    cumulative = dt.cumsum(-1)
    s0 = state.float()
    tiles = []
    for lo in range(0, dt.shape[-1], _TILE):
        decay = torch.exp(a[None, :, :, None] * cumulative[:, :, None, lo:lo + _TILE])
        tiles.append(torch.einsum("bdnt,bnt,bdn->bdt", decay, c[..., lo:lo + _TILE], s0))
    extra = torch.cat(tiles, -1) if tiles else dt.new_zeros(dt.shape)
    if r["z"] is not None:
        extra = extra * F.silu(r["z"].float())
    final = final + (state_map(r) * s0).to(final.dtype)
    return out + extra.to(out.dtype), final
