"""Modules that run eagerly, outside the analysed graph: ``cp_passes::eager_module``.

A vision tower sees no text sequence, but its own code may size tensors from data (``torch.split(x,
lengths.tolist())``), which dynamo traces into unbacked sizes and AOT autograd then cannot differentiate
(transformers' Inkling2 and Glm5Next: plain ``torch.compile(fullgraph=True)`` cannot train them either). A
spec's ``eager_modules`` names such modules; :func:`install` replaces each one's ``forward`` with a call of
``cp_passes::eager_module``, which runs the original forward on real tensors. Its fake kernel runs the same
forward on fake tensors with data-dependent sizes allowed, and every output size that depends on data
becomes a fresh unbacked size of the graph. Its gradient (``cp_passes::eager_module_backward``) runs the
forward again under ``torch.func.vjp`` from the random state the forward started from, so dropout draws
the same masks. The module's parameters and buffers are passed to the op, so their gradients flow as any
parameter's. The replacement stays on the model object; called outside cp_passes, the op computes what the
module does.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch.nn.utils.stateless import _reparametrize_module

from .kernels import decode_options, encode_options


@dataclass
class _Entry:
    module: torch.nn.Module
    forward: object
    """The module's own forward (bound)."""
    path: str
    state_names: tuple[str, ...]
    """Its parameters' then buffers' names, in the order the op receives them."""


_MODULES: list[_Entry] = []
_OUTPUTS: dict[tuple, pytree.TreeSpec] = {}
"""``(key, keyword names, options)`` -> how the op's flat outputs form the module's output."""


def _run(key: int, names: str, inputs: list, state: list, options: str) -> list[torch.Tensor]:
    entry = _MODULES[key]
    keywords = names.split(",") if names else []
    positional = len(inputs) - len(keywords)
    kwargs = dict(zip(keywords, inputs[positional:]), **decode_options(options))
    with _reparametrize_module(entry.module, dict(zip(entry.state_names, state))):
        out = entry.forward(*inputs[:positional], **kwargs)
    leaves, spec = pytree.tree_flatten(out)
    if not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
        kinds = sorted({type(leaf).__name__ for leaf in leaves if not isinstance(leaf, torch.Tensor)})
        raise TypeError(f"the eager module {entry.path!r} returns {kinds} besides tensors; cp_passes passes only "
                        f"tensors out of an eager module")
    _OUTPUTS[(key, names, options)] = spec
    return leaves


def _rng_state(like: list) -> torch.Tensor:
    """The CPU random state, and the device's when the module runs on CUDA (one uint8 vector)."""
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        states = [torch.get_rng_state()]
        device = next((t.device for t in like if t is not None and t.device.type == "cuda"), None)
        if device is not None:
            states.append(torch.cuda.get_rng_state(device))
        return torch.cat(states)


def _restore_rng(state: torch.Tensor, like: list) -> None:
    cpu = torch.get_rng_state().numel()
    torch.set_rng_state(state[:cpu].clone())
    device = next((t.device for t in like if t is not None and t.device.type == "cuda"), None)
    if device is not None:
        torch.cuda.set_rng_state(state[cpu:].clone(), device)


@torch.library.custom_op("cp_passes::eager_module", mutates_args=())
def eager_module_op(key: int, names: str, inputs: list[torch.Tensor | None], state: list[torch.Tensor],
                    options: str) -> list[torch.Tensor]:
    """Module ``key``'s forward on ``inputs`` (positional, then keyword: ``names``, comma-separated) and ``options`` (constant
    keyword arguments), with ``state`` as its parameters and buffers: its output tensors (flattened), then the
    random state it started from."""
    rng = _rng_state(inputs)
    with torch.no_grad():
        leaves = _run(key, names, inputs, state, options)
    expected = _MEASURED.get(_signature(key, names, inputs, options))
    if expected is not None and [shape for shape, _ in expected] != [tuple(t.shape) for t in leaves]:
        raise RuntimeError(
            f"the eager module {_MODULES[key].path!r} returned sizes {[tuple(t.shape) for t in leaves]} where the "
            f"compiled graph was traced with {[shape for shape, _ in expected]} for inputs of the same shapes: its sizes depend on the "
            f"data (grid sizes), which the graph cannot follow. Keep the data that sizes it fixed per input "
            f"shape (the same grids), or pass the sizes it derives precomputed")
    return [leaf.clone(memory_format=torch.contiguous_format) for leaf in leaves] + [rng]


