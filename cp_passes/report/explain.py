"""The rewrite table: what each pass changed, what it moves per rank, and the lower bound."""

from __future__ import annotations

import re

from tabulate import tabulate

from ..graph.checkpoint import REGATHERED, REPEATED
from .memory import saved_activation_bytes

HEADERS = ("node", "source", "module", "rule", "transport", "collective", "elements recv", "bytes recv",
           "lower bound recv", "bytes sent", "of which metadata", "note")


def format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _layer_range(modules: list[str]) -> str | None:
    """``model.layers.0-31.self_attn x32`` for modules that differ only in one index counting up by one, else
    None."""
    parts = [re.split(r"(\d+)", m) for m in modules]
    if len({len(p) for p in parts}) != 1:
        return None
    differ = [i for i, pieces in enumerate(zip(*parts)) if len(set(pieces)) > 1]
    if len(differ) != 1 or differ[0] % 2 == 0:
        return None
    numbers = [int(p[differ[0]]) for p in parts]
    if numbers != list(range(numbers[0], numbers[0] + len(numbers))):
        return None
    merged = parts[0][:differ[0]] + [f"{numbers[0]}-{numbers[-1]}"] + parts[0][differ[0] + 1:]
    return f"{''.join(merged)} x{len(modules)}"


def collapse_layers(rows: list, module: int, shortest: int = 3) -> list:
    """Runs of at least ``shortest`` consecutive rows that differ only in the index of their module (column
    ``module``; the node column 0 may differ too) shown once, the module as ``model.layers.0-31.self_attn x32``
    and the first row's node: a 61-layer model's table has one row per kind of layer."""
    out, i = [], 0
    while i < len(rows):
        j = i + 1
        same = [c for c in range(len(rows[i])) if c not in (0, module)]
        while j < len(rows) and all(rows[j][c] == rows[i][c] for c in same) and \
                _layer_range([r[module] for r in rows[i:j + 1]]) is not None:
            j += 1
        row = list(rows[i])
        if j - i >= shortest:
            row[module] = _layer_range([r[module] for r in rows[i:j]])
            out.append(type(rows[i])(row))
            i = j
        else:
            out.append(rows[i])
            i += 1
    return out


def table_rows(records) -> list[tuple]:
    return [
        (r.node, r.source, r.module, r.rule, r.transport, r.collective, r.elements or "",
         format_bytes(r.bytes) if r.collective else "", format_bytes(r.lower_bound_bytes) if r.collective else "",
         format_bytes(r.sent_bytes) if r.collective else "", format_bytes(r.metadata_bytes) if r.metadata_bytes else "",
         "; ".join(n for n in (r.note, r.backward) if n))
        for r in records
    ]


NARROW_HEADERS = ("module", "rule", "recv / bound", "note")


def narrow_table(records, width: int) -> str:
    """The table in about ``width`` columns: the module and rule, the bytes received against the lower bound,
    and the note wrapped into what is left (every column: ``format_record(record)``)."""
    rows = collapse_layers([(r.node, r.module or r.node, r.rule,
                             f"{format_bytes(r.bytes)} / {format_bytes(r.lower_bound_bytes)}" if r.collective else "",
                             "; ".join(n for n in (r.note, r.backward) if n)) for r in records], 1)
    rows = [row[1:] for row in rows]
    used = len(tabulate([row[:3] for row in rows], headers=NARROW_HEADERS[:3]).splitlines()[1])  # the rule: full widths
    return tabulate(rows, headers=NARROW_HEADERS, maxcolwidths=[None] * 3 + [max(16, width - used - 2)])


def wrap(lines: list[str], width: int | None) -> list[str]:
    """Each line wrapped at ``width`` (continuations indented), or as it is for None."""
    import textwrap

    if width is None:
        return lines
    return [textwrap.fill(line, width, subsequent_indent="    ", break_long_words=False) if "\n" not in line
            and len(line) > width else line for line in lines]


def format_record(record, width: int | None = None) -> str:
    """The rewrite table of one compiled graph with its totals; every column and whole lines without
    ``width``, else what fits ``width`` columns (:func:`narrow_table`)."""
    head = [f"cp_passes rewrites: rank {record.rank} of {record.world_size}, local length {record.local_len}, "
            f"backend {record.backend}"] + ([f"layout: {record.layout}"] if record.layout else [])
    if not record.records:
        return "\n".join(wrap(head + ["(no node touches the sequence in a way that needs a transport)"]
                              + _memory(record), width))
    total = sum(r.bytes for r in record.records)
    bound = sum(r.lower_bound_bytes for r in record.records)
    sent = sum(r.sent_bytes for r in record.records)
    metadata = sum(r.metadata_bytes for r in record.records)
    table = (tabulate(collapse_layers(table_rows(record.records), 2), headers=HEADERS) if width is None
             else narrow_table(record.records, width))
    lines = head + [table,
             f"this rank per forward: received {format_bytes(total)} (lower bound {format_bytes(bound)}; of it "
             f"metadata without autograd {format_bytes(metadata)}), sent {format_bytes(sent)}; the backward moves "
             f"the same bytes the other way, except the metadata"]
    repeated = [r for r in record.records if r.backward in (REPEATED, REGATHERED)]
    if repeated:
        lines.append(f"recomputed in the backward instead of saved (checkpointed regions; gathered keys with "
                     f"gathered_keys=\"regather\"): {len(repeated)} rewrites' collectives, receiving "
                     f"{format_bytes(sum(r.bytes for r in repeated))} again")
    return "\n".join(wrap(lines + _interleaved(record) + _memory(record), width))


def _interleaved(record) -> list[str]:
    """Whether batches of interleaved documents (``shard_batch(..., balance="documents")``) are accepted."""
    readers = record.interleave_readers
    if readers is None or not record.layout.startswith("balanced"):  # shard_batch interleaves only for that one
        return []
    if not readers:
        return ["balance='documents': accepted (every attention keeps documents apart; row positions only compared)"]
    return [f"balance='documents': refused ({len(readers)} reasons; the first: {readers[0]})"]


def _memory(record) -> list[str]:
    if not record.saved:
        return []
    kept = [s for s in record.saved if not s.primal]
    return [f"saved for backward on this rank (AOTAutograd's partition): "
            f"{format_bytes(saved_activation_bytes(record.saved))}"
            f" in {len(kept)} tensors, besides the inputs and parameters the backward reads"]


def format_graphs(records) -> str:
    """How many graphs there are, the local length each was compiled at, and why each later one was: the
    guard that the graph compiled just before it failed (``record.recompile_reasons`` has every graph's)."""
    lines = [f"cp_passes: {len(records)} graph{'s' if len(records) != 1 else ''} compiled"]
    for i, r in enumerate(records):
        line = f"  graph {i}: local length {r.local_len}" + (" (lowered for that length alone)" if r.static else "")
        if i and r.recompile_reasons:
            line += "; recompiled because " + re.sub(r"^\S+/\S+: ", "", r.recompile_reasons[0].splitlines()[0])
        lines.append(line)
    return "\n".join(lines)


def explain(compiled, print_table: bool = True) -> str:
    """The graphs ``compiled`` (a CPModule) has compiled so far, then the rewrite table of each."""
    records = compiled.compile_records
    spec = f"cp_passes: spec {compiled.spec.name!r} ({compiled.spec_origin})"
    if not records:
        text = spec + "\ncp_passes: nothing compiled yet (the first call compiles)"
    else:
        text = "\n\n".join([spec + "\n" + format_graphs(records)] + [format_record(r) for r in records])
    if print_table:
        print(text)
    return text
