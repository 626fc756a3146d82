"""`trace-jax train` killed with SIGKILL after step 2 resumes from its run directory to the same prompts (steps 3-4),
metrics, per-episode scores (turn_scores.jsonl) and params as an uninterrupted run (the grain iterator state of the
prompt order, rollout keys and the train state's PRNG key are checkpointed).

The three runs (uninterrupted, killed, resumed) run one after another. The killed one is a `trace-jax train`
process, since SIGKILL is what is under test; the other two run the same command in the test's own process
(`cli.main`). They share a persistent XLA compilation cache (the suite's, which tests/conftest.py sets up), so
only the first compiles: the killed process loads its programs (bit-identical executables, which is also what a
resumed run on the same machine gets with the cache on) and the resumed run reuses them in the same process.
"""

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

from tests.rl.test_rl_pipeline import SMALL

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
KILL_AFTER = 2  # the victim dies once this step's checkpoint is complete
_VOLATILE = ("wall_time", "time/", "tokens_per_s", "tflops", "mfu", "eval/seconds", "compile_seconds")


def _arguments(gin_file: Path, run_dir: Path) -> list[str]:
    """`trace-jax train`'s arguments, for `cli.main` here and for the killed process alike."""
    return ["train", "--gin-file", str(gin_file), "--run-dir", str(run_dir), "--no-progress"]


def _train_here(gin_file: Path, run_dir: Path) -> int:
    from trace_jax import cli

    return cli.main(_arguments(gin_file, run_dir))


def _env() -> dict:
    """The suite's compilation cache (JAX_COMPILATION_CACHE_DIR, which this process compiles into too), every
    program cached."""
    return {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu",
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def _step_metrics(run_dir: Path) -> dict[int, dict]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "reward" in record:
            out[record["step"]] = {k: v for k, v in record.items() if not any(s in k for s in _VOLATILE)}
    return out


def _step_prompts(run_dir: Path) -> dict[int, list[str]]:
    records = [json.loads(line) for line in (run_dir / "prompts.jsonl").read_text().splitlines()]
    return {r["step"]: r["task_ids"] for r in records}


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
def test_sigkilled_run_resumes_to_the_same_prompts_metrics_and_params(tmp_path, capsys):
    import jax

    gin_file = tmp_path / "small.gin"
    # an evaluation at step 3, after the kill: the resumed run must restore the initial one from the host state;
    # 4 training tasks, 2 a step: steps 3-4 are the second epoch, which the resumed order must reshuffle alike.
    # One tool call an episode (then the answer turn): fewer decode and append shapes to compile, which the resume
    # does not depend on.
    gin_file.write_text(SMALL + f"TrainConfig.steps = {STEPS}\nEvalConfig.every_steps = 3\n"
                        "DataConfig.num_train_tasks = 4\nRolloutConfig.max_turns = 1\n")
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert _train_here(gin_file, straight) == 0
    victim = subprocess.Popen([sys.executable, "-m", "trace_jax.cli", *_arguments(gin_file, killed)], env=_env(),
                              cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 900
    # kill once step 2's checkpoint is complete (orbax renames a finished step's directory into place)
    while not (killed / "checkpoints" / str(KILL_AFTER)).is_dir() and victim.poll() is None \
            and time.time() < deadline:
        time.sleep(0.05)
    assert victim.poll() is None, "the run finished before it could be killed"
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert not (killed / "summary.json").exists()
    capsys.readouterr()
    assert _train_here(gin_file, killed) == 0
    assert "resuming from the checkpoint of step" in capsys.readouterr().out

    prompts = _step_prompts(killed)
    assert sorted(prompts) == list(range(1, STEPS + 1))
    assert [prompts[s] for s in (3, 4)] == [_step_prompts(straight)[s] for s in (3, 4)]
    assert prompts[3] + prompts[4] != prompts[1] + prompts[2]  # a new epoch, shuffled anew
    # the per-episode scores too: a step recorded before the kill and redone after it is recorded once
    straight_scores, killed_scores = ((run / "turn_scores.jsonl").read_text().splitlines()
                                      for run in (straight, killed))
    assert straight_scores == killed_scores and len(straight_scores) == STEPS * 2 * 2  # prompts x group size
    a, b = _step_metrics(straight), _step_metrics(killed)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    for step in a:
        assert a[step] == b[step], f"step {step} differs after the resume"
    for x, y in zip(jax.tree_util.tree_leaves(_final_params(straight)),
                    jax.tree_util.tree_leaves(_final_params(killed))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