_MEASURED: dict[tuple, list[tuple[int, ...]]] = {}
"""Calls whose output sizes were measured on the real inputs: (key, names, options, input shapes) -> (shape,
dtype) of each output."""


def _signature(key: int, names: str, inputs: list, options: str) -> tuple | None:
    """The call's key in :data:`_MEASURED`; None for symbolic input sizes (a sequence-sharded input, which
    the planner refuses)."""
    shapes = tuple(None if t is None else tuple(t.shape) for t in inputs)
    if any(not isinstance(s, int) for shape in shapes if shape is not None for s in shape):
        return None
    return key, names, options, shapes


def _real(mode, values: list) -> list | None:
    """The real tensors dynamo made the fake ``values`` from (its graph's inputs and parameters), or None when
    one of them was computed in the graph."""
    converter = mode.fake_tensor_converter
    fakes = {id(converter.tensor_memo.get(tid)): real
             for real, tid in converter.meta_converter.describer.lookup_tensor.items()}
    found = [None if v is None else fakes.get(id(v)) for v in values]
    return None if any(f is None and v is not None for f, v in zip(found, values)) else found


@eager_module_op.register_fake
def _(key, names, inputs, state, options):
    mode = torch._guards.detect_fake_mode([t for t in (*inputs, *state) if t is not None])
    measured = _MEASURED.get(_signature(key, names, inputs, options))
    rng = _rng_state(inputs)
    if measured is not None:  # later traces of the same call (the ATen re-trace, AOT autograd)
        return [inputs[0].new_empty(shape, dtype=dtype) for shape, dtype in measured] + [
            torch.empty(rng.shape, dtype=rng.dtype)]
    allowed = mode.allow_scalar_outputs
    mode.allow_scalar_outputs = True  # .tolist() of grid sizes: unbacked sizes, as dynamo makes them
    try:
        with mode.shape_env.ignore_fresh_unbacked_symbols(), torch.no_grad():
            leaves = _run(key, names, inputs, state, options)
    except Exception as error:  # a guard on a data-dependent size, in whatever form the module hits it
        leaves = _measure(key, names, inputs, state, options, mode, error)
    finally:
        mode.allow_scalar_outputs = allowed
    ctx = torch.library.get_ctx()

    def size(s):
        return ctx.new_dynamic_size() if isinstance(s, torch.SymInt) and s.node.expr.free_symbols else s

    return ([leaf.new_empty([size(s) for s in leaf.shape]) for leaf in leaves]
            + [torch.empty(rng.shape, dtype=rng.dtype)])


def _measure(key, names, inputs, state, options, mode, error) -> list[torch.Tensor]:
    """The outputs of a module whose sizes even fake tensors cannot follow (a branch on a data-dependent
    size): run once on the real inputs; their sizes then hold for this input signature, and the real op
    checks that every later call keeps them."""
    path = _MODULES[key].path
    real = _real(mode, [*inputs, *state])
    if real is None:
        raise ValueError(
            f"the eager module {path!r} computes its output sizes from data in a way fake tensors cannot follow "
            f"({type(error).__name__}), and some of its inputs are computed inside the compiled graph, so "
            f"cp_passes cannot run it on real inputs to measure them; call it on the model's own inputs, or "
            f"pass the sizes it derives precomputed") from error
    with torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.no_grad():
        measured = _run(key, names, real[:len(inputs)], real[len(inputs):], options)
    signature = _signature(key, names, inputs, options)
    if signature is not None:
        _MEASURED[signature] = [(tuple(t.shape), t.dtype) for t in measured]
    return [inputs[0].new_empty(t.shape, dtype=t.dtype) for t in measured]


def _differentiable(values: list) -> list[int]:
    return [i for i, t in enumerate(values) if t is not None and t.is_floating_point()]


