"""Modules that run eagerly, outside the analysed graph: ``cp_passes::eager_module``.

A vision tower sees no text sequence, but its own code may size tensors from data (``torch.split(x,
lengths.tolist())``), which dynamo traces into unbacked sizes and AOT autograd then cannot differentiate
(transformers' Inkling2 and Glm5Next: plain ``torch.compile(fullgraph=True)`` cannot train them either). A
spec's ``eager_modules`` names such modules; :func:`install` replaces each one's ``forward`` with a call of
``cp_passes::eager_module``, which runs the original forward on real tensors. Its fake kernel runs the same
forward on fake tensors with data-dependent sizes allowed, and every output size that depends on data
becomes a fresh unbacked size of the graph; where even fake tensors cannot follow the code, the sizes are
measured once on the real tensors dynamo traced and checked on every later compiled call. Its gradient
(``cp_passes::eager_module_backward``) runs the forward again under ``torch.func.vjp`` with the random state
and the autocast state of the forward, so dropout draws the same masks. The module's parameters and buffers
(every name, tied ones too) are passed to the op, so their gradients flow as any parameter's. A module that
updates its buffers in the forward (BatchNorm's running statistics) is refused: the backward's second run
would update them twice. The replacement stays on the model object; called outside cp_passes, the op
computes what the module does (a copy of the model made afterwards runs its own forward).
"""

from __future__ import annotations

import fnmatch
import types
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch.nn.utils.stateless import _reparametrize_module

from .kernels import decode_options, encode_options

_KEY = "_cp_passes_eager"
"""The attribute that holds an installed module's key in :data:`_MODULES`."""


class _Outputs:
    """How each call's flat outputs form the module's output: an attribute per ``names;options`` (read by
    dynamo at trace time, one source per call signature)."""


@dataclass
class _Entry:
    module: torch.nn.Module
    forward: object
    """The module's own forward (bound)."""
    path: str
    outputs: _Outputs = field(default_factory=_Outputs)


_MODULES: list[_Entry] = []


def module_path(key: int) -> str:
    return _MODULES[key].path


def _run(key: int, names: str, inputs: list, state_names: str, state: list, options: str) -> list[torch.Tensor]:
    entry = _MODULES[key]
    keywords = names.split(",") if names else []
    positional = len(inputs) - len(keywords)
    kwargs = dict(zip(keywords, inputs[positional:]), **decode_options(options))
    mapping = dict(zip(state_names.split(",") if state_names else [], state))
    with _reparametrize_module(entry.module, mapping):
        out = entry.forward(*inputs[:positional], **kwargs)
    leaves, spec = pytree.tree_flatten(out)
    if not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
        kinds = sorted({type(leaf).__name__ for leaf in leaves if not isinstance(leaf, torch.Tensor)})
        raise TypeError(f"the eager module {entry.path!r} returns {kinds} besides tensors; cp_passes passes only "
                        f"tensors out of an eager module")
    known = getattr(entry.outputs, f"{names};{options}", None)
    if known is not None and known != spec:
        raise TypeError(f"the eager module {entry.path!r} returns differently structured outputs for calls with the "
                        f"same keyword arguments ({names or 'none'}); cp_passes cannot tell those calls apart")
    setattr(entry.outputs, f"{names};{options}", spec)
    return leaves


def _cuda(values: list):
    return next((t.device for t in values if t is not None and t.device.type == "cuda"), None)


def _rng_state(values: list) -> torch.Tensor:
    """The CPU random state, and the device's when the module runs on CUDA (one uint8 vector)."""
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        device = _cuda(values)
        return torch.cat([torch.get_rng_state()] + ([torch.cuda.get_rng_state(device)] if device else []))


def _restore_rng(state: torch.Tensor, values: list) -> None:
    cpu = torch.get_rng_state().numel()
    torch.set_rng_state(state[:cpu].clone())
    device = _cuda(values)
    if device is not None:
        torch.cuda.set_rng_state(state[cpu:].clone(), device)


