"""The commands README gives, run the way a user runs them."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args, timeout=300):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_help_lists_every_option():
    out = run("-m", "cp_passes", "demo", "--help")
    assert out.returncode == 0
    for option in ("--nproc", "--steps", "--seq-len", "--backend", "--dump"):
        assert option in out.stdout
    top = run("-m", "cp_passes", "--help")
    assert "demo" in top.stdout and "specs" in top.stdout


def test_specs_lists_shipped_specs():
    out = run("-m", "cp_passes", "specs")
    assert out.returncode == 0 and out.stdout.startswith("llama: CPSpec(name='llama'")


def test_demo_runs_and_matches_one_device(tmp_path):
    out = run("-m", "cp_passes", "demo", "--backend", "aot_eager", "--steps", "2", "--seq-len", "63",
              "--dump", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2
    for line in steps:
        assert float(line.rsplit("rel diff", 1)[1]) <= 1e-4
    assert "rank 1 of 2, local length 32" in out.stdout and out.stdout.count("sdpa_causal") == 2
    index = (tmp_path / "rank1" / "graph0" / "index.txt").read_text().split()
    assert "explain.txt" in index and "aot_forward.py" in index and "aot_backward.py" in index
    after = next(name for name in index if "after_sequence_gather" in name)
    assert "sequence_all_gather" in (tmp_path / "rank1" / "graph0" / after).read_text()


def test_example_script_trains():
    out = run("examples/train_toy_llama.py", "--backend", "aot_eager", "--steps", "2", "--seq-len", "64")
    assert out.returncode == 0, out.stderr[-3000:]
    assert [line.split(":")[0] for line in out.stdout.splitlines() if line.startswith("step")] == ["step 0", "step 1"]


def test_halo_benchmark_reports_the_lower_bound():
    out = run("benchmarks/halo_bytes.py", "--seq-len", "32768", "--world-size", "8")
    assert out.returncode == 0, out.stderr[-3000:]
    totals = out.stdout.split("rank    halo total MiB")[1].splitlines()[2:]
    assert [line.split()[0] for line in totals] == ["1", "4", "7"]
    for line in totals:
        rank, halo, gather, bound, halo_ratio, gather_ratio = line.split()
        assert float(halo_ratio) == 1.0 and float(gather_ratio) > 20
