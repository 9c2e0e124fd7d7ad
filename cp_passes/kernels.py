"""Recurrent kernels as one op: ``cp_passes::recurrence``, so dynamo never traces their loop.

A model calls a recurrent kernel (a chunked linear-attention scan, Kimi Delta Attention, an SSM) as a
Python function that loops over chunks of the sequence: traced, the loop pins the length. A
:class:`~cp_passes.spec.Recurrence` in the spec names the function by the module attribute the model
reads; :func:`install` replaces that attribute with a wrapper that calls ``cp_passes::recurrence``, whose
implementation calls the original (with whatever it dispatches to: transformers' hub kernels on GPU). The
op always asks the kernel for its final state, and its fake kernel reads output and state shapes from one
call of the real kernel at sequence length 1. Its gradient reruns the kernel under ``torch.func.vjp``
(``cp_passes::recurrence_backward``). The carry transport then makes the state flow across ranks. A kernel
that takes packed documents' boundaries (``Recurrence.documents``, ``cu_seqlens``) gets the whole
sequence's from the model; the op cuts them to the segments of the positions it holds (from ``offset``,
which the transport sets) and passes the carried state to the first segment only, unless a document starts
there. The replacement stays for the process: called outside cp_passes, the op computes what the kernel
does.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import math

import torch

from . import selective_scan
from .errors import CPCompileError

_PACKING = ("cu_seqlens", "seq_idx")
"""Arguments that split a call into documents (flash-linear-attention's names)."""

_KERNELS: dict[str, tuple[object, object]] = {}
"""``Recurrence.kernel`` -> (the original function, its :class:`~cp_passes.spec.Recurrence`)."""


def _literal(value) -> str | None:
    """``value`` as text that :func:`decode_options` reads back, or None for anything but a plain constant (a
    bool, int, float (infinite too), short string or a tuple of them)."""
    if isinstance(value, (bool, int)) or value is None:
        return repr(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("-1e999" if value < 0 else "1e999") if value == value else None
    if isinstance(value, str):
        return None if set(value) & set(";=\\'\"") else repr(value)
    if isinstance(value, tuple):
        parts = [_literal(v) for v in value]
        return None if None in parts else "(" + "".join(p + "," for p in parts) + ")"
    return None


def encode_options(what: str, options: dict, hint: str = "") -> str:
    """Constant arguments of an op-wrapped call (``what``) as op-schema text (``name=literal;...``; dynamo traces
    f-strings); ValueError for anything but plain constants, with ``hint``."""
    text = []
    for name, value in sorted(options.items()):
        literal = _literal(value)
        if literal is None:
            raise ValueError(f"cp_passes passes only plain constants to {what}, and its argument {name!r} is "
                             f"{value!r}{hint}")
        text.append(f"{name}={literal}")
    return ";".join(text)


def decode_options(options: str) -> dict:
    return {name: ast.literal_eval(value) for name, value in (o.split("=", 1) for o in options.split(";") if o)}


_CONSTANTS_HINT = ("; a tensor argument must be declared among the Recurrence's sequence_args if it carries the "
                   "sequence, or its tensor_args if not (a parameter such as Mamba-2's A, D, dt_bias)")

_TENSORS = "_tensors"
"""The option naming the tensor arguments (``Recurrence.tensor_args``) a call passes after its sequence ones."""


def _segments(documents: torch.Tensor, offset: int, length: int) -> tuple[torch.Tensor, bool]:
    """This shard's document boundaries (``cu_seqlens`` of its ``length`` positions from global position
    ``offset``; positions past the last document form one more segment) and whether a document starts at
    its first position (the carried state is then not used)."""
    inner = documents - offset
    inner = inner[(inner > 0) & (inner < length)]
    local = torch.cat([inner.new_zeros(1), inner, inner.new_full((1,), length)])
    starts = bool((documents == offset).any()) or offset >= int(documents[-1])
    return local, starts


def _arguments(kernel: str, args: list[torch.Tensor], options: str) -> tuple[list[torch.Tensor], dict]:
    """The op's ``args`` and ``options`` as the kernel takes them: its sequence arguments, and its other arguments
    by name."""
    _, rec = _KERNELS[kernel]
    kwargs = decode_options(options)
    tensors = [t for t in kwargs.pop(_TENSORS, "").split(",") if t]
    sequence, rest = args[:len(rec.sequence_args)], args[len(rec.sequence_args):]
    kwargs.update(zip(tensors, rest))
    return sequence, kwargs


def selective_roles(kernel: str, args: list[torch.Tensor], options: str) -> dict:
    """A ``form="selective"`` kernel's arguments under their ``selective_scan_fn`` roles."""
    fn, rec = _KERNELS[kernel]
    sequence, kwargs = _arguments(kernel, args, options)
    return selective_scan.roles(fn, {**dict(zip(rec.sequence_args, sequence)), **kwargs})


def _call(kernel: str, args: list[torch.Tensor], initial_state, options: str, documents=None, offset: int = 0):
    fn, rec = _KERNELS[kernel]
    sequence, kwargs = _arguments(kernel, args, options)
    if rec.output_final_state is not None:
        kwargs[rec.output_final_state] = True
    if documents is not None:
        local, starts = _segments(documents, offset, sequence[0].shape[rec.seq_dim])
        kwargs[rec.documents] = local
        if initial_state is not None:  # one state per segment: the carried one (or zeros) first
            first = initial_state * 0 if starts else initial_state
            initial_state = torch.cat([first, first.new_zeros(len(local) - 2, *first.shape[1:])])
    if rec.initial_state is not None:
        kwargs[rec.initial_state] = initial_state
    instance = (None,) if is_method(kernel) else ()  # a method computes from its arguments alone
    try:
        if _leading(rec, fn):  # by position: a hub kernel (flash-linear-attention's chunk_kda) names them q, k, v
            out = fn(*instance, *sequence, **kwargs)
        else:
            out = fn(*instance, **dict(zip(rec.sequence_args, sequence)), **kwargs)
    except AttributeError as error:
        if instance and "'NoneType' object has no attribute" in str(error):
            raise CPCompileError(
                f"the recurrent kernel {kernel} is a method that reads its instance ({error}): cp_passes runs a "
                f"declared method without it, from its arguments alone. Fix: pass what it reads from self as "
                f"arguments (a staticmethod), declare the function it calls, or keep it outside the compiled "
                f"module") from error
        raise
    out, final = out[0], (out[1] if documents is None else out[1][-1:])  # the last segment's state goes on
    if rec.form == "selective" and initial_state is not None:  # the kernel takes no state: add its part
        return selective_scan.from_state(selective_roles(kernel, args, options), out, final, initial_state)
    return out, final


def is_method(kernel: str) -> bool:
    """Whether ``kernel`` names a method (``module:Class.method``)."""
    return "." in kernel.partition(":")[2]


def _parameters(kernel: str, fn) -> list[str]:
    """The kernel's parameter names, a method's instance left out."""
    params = list(inspect.signature(fn).parameters)
    return params[1:] if is_method(kernel) else params


@functools.cache
def _leading(rec, fn) -> bool:
    """Whether the sequence arguments are the kernel's first parameters, in order (read once per kernel: the op
    runs it on every forward and backward)."""
    return _parameters(rec.kernel, fn)[:len(rec.sequence_args)] == list(rec.sequence_args)


@torch.library.custom_op("cp_passes::recurrence", mutates_args=())
def recurrence_op(kernel: str, args: list[torch.Tensor], initial_state: torch.Tensor | None,
                  options: str, documents: torch.Tensor | None, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The declared kernel on ``args`` (its sequence arguments, in the spec's order) from ``initial_state``
    (None: the kernel's own zeros): ``(output, final state)``. With ``documents`` (the whole sequence's
    ``cu_seqlens``) the kernel runs on the segments of positions ``offset ..`` (the final state: the last
    segment's)."""
    out, state = _call(kernel, args, initial_state, options, documents, offset)
    # Fresh contiguous tensors: never a view of an input, and the strides the fake kernel promises.
    return out.clone(memory_format=torch.contiguous_format), state.clone(memory_format=torch.contiguous_format)


_SHAPES: dict[tuple, tuple] = {}


def _tiny(rec, args, extra: int = 0) -> list[torch.Tensor]:
    """Zeros shaped as ``args`` with one position (the sequence arguments), the value ``extra`` columns wider."""
    value = rec.sequence_args.index(rec.value_arg) if rec.value_arg in rec.sequence_args else -1
    tiny = []
    for i, a in enumerate(args):
        shape = [1 if i < len(rec.sequence_args) and d == rec.seq_dim else int(s) for d, s in enumerate(a.shape)]
        if i == value:
            shape[-1] += extra
        tiny.append(torch.zeros(shape, dtype=a.dtype, device=a.device))
    return tiny


def _shapes(kernel: str, args, initial_state, options: str) -> tuple:
    """``((output shape, dtype), (state shape, dtype), value axis)`` of the real kernel at sequence length 1
    (concrete and tiny), to shape the fake, cached by the other dims. The value axis is the state's axis that
    grows with ``value_arg``'s last dim (None if none does)."""
    _, rec = _KERNELS[kernel]
    n = len(rec.sequence_args)
    key = (kernel, options, *((str(tuple(a.shape[:rec.seq_dim] + a.shape[rec.seq_dim + 1:])) if i < n
                               else str(tuple(a.shape)), a.dtype, a.device) for i, a in enumerate(args)),
           None if initial_state is None else (str(tuple(initial_state.shape)), initial_state.dtype))
    if key not in _SHAPES:
        with torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.no_grad():
            state = None if initial_state is None else torch.zeros(
                [int(s) for s in initial_state.shape], dtype=initial_state.dtype, device=initial_state.device)
            out, final = _call(kernel, _tiny(rec, args), state, options)
            value_axis = None
            if rec.form == "affine" and state is None:
                try:
                    _, wider = _call(kernel, _tiny(rec, args, extra=1), None, options)
                except Exception as error:
                    raise CPCompileError(
                        f"Recurrence {kernel}: value_arg={rec.value_arg!r} must name the sequence argument whose "
                        f"last dim is the state's V (the one the state widens with), but the kernel fails with that "
                        f"argument one column wider ({type(error).__name__}: {str(error).splitlines()[0]}); name "
                        f"the value among sequence_args={rec.sequence_args}") from error
                grown = [d - final.dim() for d in range(final.dim()) if wider.shape[d] == final.shape[d] + 1]
                value_axis = grown[0] if len(grown) == 1 and wider.dim() == final.dim() else None
        _SHAPES[key] = ((tuple(out.shape), out.dtype), (tuple(final.shape), final.dtype), value_axis)
    return _SHAPES[key]


def value_axis(kernel: str, args, options: str) -> int | None:
    """The axis (-1 or -2, or another negative dim) of the state that the kernel's value widens, read from
    the kernel at one position (:func:`_shapes`); None when no single axis does."""
    return _shapes(kernel, args, None, options)[2]


@recurrence_op.register_fake
def _(kernel, args, initial_state, options, documents, offset):
    (out, out_dtype), (state, state_dtype), _ = _shapes(kernel, args, initial_state, options)
    _, rec = _KERNELS[kernel]
    length = args[0].shape[rec.seq_dim]
    shape = [length if d == rec.seq_dim else s for d, s in enumerate(out)]
    return args[0].new_empty(shape, dtype=out_dtype), args[0].new_empty(state, dtype=state_dtype)


@torch.library.custom_op("cp_passes::recurrence_backward", mutates_args=())
def recurrence_backward_op(kernel: str, args: list[torch.Tensor], initial_state: torch.Tensor | None, options: str,
                           documents: torch.Tensor | None, offset: int, grad_out: torch.Tensor,
                           grad_state: torch.Tensor) -> list[torch.Tensor]:
    """Gradients of :func:`recurrence_op` for ``args`` and then ``initial_state`` (zeros when it is None),
    by running the kernel again under ``torch.func.vjp`` (a custom op runs below autograd; functorch's
    transform works there)."""
    floating = [i for i, a in enumerate(args) if a.is_floating_point()]

    def run(*primals):
        inputs = list(args)
        for i, x in zip(floating, primals):
            inputs[i] = x
        return _call(kernel, inputs, primals[len(floating)] if initial_state is not None else None, options,
                     documents, offset)

    primals = [args[i] for i in floating] + ([initial_state] if initial_state is not None else [])
    _, vjp = torch.func.vjp(run, *primals)
    grads = list(vjp((grad_out, grad_state)))
    result = [torch.zeros_like(a) for a in args]  # the inputs' strides, as the fake kernel promises
    for i, g in zip(floating, grads):
        result[i].copy_(g)
    result.append(torch.zeros_like(grad_state) if initial_state is None
                  else torch.empty_like(initial_state).copy_(grads[len(floating)]))
    return result


@recurrence_backward_op.register_fake
def _(kernel, args, initial_state, options, documents, offset, grad_out, grad_state):
    return [torch.empty_like(a) for a in args] + [torch.empty_like(grad_state if initial_state is None
                                                                   else initial_state)]


def _setup(ctx, inputs, output) -> None:
    kernel, args, initial_state, options, documents, offset = inputs
    ctx.kernel, ctx.options, ctx.offset = kernel, options, offset
    ctx.has_state, ctx.has_documents = initial_state is not None, documents is not None
    ctx.save_for_backward(*args, *([initial_state] if initial_state is not None else []),
                          *([documents] if documents is not None else []))


def _backward(ctx, grad_out, grad_state):
    saved = list(ctx.saved_tensors)
    documents = saved.pop() if ctx.has_documents else None
    initial_state = saved.pop() if ctx.has_state else None
    grads = torch.ops.cp_passes.recurrence_backward(ctx.kernel, saved, initial_state, ctx.options, documents,
                                                    ctx.offset, grad_out, grad_state)
    return None, grads[:-1], grads[-1] if ctx.has_state else None, None, None, None


recurrence_op.register_autograd(_backward, setup_context=_setup)


def resolve(kernel: str):
    """``(owner, attribute, function)``: the module (or, for a method, the class) whose attribute the model reads."""
    module_name, _, path = kernel.partition(":")
    owner = importlib.import_module(module_name)
    *classes, attr = path.split(".")
    for name in classes:
        owner = getattr(owner, name)
    return owner, attr, getattr(owner, attr)


def install(recurrences) -> None:
    """Replace each declared kernel (``module:attribute``) with a call of ``cp_passes::recurrence``."""
    for rec in recurrences:
        module, attr, fn = resolve(rec.kernel)
        if getattr(fn, "cp_passes_recurrence", None) == rec.kernel:  # installed by an earlier cp_compile
            fn = fn.__wrapped__
        _check(rec, fn)
        _KERNELS[rec.kernel] = (fn, rec)
        setattr(module, attr, _wrapper(rec, fn))


def _check(rec, fn) -> None:
    """The declaration must name the kernel's own parameters: its sequence and tensor arguments, and its
    initial-state and final-state parameters."""
    params = _parameters(rec.kernel, fn)
    for field in ("sequence_args", "tensor_args"):
        missing = [a for a in getattr(rec, field) if a not in params]
        if missing:
            raise ValueError(f"Recurrence {rec.kernel}: {field} {missing} are not parameters of the kernel; it "
                             f"takes {params}")
    if rec.form == "selective" and selective_scan.signature_error(fn):
        raise ValueError(f"Recurrence {rec.kernel}: {selective_scan.signature_error(fn)}")
    for field in (*(("initial_state",) if rec.initial_state else ()),
                  *(("output_final_state",) if rec.output_final_state else ()),
                  *(("documents",) if rec.documents else ())):
        if getattr(rec, field) not in params:
            raise ValueError(f"Recurrence {rec.kernel}: {field}={getattr(rec, field)!r} is not a parameter of the "
                             f"kernel ({params})")


def _has_sequence(rec, tensor: torch.Tensor, first: torch.Tensor) -> bool:
    """Whether ``tensor`` has the length of ``first`` (a sequence argument) on ``seq_dim``: the same symbol under
    dynamo (compared as expressions, so that no guard is added on the length), the same number in eager."""
    dim = rec.seq_dim
    if tensor.dim() <= dim or first.dim() <= dim:
        return False
    a, b = tensor.shape[dim], first.shape[dim]
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt) and a.node.expr == b.node.expr
    return a == b


def _undeclared(rec, name: str, tensor: torch.Tensor, first: torch.Tensor) -> str:
    """The refusal of a call that passes ``name``, a tensor its Recurrence does not declare, and where it belongs:
    among the sequence arguments when it has the first one's length on ``seq_dim``, else among the whole ones."""
    dim = rec.seq_dim
    where = (f"sequence_args (it has the sequence's length on seq_dim={dim}, as {rec.sequence_args[0]!r} does)"
             if _has_sequence(rec, tensor, first) else "tensor_args (a tensor every rank passes whole, such as "
             "Mamba-2's A)")
    return (f"the recurrent kernel {rec.kernel} was called with the tensor {name!r} {tuple(tensor.shape)}, which its "
            f"Recurrence declares in neither sequence_args={rec.sequence_args} nor tensor_args={rec.tensor_args}: "
            f"add it to {where}")


def _wrapper(rec, fn):
    signature = inspect.signature(fn)
    named = set(_parameters(rec.kernel, fn)) - {rec.initial_state, rec.output_final_state, rec.documents,
                                                 *rec.sequence_args, *rec.tensor_args}
    positional = [p.name for p in signature.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    method = is_method(rec.kernel)

    def call(*args, **kwargs):
        bound = dict(zip(positional, args), **kwargs)
        if method:
            bound.pop(positional[0], None)  # the instance: the kernel computes from its arguments alone
        packed = [k for k in _PACKING if k != rec.documents and bound.get(k) is not None]
        if packed:
            raise ValueError(f"the recurrent kernel {rec.kernel} was called with {packed[0]} (packed documents), "
                             f"which its Recurrence does not declare: declare documents={packed[0]!r} if the kernel "
                             f"takes cu_seqlens-style boundaries (per-token document indices are not supported)")
        documents = bound.get(rec.documents) if rec.documents else None
        if documents is not None and (bound.get(rec.initial_state) is not None or bound.get(rec.output_final_state)):
            # One state per document in or out (generation with a cache): the op carries one. Run the kernel
            # itself; under cp_compile its loop then pins the length, which is refused naming the line.
            return fn(*args, **kwargs)
        tensors = [a for a in rec.tensor_args if bound.get(a) is not None]
        first = bound[rec.sequence_args[0]]
        carrying = next((a for a in tensors if _has_sequence(rec, bound[a], first)), None)
        if carrying is not None:
            raise ValueError(f"the recurrent kernel {rec.kernel} was called with {carrying!r} "
                             f"{tuple(bound[carrying].shape)}, which its Recurrence declares in tensor_args (passed "
                             f"whole to every rank), but it has the sequence's length on seq_dim={rec.seq_dim}, as "
                             f"{rec.sequence_args[0]!r} does: move it to sequence_args")
        options = {k: v for k, v in bound.items() if k in named and v is not None}
        undeclared = next((k for k, v in options.items() if isinstance(v, torch.Tensor)), None)
        if undeclared is not None:
            raise ValueError(_undeclared(rec, undeclared, options[undeclared], first))
        if tensors:
            options[_TENSORS] = ",".join(tensors)
        out, state = torch.ops.cp_passes.recurrence(
            rec.kernel, [bound[a] for a in rec.sequence_args] + [bound[a] for a in tensors],
            bound.get(rec.initial_state),
            encode_options(f"the recurrent kernel {rec.kernel}", options, _CONSTANTS_HINT), documents, 0)
        if rec.output_final_state is None or bound.get(rec.output_final_state):
            return out, state
        return out if rec.output_alone else (out, None)

    call.cp_passes_recurrence = rec.kernel
    call.__wrapped__ = fn
    return call