def _autocast() -> str:
    """The autocast state to run the forward again in: ``device=dtype`` for each device type that has it on."""
    return ";".join(f"{d}={str(torch.get_autocast_dtype(d)).removeprefix('torch.')}" for d in ("cpu", "cuda")
                    if torch.is_autocast_enabled(d))


_MEASURED: dict[tuple, list[tuple]] = {}
"""Calls whose output sizes were measured on the real inputs: their :func:`_signature` -> (shape, dtype,
device) of each output."""


def _signature(key: int, names: str, inputs: list, options: str) -> tuple | None:
    """The call's key in :data:`_MEASURED`; None for symbolic input sizes (a sequence-sharded input, which the
    planner refuses)."""
    shapes = tuple(None if t is None else (tuple(t.shape), t.dtype, str(t.device)) for t in inputs)
    if any(not isinstance(s, int) for shape in shapes if shape is not None for s in shape[0]):
        return None
    return key, names, options, shapes, _autocast()


@torch.library.custom_op("cp_passes::eager_module", mutates_args=())
def eager_module_op(key: int, names: str, inputs: list[torch.Tensor | None], state_names: str,
                    state: list[torch.Tensor], options: str, compiled: bool) -> list[torch.Tensor]:
    """Module ``key``'s forward on ``inputs`` (positional, then keyword: ``names``, comma-separated) and
    ``options`` (constant keyword arguments), with ``state`` as its parameters and buffers (``state_names``):
    its output tensors (flattened), then the random state it started from. ``compiled``: the call is in a
    compiled graph, whose sizes it must keep."""
    values = [*inputs, *state]
    rng = _rng_state(values)
    versions = [None if t is None else t._version for t in values]
    with torch.no_grad():
        leaves = _run(key, names, inputs, state_names, state, options)
    changed = [i for i, (t, v) in enumerate(zip(values, versions)) if t is not None and t._version != v]
    if changed:
        state_list = state_names.split(",")
        what = [state_list[i - len(inputs)] if i >= len(inputs) else f"input {i}" for i in changed]
        raise RuntimeError(f"the eager module {module_path(key)!r} updates {what} in place; its backward runs it "
                           f"again, which would update them twice (BatchNorm's running statistics: put it in eval "
                           f"mode, or leave it out of eager_modules)")
    expected = _MEASURED.get(_signature(key, names, inputs, options)) if compiled else None
    got = [(tuple(t.shape), t.dtype, t.device) for t in leaves]
    if expected is not None and [e[:2] for e in expected] != [g[:2] for g in got]:
        raise RuntimeError(
            f"the eager module {module_path(key)!r} returned {[g[:2] for g in got]} where the compiled graph was "
            f"traced with {[e[:2] for e in expected]} for inputs of the same shapes: its sizes depend on the data "
            f"(grid sizes), which the graph cannot follow. Keep the data that sizes it fixed per input shape (the "
            f"same grids), or pass the sizes it derives precomputed")
    return [leaf.clone(memory_format=torch.contiguous_format) for leaf in leaves] + [rng]


def _real(mode, values: list) -> list | None:
    """The real tensors dynamo made the fake ``values`` from (its graph's inputs and parameters), or None when
    one of them was computed in the graph."""
    converter = mode.fake_tensor_converter
    fakes = {id(converter.tensor_memo.get(tid)): real
             for real, tid in converter.meta_converter.describer.lookup_tensor.items()}
    found = [None if v is None else fakes.get(id(v)) for v in values]
    return None if any(f is None and v is not None for f, v in zip(found, values)) else found


