"""The per-model spec: what cp_passes cannot read from the graph itself.

Specs are frozen dataclasses. A model family's spec lives in ``model_specs/<name>.py`` as a
module-level ``SPEC`` and is loaded with :func:`load_spec`. ``CPSpec()`` (the default) serves a
plain causal LM: every tensor input whose ``seq_dim`` has the sequence length is sharded, and
attention semantics are read from the attention op itself (``is_causal``).
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import importlib
import importlib.util
import os
import re
from dataclasses import dataclass

from .layout import AUTO, KINDS

LAYOUTS = (AUTO,) + KINDS


def _check_names(field: str, value) -> None:
    if value is None:
        return
    if isinstance(value, str) or not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"CPSpec.{field} must be a tuple of non-empty strings, got {value!r}")


@dataclass(frozen=True)
class AttentionRule:
    """What the attention in modules matching ``modules`` (a glob over module paths such as
    ``layers.*.attn``) computes. cp_passes checks it against the graph and refuses on a mismatch."""

    modules: str
    """Glob over dotted module paths (``fnmatch`` rules)."""
    window: int | None = None
    """Sliding-window width ``w`` (each query sees itself and the ``w - 1`` preceding keys); ``None``
    for causal attention over the whole preceding sequence."""
    left_padding: int = 0
    """For a window's halo: this many zero rows in front of the ``w - 1`` rows received, so that an attention
    kernel's key tiles line up with global key positions (``w - 1 + left_padding`` a multiple of the tile).
    The zeros are made on each rank, never sent, and hidden by the mask."""

    def __post_init__(self) -> None:
        if not isinstance(self.modules, str) or not self.modules:
            raise ValueError(f"AttentionRule.modules must be a non-empty glob, got {self.modules!r}")
        if self.window is not None and (not isinstance(self.window, int) or isinstance(self.window, bool)
                                        or self.window < 1):
            raise ValueError(f"AttentionRule.window must be a positive int or None, got {self.window!r}")
        if not isinstance(self.left_padding, int) or isinstance(self.left_padding, bool) or self.left_padding < 0:
            raise ValueError(f"AttentionRule.left_padding must be a non-negative int, got {self.left_padding!r}")
        if self.left_padding and self.window is None:
            raise ValueError(f"AttentionRule.left_padding={self.left_padding} pads a window's halo; declare the "
                             f"window (window=None gathers the whole preceding sequence)")


@dataclass(frozen=True)
class Recurrence:
    """A recurrent kernel the model calls as a Python function: cp_passes captures each call as one op
    (``cp_passes::recurrence``) and hands its state from rank to rank (the carry transport)."""

    kernel: str
    """``"package.module:function"``: the module attribute the model's code reads at call time. cp_passes
    replaces it with a captured call of the original (which may itself dispatch to a hub kernel on GPU). A scan
    written as a method (RecurrentGemma's ``RecurrentGemmaRglru._rnn_scan``, a Python loop over positions) is
    ``"package.module:Class.method"``: the class attribute is replaced, and the method must compute from its
    arguments alone (it runs without its instance: one that reads ``self`` is refused when first called)."""
    sequence_args: tuple[str, ...]
    """The kernel's parameters that carry the sequence (tensors, on ``seq_dim``), by name, in any order; the
    first gives the output's shape outside its last dim."""
    form: str = "affine"
    """How ranks get their initial state. ``"affine"``: a shard's final state is an affine map of its initial
    one, acting on the state's key axis: ``M @ S0 + h`` for a state ``[..., K, V]`` (the flash-linear-attention
    layout: linear attention, the gated delta rule, KDA), ``S0 @ M + h`` for ``[..., V, K]`` (Mamba-2's
    ``[batch, heads, head_dim, d_state]``). Which of the state's last two axes is V is read from the kernel (the
    axis that grows when ``value_arg`` does). Every rank reads its ``[h | M]`` from one extra call (values
    extended with K zero columns from the state ``[0 | I]``), one all-gather, then folds its predecessors'
    maps. ``"sequential"``: any state; P - 1 rounds, in each of which every rank runs from its predecessor's
    last final state (P calls of the kernel per rank). ``"selective"``: Mamba-1's selective scan
    (``selective_scan_fn(u, delta, A, B, C, D, z, delta_bias, delta_softplus, ...)``, parameters read by place),
    which takes no initial state: cp_passes adds the state's part by the scan's math
    (:mod:`cp_passes.selective_scan`); every rank gathers each rank's final state and elementwise decay, state-sized
    (``initial_state=None``)."""
    initial_state: str | None = "initial_state"
    """The parameter that takes the initial state (None: the kernel takes none; ``form="selective"``)."""
    output_final_state: str | None = "output_final_state"
    """The flag that asks for the final state (returned second); None: the kernel always returns ``(output, final
    state)``."""
    value_arg: str = "value"
    """For ``"affine"``: the sequence argument whose last dim is the state's V (extended by K zero columns)."""
    tensor_args: tuple[str, ...] = ()
    """The kernel's tensor parameters that do not carry the sequence (Mamba-2's ``A``, ``D``, ``dt_bias``): passed
    whole on every rank, with their gradients. Any other argument must be a plain constant (``chunk_size``, a
    flag, a tuple of numbers)."""
    output_alone: bool = False
    """The kernel returns its output alone, not ``(output, None)``, when the final state is not asked for
    (Mamba-2's ``mamba2_chunk_scan``)."""
    seq_dim: int = 1
    documents: str | None = None
    """The argument that takes packed documents' boundaries, ``cu_seqlens`` in flash-linear-attention's
    convention (cumulative lengths ``[N + 1]`` over a batch of 1; the state starts from ``initial_state[n]``
    at document ``n``'s start). The model passes the whole sequence's; each rank's kernel receives its own
    shard's segments, the state carried into the first one unless a document starts exactly there. None:
    the kernel takes none, and a call with ``cu_seqlens`` is refused."""

    def __post_init__(self) -> None:
        if not isinstance(self.kernel, str) or self.kernel.count(":") != 1:
            raise ValueError(f"Recurrence.kernel must be 'package.module:function', got {self.kernel!r}")
        _check_names("sequence_args", self.sequence_args)
        _check_names("tensor_args", self.tensor_args)
        if not self.sequence_args:
            raise ValueError("Recurrence.sequence_args must name at least one argument")
        both = set(self.sequence_args) & set(self.tensor_args)
        if both:
            raise ValueError(f"Recurrence names {sorted(both)} in both sequence_args and tensor_args; an argument "
                             f"either carries the sequence or not")
        if self.form not in ("affine", "sequential", "selective"):
            raise ValueError(f"Recurrence.form must be 'affine', 'sequential' or 'selective', got {self.form!r}")
        if (self.initial_state is None) != (self.form == "selective"):
            raise ValueError(f"Recurrence(form={self.form!r}, initial_state={self.initial_state!r}): a kernel without "
                             f"an initial state (initial_state=None) is carried as Mamba-1's selective scan "
                             f"(form='selective'), which is the only form that needs none")
        if self.form == "selective" and self.documents is not None:
            raise ValueError("Recurrence(form='selective') takes no document boundaries (selective_scan_fn has none)")
        if self.form == "affine" and self.value_arg not in self.sequence_args:
            raise ValueError(f"an affine Recurrence needs value_arg {self.value_arg!r} among sequence_args "
                             f"{self.sequence_args!r}")


@dataclass(frozen=True)
class LiftedForward:
    """A module forward whose loop over the sequence is written inline (MiniMax's lightning attention loops over
    blocks inside ``MiniMaxLightningAttention.forward``), replaced by a copy of it with the loop moved into a
    function that the spec declares as a :class:`Recurrence`. Dynamo would unroll the inline loop at the
    compile-time length and nothing could hand it a state; the lifted loop is one op whose state the carry moves.
    cp_passes installs the copy on the class (:mod:`cp_passes.lifted`) after checking that the shipped forward is
    the code it was lifted from: another version of it is refused, naming both, rather than replaced by a stale
    copy."""

    target: str
    """``"package.module:Class.method"``: the forward with the inline loop, by its class path."""
    replacement: str
    """``"package.module:function"``: the same code with the loop lifted (it takes ``self`` first)."""
    source_sha256: str
    """The first 16 hex digits of the sha256 of the target's source (``inspect.getsource``) the copy was made from."""

    def __post_init__(self) -> None:
        for field in ("target", "replacement"):
            value = getattr(self, field)
            if not isinstance(value, str) or value.count(":") != 1:
                raise ValueError(f"LiftedForward.{field} must be 'package.module:attribute', got {value!r}")
        if "." not in self.target.partition(":")[2]:
            raise ValueError(f"LiftedForward.target must name a method, 'package.module:Class.method', got "
                             f"{self.target!r}")
        if not isinstance(self.source_sha256, str) or not re.fullmatch(r"[0-9a-f]{16}", self.source_sha256):
            raise ValueError(f"LiftedForward.source_sha256 must be 16 lowercase hex digits, got "
                             f"{self.source_sha256!r}")


@dataclass(frozen=True)
class CPSpec:
    """How to shard one model family along the sequence.

    Every field has a default that serves a plain causal LM; a family spec overrides only what differs.
    """

    name: str = "default"
    """Name used in tables and error messages."""

    seq_dim: int = 1
    """Dimension of every sharded input that indexes sequence positions (``[batch, seq, ...]`` -> 1), unless
    ``sequence_dims`` names it."""

    sequence_dims: tuple[tuple[str, int], ...] = ()
    """Inputs whose sequence is not on ``seq_dim``, as ``(name, dim)`` pairs; a negative dim counts from the
    end, so ``(("position_ids", -1),)`` serves M-RoPE positions ``[3, batch, seq]`` and plain ``[batch, seq]``
    ones alike. The dims before it are the input's batch dims (``[3, batch]`` there)."""

    seq_inputs: tuple[str, ...] | None = None
    """Forward arguments (or batch keys) sharded along their sequence dim (``seq_dim`` unless ``sequence_dims``
    says otherwise). ``None``: every tensor with the sequence length on that dim that is a known sequence input
    or has the batch dims of the input the length is read from (tokens first); another tensor with that length
    is refused as ambiguous (:meth:`is_sharded`)."""

    replicated_inputs: tuple[str, ...] = ()
    """Arguments never sharded even if their sequence dim happens to equal the sequence length."""

    pad_token_id: int = 0
    """Value that :func:`cp_passes.shard_batch` pads token inputs (``token_keys``) with."""

    ignore_index: int = -100
    """Value that :func:`cp_passes.shard_batch` pads label inputs with (the loss ignores it)."""

    token_keys: tuple[str, ...] = ("input_ids",)
    """Batch keys holding token ids: padded with ``pad_token_id``. :func:`cp_passes.shard_batch` refuses an
    integer sequence tensor that neither this nor ``label_keys``, ``position_keys``, its ``mask_keys`` or
    ``replicated_inputs`` names, since it cannot tell what its padding should be."""

    label_keys: tuple[str, ...] = ("labels", "shift_labels")
    """Batch keys holding labels: padded with ``ignore_index``."""

    position_keys: tuple[str, ...] = ("position_ids",)
    """Batch keys holding positions: padded by continuing the count, so padding stays well defined."""

    doc_key: str = "doc_ids"
    """Batch key of the document-id map (-1 on padding): :func:`cp_passes.shard_batch` pads it with -1 and, for
    packed rows, writes it."""

    packed_labels: tuple[str, str] = ("labels", "shift_labels")
    """For packed rows: the key of unshifted labels :func:`cp_passes.shard_batch` reads, and the key it writes
    them to shifted inside each document. Packing writes positions to ``position_keys[0]``."""

    pad_multiple: int = 1
    """Every shard holds a multiple of this many positions: the least common multiple of the windows the
    model groups the sequence into (``[B, S, D] -> [B, S / m, m, D]``, as compressed attention does), so that
    no window straddles two ranks. :func:`cp_passes.shard_batch` pads to a multiple of ``P * pad_multiple``,
    ``cp_compile`` refuses a local length that is not a multiple, and the planner proves window reshapes
    local with it."""

    packed_alignment: int = 1
    """For packed rows: :func:`cp_passes.shard_batch` starts every document at a multiple of this many
    positions (a model's compression groups), padding the one before it."""

    gather_kv_together: bool = True
    """Gather K and V of one attention call in a single collective (same bytes, one launch)."""

    attention: tuple[AttentionRule, ...] = ()
    """Declared attention semantics per module glob, checked against the graph (first match wins).
    Undeclared attention is read from the graph alone: ``is_causal`` or a window mask the model builds."""

    gathered_keys: str = "regather"
    """What the backward does with keys and values gathered for attention (a causal prefix, or every key):
    "regather" (autograd keeps this rank's slice and the backward gathers again: the K/V saved stay S/P, the
    forward's bytes move twice; 1.01x the step time of "save" at P = 2 on CPU, benchmarks/attention_step_time.py)
    or "save" (autograd keeps the gathered copy: up to S positions per rank and layer, one gather)."""

    moved_keys: str = "auto"
    """What moves for SDPA whose keys and values derive position by position from narrower tensors (an MLA latent:
    :mod:`cp_passes.graph.narrowest`): "narrowest" (those tensors; each rank computes K and V again on the rows it
    receives), "kv" (K and V), or "auto": the narrowest where a training step's FLOPs computing K and V again on a
    row received cost less than moving the bytes a row they save would at 2,000 FLOP a byte (an H100's NVLink; the
    rewrite's note gives both). DeepSeek-V3's latent moves (135 MFLOP against 242,304 B a row); Llama's hidden rows
    do not (269 MFLOP of norm and K and V projections against 24,576 B). Causal or full attention only: a window's
    halo moves K and V."""

    window_transport: str = "halo"
    """How sliding-window attention gets its keys: "halo" (the w - 1 preceding positions, and for an encoder's
    two-sided window the following ones, the lower bound) or "gather" (the whole preceding sequence, or every
    key for a two-sided window, masked; for comparison and debugging)."""

    attention_keys: str = "visible"
    """Which keys attention written by hand (``softmax(q @ k^T + mask) @ v``) brings: "visible" (those its
    masks let a query see for one document at the compile-time length: a window's halo, or the causal
    prefix; checked at run time against the masks the data gives) or "all" (every key: for masks that let a
    query see later keys only for some data, such as a prefix-LM's prompt)."""

    layout: str = "auto"
    """Which positions each rank holds (:mod:`cp_passes.layout`): "balanced" (the sequence in ``2P`` chunks, rank
    ``r`` holds chunks ``r`` and ``2P - 1 - r``: every rank does the same causal attention work), "contiguous"
    (rank ``r`` holds the ``r``-th ``1/P``), or "auto": balanced unless the spec declares a recurrence or an
    eager module, which need contiguous shards (:func:`cp_passes.layout.resolve_layout`). Batches sharded by
    :func:`cp_passes.shard_batch` with the same spec follow it."""

    recurrences: tuple[Recurrence, ...] = ()
    """Recurrent kernels whose state flows from rank to rank (see :class:`Recurrence`)."""

    lifted_forwards: tuple[LiftedForward, ...] = ()
    """Module forwards replaced by a copy whose inline loop over the sequence is lifted into a declared
    recurrence (see :class:`LiftedForward`)."""

    causal_convs: tuple[str, ...] = ()
    """Module globs whose convolutions run causally along the sequence. Kernel size, dilation, padding and
    groups are read from the op; a declared convolution that the graph does not show as causal is refused."""

    eager_modules: tuple[str, ...] = ()
    """Module globs that run eagerly on every rank, outside the analysed graph: a vision tower whose own
    data-dependent code (sizes from ``.tolist()``) neither dynamo nor AOT autograd can trace for training.
    Such a module must take no sequence-sharded input (image pixels and grid sizes, which every rank passes
    whole). It is called as one op, ``cp_passes::eager_module``, whose output sizes the graph treats as data
    dependent, and its backward runs it again under ``torch.func.vjp`` (the random state restored)."""

    experts: tuple[str, ...] = ()
    """Module globs of MoE experts that transformers generates without its experts-implementation switch (a
    Python loop over the experts ``nonzero()`` selects, which dynamo cannot trace: ``Step3p7Experts`` in 5.24).
    Each runs through transformers' ``grouped_mm`` experts forward instead, the path the families with the switch
    take by default: the same sum over each token's experts, which cp_passes proves local to each rank. Their
    weights must be stacked as that path reads them (``gate_up_proj`` ``[E, 2I, H]``, ``down_proj``
    ``[E, H, I]``). May match nothing (a config whose MLPs are all dense)."""

    positionwise_functions: tuple[str, ...] = ()
    """``"package.module:Class"`` of ``torch.autograd.Function`` subclasses the model calls with ``.apply`` that
    never mix positions (each output row reads only the same row of each input: an activation with a
    hand-written backward, Bloom's ``GeLUFunction``). Each runs as one op, ``cp_passes::function``, with the
    Function's own backward (:mod:`cp_passes.functions`); undeclared, such a call is refused, since cp_passes'
    re-trace would keep its forward only."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"CPSpec.name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.seq_dim, int) or isinstance(self.seq_dim, bool) or self.seq_dim < 0:
            raise ValueError(
                f"CPSpec.seq_dim must be a non-negative int (the dim of [batch, seq, ...] inputs that indexes "
                f"positions), got {self.seq_dim!r}"
            )
        if not isinstance(self.sequence_dims, tuple) or not all(
                isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and p[0] and isinstance(p[1], int)
                and not isinstance(p[1], bool) for p in self.sequence_dims):
            raise ValueError(f"CPSpec.sequence_dims must be a tuple of (input name, dim) pairs, got "
                             f"{self.sequence_dims!r}")
        for field in ("seq_inputs", "replicated_inputs", "token_keys", "label_keys", "position_keys", "causal_convs",
                      "packed_labels", "eager_modules", "experts", "positionwise_functions"):
            _check_names(field, getattr(self, field))
        bad = [f for f in self.positionwise_functions if f.count(":") != 1]
        if bad:
            raise ValueError(f"CPSpec.positionwise_functions entries must be 'package.module:Class', got {bad}")
        if not isinstance(self.doc_key, str) or not self.doc_key:
            raise ValueError(f"CPSpec.doc_key must be a non-empty string, got {self.doc_key!r}")
        if len(self.packed_labels) != 2:
            raise ValueError(f"CPSpec.packed_labels must be (unshifted key, shifted key), got {self.packed_labels!r}")
        for field in ("pad_multiple", "packed_alignment"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"CPSpec.{field} must be a positive int, got {value!r}")
        for field in ("pad_token_id", "ignore_index"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"CPSpec.{field} must be an int, got {value!r}")
        if not isinstance(self.gather_kv_together, bool):
            raise ValueError(f"CPSpec.gather_kv_together must be a bool, got {self.gather_kv_together!r}")
        if self.gathered_keys not in ("regather", "save"):
            raise ValueError(f"CPSpec.gathered_keys must be 'regather' or 'save', got {self.gathered_keys!r}")
        if self.moved_keys not in ("auto", "narrowest", "kv"):
            raise ValueError(f"CPSpec.moved_keys must be 'auto', 'narrowest' or 'kv', got {self.moved_keys!r}")
        if self.window_transport not in ("halo", "gather"):
            raise ValueError(f"CPSpec.window_transport must be 'halo' or 'gather', got {self.window_transport!r}")
        if self.attention_keys not in ("visible", "all"):
            raise ValueError(f"CPSpec.attention_keys must be 'visible' or 'all', got {self.attention_keys!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"CPSpec.layout must be one of {LAYOUTS}, got {self.layout!r}")
        if not isinstance(self.recurrences, tuple) or not all(isinstance(r, Recurrence) for r in self.recurrences):
            raise ValueError(f"CPSpec.recurrences must be a tuple of Recurrence, got {self.recurrences!r}")
        if not isinstance(self.lifted_forwards, tuple) or not all(isinstance(f, LiftedForward)
                                                                   for f in self.lifted_forwards):
            raise ValueError(f"CPSpec.lifted_forwards must be a tuple of LiftedForward, got {self.lifted_forwards!r}")
        if not isinstance(self.attention, tuple) or not all(isinstance(a, AttentionRule) for a in self.attention):
            raise ValueError(f"CPSpec.attention must be a tuple of AttentionRule, got {self.attention!r}")
        both = set(self.seq_inputs or ()) & set(self.replicated_inputs)
        if both:
            raise ValueError(
                f"CPSpec lists {sorted(both)} in both seq_inputs={self.seq_inputs!r} and "
                f"replicated_inputs={self.replicated_inputs!r}; an input is either sharded or not"
            )

    def replace(self, **changes) -> "CPSpec":
        return dataclasses.replace(self, **changes)

    def attention_for(self, module: str) -> AttentionRule | None:
        """The first attention rule whose glob matches ``module``."""
        return next((a for a in self.attention if fnmatch.fnmatchcase(module, a.modules)), None)

    def conv_declared(self, module: str) -> str | None:
        """The ``causal_convs`` glob that matches ``module``, if any."""
        return next((g for g in self.causal_convs if fnmatch.fnmatchcase(module, g)), None)

    def check_module_globs(self, paths: list[str]) -> None:
        """Raise ValueError for a module glob (``attention``, ``causal_convs``) that matches none of ``paths``
        (the model's ``named_modules()``): a typo there would silently declare nothing. ``eager_modules`` may
        match nothing (a family's text-only model has no vision tower): a module it misses is traced as any
        other, and one that cannot be is refused there."""
        globs = [(f"AttentionRule.modules={a.modules!r}", a.modules) for a in self.attention]
        globs += [(f"causal_convs entry {g!r}", g) for g in self.causal_convs]
        for what, glob in globs:
            if not any(fnmatch.fnmatchcase(p, glob) for p in paths):
                close = difflib.get_close_matches(glob, paths, n=3, cutoff=0.3)
                raise ValueError(
                    f"spec {self.name!r}: {what} matches no module of the model"
                    + (f"; closest module paths: {close}" if close else "")
                    + " (globs match dotted paths from model.named_modules(), e.g. 'model.layers.*.self_attn')"
                )

    # Which inputs are sharded: the wrapper (cp_compile), shard_batch and the dry run all decide with these.
    def may_shard(self, name: str | None) -> bool:
        """Whether input ``name`` may be sharded at all: listed in ``seq_inputs`` (any input when that is
        None) and not in ``replicated_inputs``."""
        return name not in self.replicated_inputs and (self.seq_inputs is None or name in self.seq_inputs)

    def dim_of(self, name: str | None, tensor=None) -> int:
        """The dim on which input ``name`` carries the sequence (``sequence_dims``, else ``seq_dim``); a negative
        one is counted from the end of ``tensor`` when it is given."""
        dim = dict(self.sequence_dims).get(name, self.seq_dim)
        return dim + tensor.dim() if dim < 0 and tensor is not None else dim

    def length_of(self, name: str | None, tensor) -> int | None:
        """The size of ``tensor`` on input ``name``'s sequence dim, or None when it has no such dim."""
        dim = self.dim_of(name, tensor)
        return tensor.shape[dim] if 0 <= dim < tensor.dim() else None

    def length_input(self, named, *, any_rank_tokens: bool = False):
        """The ``(name, tensor)`` whose sequence dim gives the sequence length, or None: a token input
        (``token_keys``) or ``inputs_embeds`` first, else the first tensor that may be sharded and has a
        sequence dim. ``any_rank_tokens`` also takes a token input without that dim (so that the caller can
        say what is wrong with it)."""
        usable = [(n, t) for n, t in named if hasattr(t, "dim") and self.may_shard(n)]
        preferred = [(n, t) for n, t in usable if n in (*self.token_keys, "inputs_embeds")
                     and (any_rank_tokens or self.length_of(n, t) is not None)]
        return next(iter(preferred + [(n, t) for n, t in usable if self.length_of(n, t) is not None]), None)

    def batch_dims(self, name: str | None, tensor) -> tuple:
        """The sizes before input ``name``'s sequence dim (its batch dims)."""
        return tuple(tensor.shape[:self.dim_of(name, tensor)])

    def is_sharded(self, name: str | None, tensor, seq_len: int | None, leading: tuple | None = None,
                   known: tuple[str, ...] = ()) -> bool:
        """Whether input ``name`` (a forward argument or batch key) is sharded along its sequence dim.

        With ``seq_inputs`` None, a tensor with the sequence length on its sequence dim is sharded when it is a known
        sequence input (tokens, labels, positions, doc ids, ``SEQUENCE_INPUTS``, ``known``) or has the leading
        (batch) dims ``leading`` of the input the length was read from; anything else with that length is
        ambiguous (image features ``[n_tokens, hidden]`` whose hidden size equals the local length, say):
        ValueError naming the fields that settle it, rather than sharding on a coincidence."""
        if not self.may_shard(name):
            return False
        if name in self.position_keys and name not in dict(self.sequence_dims) and tensor.dim() > 2:
            raise ValueError(
                f"input {name!r} {tuple(tensor.shape)} has more dims than [batch, seq] positions (M-RoPE positions "
                f"are [3, batch, seq], the sequence last); say where its sequence is: "
                f"CPSpec(sequence_dims=(({name!r}, -1),))")
        if self.seq_inputs is not None:
            return True
        if seq_len is None or self.length_of(name, tensor) != seq_len:
            return False
        names = (*self.token_keys, *self.label_keys, *self.position_keys, self.doc_key, *SEQUENCE_INPUTS, *known)
        if name in names or (leading is not None and self.batch_dims(name, tensor) == tuple(leading)):
            return True
        what = f"input {name!r}" if name else "a positional input"
        raise ValueError(
            f"{what} {tuple(tensor.shape)} has the sequence length {seq_len} on dim {self.dim_of(name, tensor)}, but "
            f"it is not a known sequence input ({', '.join(dict.fromkeys(names))}) and its leading dims are not the "
            f"batch dims {tuple(leading or ())} of the input the length comes from, so that length may be a "
            f"coincidence. Say "
            f"which it is: CPSpec(seq_inputs=(..., {name!r})) if each rank passes its slice, or "
            f"CPSpec(replicated_inputs=({name!r},)) if every rank passes the whole tensor")


SEQUENCE_INPUTS = ("inputs_embeds", "attention_mask", "token_type_ids", "loss_mask")
"""Inputs that carry the sequence by name (besides a spec's token, label, position and doc-id keys)."""


def _field_docs(cls) -> dict[str, str]:
    """Each field's docstring (the string after its annotation in the class body), read from the source."""
    import ast
    import inspect
    import textwrap

    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    except (OSError, TypeError):  # no source shipped: the fields go undocumented, the class still works
        return {}
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _document_fields(cls) -> None:
    """Append every field, its default and its docstring to ``cls.__doc__``, so that ``help(cls)`` lists them."""
    import textwrap

    lines, docs = ["", "Fields:", ""], _field_docs(cls)
    for field in dataclasses.fields(cls):
        default = (repr(field.default) if field.default is not dataclasses.MISSING else
                   "required" if field.default_factory is dataclasses.MISSING else "(computed)")
        lines.append(f"{field.name} = {default}")
        doc = docs.get(field.name, "")
        lines.extend(textwrap.indent(textwrap.fill(paragraph, 100), "    ")
                     for paragraph in doc.split("\n\n") if paragraph)
    cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n" + "\n".join(lines) + "\n"


for _cls in (AttentionRule, Recurrence, CPSpec):
    _document_fields(_cls)


def _set_fields(obj, like=None) -> list[tuple[str, object]]:
    """The fields of dataclass ``obj`` that differ from ``like``'s (or from their defaults), in order."""
    pairs = []
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        default = (getattr(like, field.name) if like is not None else field.default
                   if field.default is not dataclasses.MISSING else dataclasses.MISSING)
        if value != default:
            pairs.append((field.name, value))
    return pairs


def describe_spec(spec: CPSpec, width: int = 100) -> str:
    """``spec`` as its fields that differ from ``CPSpec()``'s, one per line; a rule or recurrence as its own
    fields that differ from their defaults."""
    import textwrap

    def line(text: str, indent: str) -> str:
        return textwrap.fill(text, width, initial_indent=indent, subsequent_indent=indent + "    ",
                             break_long_words=False, break_on_hyphens=False)

    lines = []
    for name, value in _set_fields(spec, CPSpec()):
        if name == "name":
            continue
        if isinstance(value, tuple) and value and dataclasses.is_dataclass(value[0]):
            lines.append(f"  {name}:")
            for item in value:
                lines.append(f"    - {type(item).__name__}")
                lines.extend(line(f"{field} = {v!r}", "        ") for field, v in _set_fields(item))
        else:
            lines.append(line(f"{name} = {value!r}", "  "))
    return "\n".join(lines) if lines else "  (the defaults)"


def available_specs() -> list[str]:
    """Names of the specs shipped in ``model_specs/``."""
    import model_specs

    folder = os.path.dirname(model_specs.__file__)
    return sorted(f[:-3] for f in os.listdir(folder) if f.endswith(".py") and not f.startswith("_"))


def load_spec(name_or_path: str, config=None) -> CPSpec:
    """Load ``SPEC`` from ``model_specs/<name>.py`` or from a ``.py`` file path; given the model's ``config``,
    the spec the file's ``for_config(config)`` reads from it, where the file defines one (DeepSeek V4's
    ``pad_multiple`` from its compression rates). A shipped file may list the transformers ``model_type``
    values it serves in ``MODEL_TYPES`` (default: its name), which ``cp_compile(model, spec=None)`` picks it
    by."""
    if name_or_path.endswith(".py"):
        if not os.path.exists(name_or_path):
            raise FileNotFoundError(f"no spec file {name_or_path!r}")
        loader_spec = importlib.util.spec_from_file_location("_cp_user_spec", name_or_path)
        module = importlib.util.module_from_spec(loader_spec)
        loader_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(f"model_specs.{name_or_path}")
        except ModuleNotFoundError as e:
            if e.name != f"model_specs.{name_or_path}":
                raise
            raise ValueError(f"no spec named {name_or_path!r}; shipped specs: {available_specs()}") from None
    spec = getattr(module, "SPEC", None)
    if not isinstance(spec, CPSpec):
        raise ValueError(f"{name_or_path!r} defines no module-level SPEC = CPSpec(...) (found {type(spec).__name__})")
    for_config = getattr(module, "for_config", None)
    if config is not None and for_config is not None:
        spec = for_config(config)
        if not isinstance(spec, CPSpec):
            raise ValueError(f"{name_or_path!r}: for_config returned {type(spec).__name__}, not a CPSpec")
    return spec


def model_types(name: str) -> tuple[str, ...]:
    """The transformers ``model_type`` values shipped spec ``name`` serves: its file's ``MODEL_TYPES``, else its
    name."""
    return tuple(getattr(importlib.import_module(f"model_specs.{name}"), "MODEL_TYPES", (name,)))


def shipped_spec_for(config) -> str | None:
    """The name of the shipped spec that serves ``config.model_type`` (a transformers config), or None."""
    model_type = getattr(config, "model_type", None)
    if not isinstance(model_type, str):
        return None
    return next((name for name in available_specs() if model_type in model_types(name)), None)


def shipped_spec_declaring(kernel: str) -> str | None:
    """The name of a shipped spec that declares the recurrent kernel ``kernel`` (``module:function``), or None."""
    return next((name for name in available_specs()
                 if any(r.kernel == kernel for r in load_spec(name).recurrences)), None)


def resolve_spec(spec, config=None) -> CPSpec:
    """``spec`` as cp_compile takes it: a CPSpec, a spec name or ``.py`` path (read for the model's ``config``
    where the file can), or None: the shipped spec for the config's ``model_type`` (:func:`shipped_spec_for`),
    else the default."""
    if spec is None:
        picked = shipped_spec_for(config)
        return CPSpec() if picked is None else load_spec(picked, config)
    if isinstance(spec, str):
        return load_spec(spec, config)
    if not isinstance(spec, CPSpec):
        raise TypeError(f"spec must be a CPSpec, a spec name such as 'llama', or None; got {type(spec).__name__}")
    return spec
