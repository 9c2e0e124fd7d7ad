"""Dry runs of real configs: ``python -m cp_passes explain --hf-config T`` for the default config of every model type
a shipped spec serves and of Llama (P = 16, S = 1,048,576) and of Llama, Qwen3 and DeepSeek-V3 (P = 8,
S = 131,072), each in its own process as a user runs it. One row per run: planned (what the last rank receives per
forward against its lower bound, and what it saves for the backward), refused (the refusal's first line) or
failed, with its wall and CPU seconds. A run that exceeds --timeout is stopped and shown as such.

    python benchmarks/dry_runs.py                          # every run; about an hour on 2 cores
    python benchmarks/dry_runs.py --only llama qwen3       # the runs whose model type is named
"""

import argparse
import os
import re
import resource
import subprocess
import sys
import time

from tabulate import tabulate

from cp_passes.spec import available_specs, model_types

EIGHT_AT_128K = ("llama", "qwen3", "deepseek_v3")


def runs() -> list[tuple[str, int, int]]:
    """(model type, P, S) for each dry run: the first model type of each shipped spec (Llama's for the default
    spec) at P = 16, S = 1M, then the three common causal LMs at P = 8, S = 128k."""
    shipped = [model_types(name)[0] if model_types(name) else name for name in available_specs()]
    return [(t, 16, 2 ** 20) for t in shipped] + [(t, 8, 2 ** 17) for t in EIGHT_AT_128K]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _outcome(returncode: int | None, out: str, err: str) -> str:
    if returncode is None:
        return "stopped at --timeout"
    if returncode == 0:
        received = re.search(r"this rank per forward: received ([\d.]+ \w+) \(lower bound ([\d.]+ \w+)", out)
        saved = re.search(r"saved for backward on this rank \(AOTAutograd's partition\): (\S+ \S+)", out)
        return (f"planned: received {received[1]} (bound {received[2]})" if received else "planned: nothing moved") \
            + (f", saves {saved[1]}" if saved else "")
    lines = [line for line in err.strip().splitlines() if line.strip() and not line.startswith("cp_passes:")]
    first = lines[0] if lines else f"exit status {returncode}"
    kind = "refused" if returncode == 1 and "Traceback" not in err else "failed"
    return f"{kind}: {first[:160]}"


def dry_run(model_type: str, world: int, seq_len: int, timeout: float) -> tuple[str, float, float]:
    """One dry run in its own process: (outcome, wall seconds, CPU seconds)."""
    command = [sys.executable, "-m", "cp_passes", "explain", "--hf-config", model_type, "--world-size", str(world),
               "--seq-len", str(seq_len), "--wide"]
    cpu, start = _children_cpu(), time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
        outcome = _outcome(done.returncode, done.stdout, done.stderr)
    except subprocess.TimeoutExpired:
        outcome = _outcome(None, "", "")
    return outcome, time.perf_counter() - start, _children_cpu() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", metavar="TYPE", help="run only these model types")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a run may take (default: 900)")
    args = parser.parse_args()
    rows = []
    for model_type, world, seq_len in runs():
        if args.only and model_type not in args.only:
            continue
        outcome, wall, cpu = dry_run(model_type, world, seq_len, args.timeout)
        rows.append((model_type, world, seq_len, f"{wall:.0f}", f"{cpu:.0f}", outcome))
        print(f"{model_type} P={world} S={seq_len}: {outcome} ({wall:.0f} s wall, {cpu:.0f} CPU-s)", flush=True)
    print()
    print(tabulate(rows, headers=["model type", "P", "S", "wall s", "CPU s", "outcome"]))


if __name__ == "__main__":
    main()