@eager_module_op.register_fake
def _(key, names, inputs, state_names, state, options, compiled):
    values = [*inputs, *state]
    mode = torch._guards.detect_fake_mode([t for t in values if t is not None])
    rng = _rng_state(values)
    rng = torch.empty(rng.shape, dtype=rng.dtype)
    measured = _MEASURED.get(_signature(key, names, inputs, options))
    if measured is not None:  # later traces of the same call (the ATen re-trace, AOT autograd)
        return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype, device in measured] + [rng]
    allowed = mode.allow_scalar_outputs
    mode.allow_scalar_outputs = True  # .tolist() of grid sizes: unbacked sizes, as dynamo makes them
    try:
        with mode.shape_env.ignore_fresh_unbacked_symbols(), torch.no_grad():
            leaves = _run(key, names, inputs, state_names, state, options)
    except Exception as error:  # a guard on a data-dependent size, in whatever form the module hits it
        return _measure(key, names, inputs, state_names, state, options, mode, error) + [rng]
    finally:
        mode.allow_scalar_outputs = allowed
    ctx = torch.library.get_ctx()

    def size(s):
        return ctx.new_dynamic_size() if isinstance(s, torch.SymInt) and s.node.expr.free_symbols else s

    return [leaf.new_empty([size(s) for s in leaf.shape]) for leaf in leaves] + [rng]


def _measure(key, names, inputs, state_names, state, options, mode, error) -> list[torch.Tensor]:
    """The outputs of a module whose sizes even fake tensors cannot follow (a branch on a data-dependent
    size): run once on the real inputs; their sizes then hold for this input signature, and the real op
    checks that every later compiled call keeps them."""
    real = _real(mode, [*inputs, *state])
    if real is None:
        raise ValueError(
            f"the eager module {module_path(key)!r} computes its output sizes from data in a way fake tensors "
            f"cannot follow ({type(error).__name__}: {error}), and some of its inputs are computed inside the "
            f"compiled graph, so cp_passes cannot run it on real inputs to measure them; call it on the model's "
            f"own inputs, or pass the sizes it derives precomputed") from error
    with torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.no_grad():
        state_real = [t.clone() for t in real[len(inputs):]]  # a forward that updates buffers updates copies
        measured = [(tuple(t.shape), t.dtype, t.device)
                    for t in _run(key, names, real[:len(inputs)], state_names, state_real, options)]
    signature = _signature(key, names, inputs, options)
    if signature is not None:
        _MEASURED[signature] = measured
    return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype, device in measured]


def _differentiable(values: list) -> list[int]:
    return [i for i, t in enumerate(values) if t is not None and t.is_floating_point()]


