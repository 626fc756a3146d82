"""benchmarks/mesh_bench.py keeps running: its --quick table (a whole RL step on one device and on fsdp=4 x tensor=2,
8 fake CPU devices) holds the policy, its optimizer state, the reference and the KV cache within 1/N + 10% of one
device's bytes per device, and the rollout copy of the policy at its designed 1/tensor."""

from __future__ import annotations

import importlib.util
import os

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "mesh_bench.py")
pytestmark = pytest.mark.slow  # two meshes' RL step programs (shared with test_mesh_step.py through the cache)


def test_quick_bench_prints_every_category_within_its_target(capsys):
    spec = importlib.util.spec_from_file_location("mesh_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--quick"]) == 0
    out = capsys.readouterr().out
    rows = [[cell.strip() for cell in line.strip(" |").split("|")] for line in out.splitlines()
            if line.startswith("| tiny (1 layer) | fsdp=4,tensor=2 |")]
    byte_rows = {row[2]: row for row in rows if row[2] in bench.CATEGORIES}
    assert set(byte_rows) == set(bench.CATEGORIES)
    for category, row in byte_rows.items():
        ratio, target = float(row[5]), float(row[6])
        if category == "policy (rollout layout)":  # whole over fsdp = 4, split over tensor = 2
            assert 0.45 <= ratio <= 1 / 2 + 0.1 and "by design" in row[8], row
        else:
            assert target == pytest.approx(1 / 8 + 0.1) and ratio <= target and row[7] == "yes", row
    phases = [row for row in rows if row[2] not in bench.CATEGORIES]
    assert len(phases) == 1  # rollout, scoring, credit, update seconds
    rollout, scoring, credit, update = map(float, phases[0][2:6])
    assert rollout > 0 and update > 0


def test_the_state_target_counts_the_devices_the_rules_split_the_state_over():
    import jax

    from trace_jax import models

    spec = importlib.util.spec_from_file_location("mesh_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    devices = jax.devices()[:8]
    if len(devices) < 8:
        pytest.skip("needs 8 devices (the suite's conftest forces them)")

    def mesh(**axes):
        return jax.sharding.Mesh(__import__("numpy").array(devices).reshape(tuple(axes.values())), tuple(axes))

    assert bench.state_devices(mesh(data=1, fsdp=4, tensor=2, expert=1), models.DEFAULT_RULES) == 8
    # the data axis is pure data parallelism: the state is replicated over it
    assert bench.state_devices(mesh(data=2, fsdp=2, tensor=2, expert=1), models.DEFAULT_RULES) == 4
    # a rules override that also splits `embed` over data makes it 8 again
    rules = models.merge_rules((("embed", ("data", "fsdp", "expert")),))
    assert bench.state_devices(mesh(data=2, fsdp=2, tensor=2, expert=1), rules) == 8
