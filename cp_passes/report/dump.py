"""Write a compiled graph's history, AOT graphs, Inductor code and rewrite table to a folder."""

from __future__ import annotations

import os
import re

from .explain import format_record


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


def trace_record(record) -> None:
    """Send every graph and the rewrite table to torch's structured trace, so tlparse shows them
    (set TORCH_TRACE=DIR). AOT graphs and Inductor's code are traced by torch itself."""
    from torch._logging._internal import trace_structured_artifact

    for i, (label, code) in enumerate(record.history):
        trace_structured_artifact(f"cp_passes_{i:02d}_{_slug(label)}", "string", lambda code=code: code)
    trace_structured_artifact("cp_passes_explain", "string", lambda: format_record(record))


def write_dump(folder, record, index: int) -> list[str]:
    root = os.path.join(os.fspath(folder), f"rank{record.rank}", f"graph{index}")
    os.makedirs(root, exist_ok=True)
    files = []

    def put(name: str, text: str):
        with open(os.path.join(root, name), "w") as f:
            f.write(text)
        files.append(name)

    for i, (label, code) in enumerate(record.history):
        put(f"{i:02d}_{_slug(label)}.py", f"# {label}\n{code}")
    for kind, code in record.aot_graphs.items():
        put(f"aot_{kind}.py", code)
    for i, code in enumerate(record.output_code):
        put(f"inductor_output_code_{i}.py", code)
    put("explain.txt", format_record(record) + "\n")
    put("index.txt", "\n".join(files) + "\n")
    return files
