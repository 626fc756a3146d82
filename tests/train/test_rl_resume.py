"""`trace-jax train` killed with SIGKILL resumes from its run directory to the same metrics and params as an
uninterrupted run (data position, rollout keys and the train state's PRNG key are checkpointed)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.train.test_rl_pipeline import SMALL

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
_VOLATILE = ("wall_time", "time/", "tokens_per_s", "tflops", "mfu", "eval/seconds")


def _command(gin_file: Path, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "trace_jax.cli", "train", "--gin_file", str(gin_file), "--run_dir", str(run_dir),
            "--no_progress"]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}


def _step_metrics(run_dir: Path) -> dict[int, dict]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "reward" in record:
            out[record["step"]] = {k: v for k, v in record.items() if not any(s in k for s in _VOLATILE)}
    return out


def _final_params(run_dir: Path):
    from trace_jax.train.checkpoint import Checkpointer
    from trace_jax.train.config import CheckpointConfig

    store = Checkpointer(CheckpointConfig(directory=str(run_dir / "checkpoints"), async_save=False))
    try:
        assert store.latest_step() == STEPS
        return store.restore_params(STEPS)
    finally:
        store.close()


@pytest.mark.slow
def test_sigkilled_run_resumes_to_the_same_metrics_and_params(tmp_path):
    import jax

    gin_file = tmp_path / "small.gin"
    gin_file.write_text(SMALL + f"TrainConfig.steps = {STEPS}\nEvalConfig.every_steps = 2\n")
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    uninterrupted = subprocess.Popen(_command(gin_file, straight), env=_env(), cwd=REPO,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    victim = subprocess.Popen(_command(gin_file, killed), env=_env(), cwd=REPO, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    deadline = time.time() + 900
    # kill once step 2's checkpoint is complete (orbax renames a finished step's directory into place)
    while not (killed / "checkpoints" / "2").is_dir() and victim.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert victim.poll() is None, "the run finished before it could be killed"
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert not (killed / "summary.json").exists()
    resumed = subprocess.run(_command(gin_file, killed), env=_env(), cwd=REPO, capture_output=True, text=True,
                             timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from the checkpoint of step" in resumed.stdout
    assert uninterrupted.wait(timeout=900) == 0

    a, b = _step_metrics(straight), _step_metrics(killed)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    for step in a:
        assert a[step] == b[step], f"step {step} differs after the resume"
    for x, y in zip(jax.tree_util.tree_leaves(_final_params(straight)),
                    jax.tree_util.tree_leaves(_final_params(killed))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
