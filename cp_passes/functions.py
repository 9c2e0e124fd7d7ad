"""``torch.autograd.Function`` subclasses named in ``CPSpec.positionwise_functions`` run as one op with their own
backward.

dynamo hands a Function to the backend as ``autograd_function_apply`` with its forward and backward graphs, and
cp_passes' re-trace to ATen keeps the forward only (so such a call is refused). A Function the spec declares
position-wise (each output row reads only the same row of each input: an activation with a hand-written
backward, Bloom's ``GeLUFunction``) is instead called as ``cp_passes::function``: its implementation runs the
Function's forward, its fake runs the same forward on fake tensors, and its gradient
(``cp_passes::function_backward``) runs the Function's own backward. :func:`install` replaces the module
attribute the model reads (``"package.module:Class"``) with an object whose ``apply`` calls the op; the
replacement stays for the process and computes what the Function does.
"""

from __future__ import annotations

import importlib

import torch

_FUNCTIONS: dict[str, type] = {}
"""``"package.module:Class"`` -> the original Function."""


@torch.library.custom_op("cp_passes::function", mutates_args=())
def function_op(name: str, args: list[torch.Tensor]) -> torch.Tensor:
    """The declared Function's forward on ``args``."""
    with torch.no_grad():
        return _FUNCTIONS[name].apply(*args).clone(memory_format=torch.contiguous_format)


@function_op.register_fake
def _(name, args):
    with torch.no_grad():
        out = _FUNCTIONS[name].apply(*args)
    return out.new_empty(out.shape)


@torch.library.custom_op("cp_passes::function_backward", mutates_args=())
def function_backward_op(name: str, args: list[torch.Tensor], grad: torch.Tensor) -> list[torch.Tensor]:
    """The gradients of :func:`function_op` for ``args`` by the Function's own backward (zeros for the
    arguments that take none)."""
    floating = [i for i, a in enumerate(args) if a.is_floating_point()]
    with torch.enable_grad():
        inputs = [a.detach().requires_grad_(i in floating) for i, a in enumerate(args)]
        out = _FUNCTIONS[name].apply(*inputs)
        grads = torch.autograd.grad(out, [inputs[i] for i in floating], grad, allow_unused=True)
    result = [torch.zeros_like(a) for a in args]
    for i, g in zip(floating, grads):
        if g is not None:
            result[i].copy_(g)
    return result


@function_backward_op.register_fake
def _(name, args, grad):
    return [torch.empty_like(a) for a in args]


def _setup(ctx, inputs, output) -> None:
    ctx.name = inputs[0]
    ctx.save_for_backward(*inputs[1])


def _backward(ctx, grad):
    return None, torch.ops.cp_passes.function_backward(ctx.name, list(ctx.saved_tensors), grad)


function_op.register_autograd(_backward, setup_context=_setup)


class _Declared:
    """What the model finds where it reads the Function: ``apply`` runs the op."""

    def __init__(self, name: str, original: type):
        self.cp_passes_function, self.__wrapped__ = name, original

    def apply(self, *args):
        if not all(isinstance(a, torch.Tensor) for a in args):
            raise ValueError(f"cp_passes runs {self.cp_passes_function} as one op, which takes tensors only; it was "
                             f"called with {[type(a).__name__ for a in args]}")
        return torch.ops.cp_passes.function(self.cp_passes_function, list(args))


def install(names: tuple[str, ...]) -> None:
    """Replace each declared Function (``"package.module:Class"``) with a call of ``cp_passes::function``."""
    for name in names:
        module_name, _, attr = name.partition(":")
        module = importlib.import_module(module_name)
        original = getattr(module, attr)
        if getattr(original, "cp_passes_function", None) == name:  # installed by an earlier cp_compile
            original = original.__wrapped__
        if not (isinstance(original, type) and issubclass(original, torch.autograd.Function)):
            raise ValueError(f"CPSpec.positionwise_functions entry {name!r} is {original!r}, not a "
                             f"torch.autograd.Function subclass")
        _FUNCTIONS[name] = original
        setattr(module, attr, _Declared(name, original))


_CHECKED: dict[tuple, float | None] = {}


def split_error(name: str, inputs: list[tuple[list[int], torch.dtype]], dims: list[int | None], out_dim: int):
    """The declared Function on random inputs (``inputs``: each one's shape and dtype; ``dims``: its sequence dim,
    of the same even length in each, None for an input without) against the same inputs cut in two along it: the
    largest difference of the output and of the gradients (a random cotangent; a whole input's halves' gradients
    added) relative to the whole's largest value. None where the Function does not run on such inputs."""
    key = (name, *((str(shape), dtype, d) for (shape, dtype), d in zip(inputs, dims)), out_dim)
    if key in _CHECKED:
        return _CHECKED[key]
    fn = _FUNCTIONS[name]
    length = next(shape[d] for (shape, _), d in zip(inputs, dims) if d is not None)
    generator = torch.Generator().manual_seed(0)
    with torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.enable_grad():
        inputs = [(torch.randn(shape, generator=generator).to(dtype) if dtype.is_floating_point
                   else torch.zeros(shape, dtype=dtype)).requires_grad_(dtype.is_floating_point)
                  for shape, dtype in inputs]
        try:
            whole = fn.apply(*inputs)
            cotangent = torch.randn(whole.shape, generator=generator).to(whole.dtype)
            floating = [x for x in inputs if x.requires_grad]
            grads = torch.autograd.grad(whole, floating, cotangent, allow_unused=True)
            halves, half_grads = [], []
            for lo in (0, length // 2):
                part = [x.detach().narrow(d, lo, length // 2).requires_grad_(x.requires_grad) if d is not None
                        else x.detach().requires_grad_(x.requires_grad) for x, d in zip(inputs, dims)]
                out = fn.apply(*part)
                halves.append(out)
                half_grads.append(torch.autograd.grad(out, [x for x in part if x.requires_grad],
                                                      cotangent.narrow(out_dim, lo, length // 2), allow_unused=True))
        except Exception:
            _CHECKED[key] = None
            return None
        found = _relative(torch.cat(halves, out_dim), whole)
        seq = [d for x, d in zip(inputs, dims) if x.requires_grad]
        for i, (g, d) in enumerate(zip(grads, seq)):
            parts = [h[i] for h in half_grads]
            if g is None or any(p is None for p in parts):
                continue
            found = max(found, _relative(torch.cat(parts, d) if d is not None else parts[0] + parts[1], g))
    _CHECKED[key] = found
    return found


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).detach().abs().max() / want.detach().abs().max().clamp_min(1e-12))
