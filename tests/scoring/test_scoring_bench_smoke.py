"""benchmarks/scoring_bench.py keeps running: its --quick mode on the tiny model, fork against naive."""

import importlib.util
import os


BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "scoring_bench.py")


def test_scoring_bench_quick_runs_and_agrees_with_naive(capsys):
    spec = importlib.util.spec_from_file_location("scoring_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--quick", "--no-torch", "--no-smollm2", "--repeats", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny-qwen3 L=256")]
    assert rows, "no result row printed"
    max_diff = float(rows[-1].strip(" |").split("|")[-1])
    assert max_diff < 1e-5
