"""A bounded load on loopback (200 requests, 16 concurrent, every 5th malformed): every valid request is served,
identical greedy prompts give identical text whatever they were batched with, every invalid one is a 4xx with a
message. The load generator is benchmarks/serve_bench.py's."""

import importlib.util
import os
import sys

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "serve_bench.py")


def _bench():
    spec = importlib.util.spec_from_file_location("serve_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up
    spec.loader.exec_module(bench)
    return bench


def test_bounded_load_loses_nothing_and_rejects_bad_input_with_4xx(served):
    url, backend = served
    result = _bench().run_load(url, "tiny", requests=200, concurrency=16, max_tokens=8, invalid_every=5)
    assert result.valid == 160 and result.invalid == 40
    assert result.failed == [] and result.lost == 0 and result.ok == 160
    assert result.bad_rejections == [] and result.rejected_4xx == 40
    assert result.inconsistent == []
    assert backend.engine.stats["max_rows"] > 1  # requests really shared decode steps