@torch.library.custom_op("cp_passes::eager_module_backward", mutates_args=())
def eager_module_backward_op(key: int, names: str, inputs: list[torch.Tensor | None], state_names: str,
                             state: list[torch.Tensor], options: str, rng: torch.Tensor, autocast: str,
                             grads: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """Gradients of :func:`eager_module_op` for its floating inputs, then its floating state: the forward
    run again under ``torch.func.vjp`` from random state ``rng`` and in the forward's ``autocast``
    (``device=dtype;...``); outputs without a gradient count as zero."""
    values = list(inputs) + list(state)
    floating = _differentiable(values)
    differentiated: list[bool] = []  # which outputs are floating (the others have no gradient)

    def run(*primals):
        replaced = list(values)
        for i, x in zip(floating, primals):
            replaced[i] = x
        leaves = _run(key, names, replaced[:len(inputs)], state_names, replaced[len(inputs):], options)
        differentiated[:] = [leaf.is_floating_point() for leaf in leaves]
        return tuple(leaf for leaf in leaves if leaf.is_floating_point())

    device = _cuda(values)
    casts = [torch.autocast(d, getattr(torch, dtype)) for d, dtype in (a.split("=") for a in autocast.split(";") if a)]
    try:
        with torch.random.fork_rng(devices=[device] if device else []):
            _restore_rng(rng, values)
            for cast in casts:
                cast.__enter__()
            try:
                outputs, vjp = torch.func.vjp(run, *[values[i] for i in floating])
            finally:
                for cast in reversed(casts):
                    cast.__exit__(None, None, None)
        floating_grads = [g for g, keep in zip(grads, differentiated) if keep]
        result = vjp(tuple(g if g is not None else torch.zeros_like(o) for g, o in zip(floating_grads, outputs)))
    except RuntimeError as error:
        raise RuntimeError(f"the backward of the eager module {module_path(key)!r} runs it again under "
                           f"torch.func.vjp, which failed: {error}. Gradient checkpointing inside an eager module "
                           f"is not supported (it recomputes anyway): turn it off there") from error
    return [torch.empty_like(values[i]).copy_(g) for i, g in zip(floating, result)]


@eager_module_backward_op.register_fake
def _(key, names, inputs, state_names, state, options, rng, autocast, grads):
    values = list(inputs) + list(state)
    return [torch.empty_like(values[i]) for i in _differentiable(values)]


def _setup(ctx, inputs, output) -> None:
    key, names, args, state_names, state, options, _ = inputs
    ctx.key, ctx.names, ctx.state_names, ctx.options, ctx.autocast = key, names, state_names, options, _autocast()
    ctx.missing = [i for i, t in enumerate(args) if t is None]
    ctx.sizes = (len(args), len(state))
    ctx.floating = [t.is_floating_point() for t in output[:-1]]
    ctx.save_for_backward(*[t for t in args if t is not None], *state, output[-1])


def _backward(ctx, grads):
    saved = list(ctx.saved_tensors)
    rng = saved.pop()
    n_args, n_state = ctx.sizes
    present = iter(saved[:len(saved) - n_state])
    args = [None if i in ctx.missing else next(present) for i in range(n_args)]
    state = saved[len(saved) - n_state:]
    grads = [g if floating else None for g, floating in zip(grads[:-1], ctx.floating)]
    result = torch.ops.cp_passes.eager_module_backward(ctx.key, ctx.names, args, ctx.state_names, state, ctx.options,
                                                        rng, ctx.autocast, grads)
    values = args + state
    full: list = [None] * len(values)
    for i, g in zip(_differentiable(values), result):
        full[i] = g
    return None, None, full[:n_args], None, full[n_args:], None, None


eager_module_op.register_autograd(_backward, setup_context=_setup)


def _forward(self, *args, **kwargs):
    """An installed module's ``forward``: one ``cp_passes::eager_module`` call."""
    key = getattr(self, _KEY)
    entry = _MODULES[key]
    if entry.module is not self:  # a copy of the model made after install: run its own forward
        return type(self).forward(self, *args, **kwargs)
    tensors = {k: v for k, v in kwargs.items() if v is None or isinstance(v, torch.Tensor)}
    constants = {k: v for k, v in kwargs.items() if k not in tensors}
    if not all(a is None or isinstance(a, torch.Tensor) for a in args):
        raise TypeError(f"the eager module {entry.path!r} takes a non-tensor positional argument; pass constants "
                        f"by keyword")
    names = ",".join(tensors)
    options = encode_options(f"the eager module {entry.path!r}", constants)
    named = [*self.named_parameters(remove_duplicate=False), *self.named_buffers(remove_duplicate=False)]
    flat = torch.ops.cp_passes.eager_module(key, names, [*args, *tensors.values()], ",".join(n for n, _ in named),
                                            [t for _, t in named], options, torch.compiler.is_compiling())
    return pytree.tree_unflatten(flat[:-1], getattr(entry.outputs, f"{names};{options}"))


def install(model: torch.nn.Module, globs: tuple[str, ...]) -> list[str]:
    """Replace the ``forward`` of every module of ``model`` whose path matches one of ``globs`` (outermost
    only) with a call of ``cp_passes::eager_module``; return their paths."""
    paths = []
    for path, module in model.named_modules():
        if not any(fnmatch.fnmatchcase(path, g) for g in globs) or any(path.startswith(p + ".") for p in paths):
            continue
        paths.append(path)
        key = getattr(module, _KEY, None)
        if key is not None and _MODULES[key].module is module:  # installed by an earlier cp_compile
            continue
        original = types.MethodType(type(module).forward, module) if key is not None else module.forward
        _MODULES.append(_Entry(module, original, path))
        setattr(module, _KEY, len(_MODULES) - 1)
        module.forward = types.MethodType(_forward, module)
    return paths