@torch.library.custom_op("cp_passes::eager_module_backward", mutates_args=())
def eager_module_backward_op(key: int, names: str, inputs: list[torch.Tensor | None],
                             state: list[torch.Tensor], options: str, rng: torch.Tensor,
                             grads: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """Gradients of :func:`eager_module_op` for its floating inputs, then its floating state: the forward
    run again under ``torch.func.vjp`` from random state ``rng`` (outputs without a gradient count as zero)."""
    values = list(inputs) + list(state)
    floating = _differentiable(values)

    def run(*primals):
        replaced = list(values)
        for i, x in zip(floating, primals):
            replaced[i] = x
        return tuple(_run(key, names, replaced[:len(inputs)], replaced[len(inputs):], options))

    with torch.random.fork_rng(devices=[t.device for t in values if t is not None and t.device.type == "cuda"][:1]):
        _restore_rng(rng, values)
        outputs, vjp = torch.func.vjp(run, *[values[i] for i in floating])
    cotangents = tuple(g if g is not None else torch.zeros_like(o) for g, o in zip(grads, outputs))
    return [torch.empty_like(values[i]).copy_(g) for i, g in zip(floating, vjp(cotangents))]


@eager_module_backward_op.register_fake
def _(key, names, inputs, state, options, rng, grads):
    values = list(inputs) + list(state)
    return [torch.empty_like(values[i]) for i in _differentiable(values)]


def _setup(ctx, inputs, output) -> None:
    key, names, args, state, options = inputs
    ctx.key, ctx.names, ctx.options = key, names, options
    ctx.missing = [i for i, t in enumerate(args) if t is None]
    ctx.sizes = (len(args), len(state))
    ctx.save_for_backward(*[t for t in args if t is not None], *state, output[-1])


def _backward(ctx, grads):
    saved = list(ctx.saved_tensors)
    rng = saved.pop()
    n_args, n_state = ctx.sizes
    present = iter(saved[:len(saved) - n_state])
    args = [None if i in ctx.missing else next(present) for i in range(n_args)]
    state = saved[len(saved) - n_state:]
    result = torch.ops.cp_passes.eager_module_backward(ctx.key, ctx.names, args, state, ctx.options, rng,
                                                        list(grads[:-1]))
    values = args + state
    full: list = [None] * len(values)
    for i, g in zip(_differentiable(values), result):
        full[i] = g
    return None, None, full[:n_args], full[n_args:], None


eager_module_op.register_autograd(_backward, setup_context=_setup)


def _wrapper(key: int):
    entry = _MODULES[key]

    def forward(*args, **kwargs):
        tensors = {k: v for k, v in kwargs.items() if v is None or isinstance(v, torch.Tensor)}
        constants = {k: v for k, v in kwargs.items() if k not in tensors}
        if not all(a is None or isinstance(a, torch.Tensor) for a in args):
            raise TypeError(f"the eager module {entry.path!r} takes a non-tensor positional argument; pass constants "
                            f"by keyword")
        names = ",".join(tensors)
        options = encode_options(entry.path, constants)
        state = [t for _, t in entry.module.named_parameters()] + [t for _, t in entry.module.named_buffers()]
        flat = torch.ops.cp_passes.eager_module(key, names, [*args, *tensors.values()], state, options)
        return pytree.tree_unflatten(flat[:-1], _OUTPUTS[(key, names, options)])

    forward.cp_passes_eager = key
    return forward


def module_path(key: int) -> str:
    return _MODULES[key].path


def install(model: torch.nn.Module, globs: tuple[str, ...]) -> list[str]:
    """Replace the ``forward`` of every module of ``model`` whose path matches one of ``globs`` (outermost
    only) with a call of ``cp_passes::eager_module``; return their paths."""
    paths = []
    for path, module in model.named_modules():
        if not any(fnmatch.fnmatchcase(path, g) for g in globs) or any(path.startswith(p + ".") for p in paths):
            continue
        paths.append(path)
        if getattr(module.forward, "cp_passes_eager", None) is not None:  # installed by an earlier cp_compile
            continue
        names = tuple(n for n, _ in module.named_parameters()) + tuple(n for n, _ in module.named_buffers())
        _MODULES.append(_Entry(module, module.forward, path, names))
        module.forward = _wrapper(len(_MODULES) - 1)
    return paths
