"""A warm start that is stopped (SIGTERM) or crashes resumes from its own checkpoints (`WarmStartConfig.
checkpoint_every`, the run directory's `warm_start/`) and warm-starts the policy bit for bit as one that ran
through: the same params at the run's step 0, the same losses, the evaluation before it run once."""

import dataclasses
import json
import os
import signal

import jax
import numpy as np
import pytest

from tests.rl.test_rl_pipeline import SMALL, WARM_START_TURNS
from trace_jax.rl import loop
from trace_jax.rl.gin_setup import parse
from trace_jax.train.checkpoint import Checkpointer
from trace_jax.train.config import CheckpointConfig

WARM = SMALL + WARM_START_TURNS + """
TrainConfig.steps = 0
WarmStartConfig.steps = 6
WarmStartConfig.num_trajectories = 6
WarmStartConfig.batch_size = 2
WarmStartConfig.checkpoint_every = 2
"""


class Crash(Exception):
    pass


def _train(gin_file, run_dir, lines, on_line=None):
    def log(line):
        lines.append(line)
        if on_line is not None:
            on_line(line)

    return loop.train(parse([str(gin_file)]), run_dir, progress=False, log=log)


def _saved_run_seconds(run_dir, step):
    """The run's wall seconds the warm start's checkpoint of `step` saved (its host JSON)."""
    host = json.loads((run_dir / loop.WARM_START_DIR / str(step) / "host" / "metadata").read_text())
    return host["run_seconds"]


def _step0_params(run_dir):
    with Checkpointer(CheckpointConfig(directory=str(run_dir / "checkpoints"), async_save=False)) as store:
        return store.restore_params(0)


@pytest.mark.slow  # four warm starts of 6 SFT steps on the small config, each with its evaluations (~40 s)
def test_a_stopped_then_crashed_warm_start_resumes_to_the_params_of_one_that_ran_through(tmp_path):
    gin_file = tmp_path / "warm.gin"
    gin_file.write_text(WARM)
    through = tmp_path / "through"
    lines_through = []
    _train(gin_file, through, lines_through)

    resumed, lines = tmp_path / "resumed", []

    def stop_at_3(line):
        if line.startswith("warm start step 3/6"):
            os.kill(os.getpid(), signal.SIGTERM)  # the run's PreemptionGuard takes it

    result = _train(gin_file, resumed, lines, stop_at_3)
    assert result == {"stopped_at": 0, "warm_start_stopped_at": 3}
    with Checkpointer(CheckpointConfig(directory=str(resumed / loop.WARM_START_DIR), async_save=False)) as store:
        assert store.all_steps() == [3]  # the forced save (every 2 would not save step 3); step 2 was replaced
    first_attempt = _saved_run_seconds(resumed, 3)
    assert first_attempt > 0

    def crash_at_5(line):
        if line.startswith("warm start step 5/6"):
            raise Crash  # after the regular save of step 4, before any save of step 5

    with pytest.raises(Crash):
        _train(gin_file, resumed, lines, crash_at_5)
    with Checkpointer(CheckpointConfig(directory=str(resumed / loop.WARM_START_DIR), async_save=False)) as store:
        assert store.all_steps() == [4]
    # the second attempt's clock continues the first's: its checkpoint holds both attempts' seconds
    both_attempts = _saved_run_seconds(resumed, 4)
    assert both_attempts > first_attempt
    _train(gin_file, resumed, lines)

    assert sum("resumed at step" in line for line in lines) == 2
    assert [line for line in lines if "resumed at step" in line][1].startswith("warm start: resumed at step 4/6")
    assert sum("(before warm start" in line for line in lines) == 1  # evaluated once, kept in the checkpoint
    assert not (resumed / loop.WARM_START_DIR).exists()  # gone once the run's step 0 holds the policy
    for got, want in zip(jax.tree_util.tree_leaves(_step0_params(resumed)),
                         jax.tree_util.tree_leaves(_step0_params(through))):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    def final_loss(run_dir):
        rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [r["warmstart/final_loss"] for r in rows if "warmstart/final_loss" in r]

    assert final_loss(resumed) == final_loss(through) and len(final_loss(through)) == 1
    # the resumed run's wall time continues from the checkpoint it resumed from (it held no metrics of its own)
    walls = [json.loads(r)["wall_time"] for r in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert walls[0] > both_attempts and walls == sorted(walls)
    summaries = [json.loads((d / "summary.json").read_text()) for d in (through, resumed)]
    def without_seconds(evaluations):
        return {name: {k: v for k, v in e.items() if k != "seconds"} for name, e in evaluations.items()}

    assert without_seconds(summaries[0]["evaluations"]) == without_seconds(summaries[1]["evaluations"])
    # the evaluation before the warm start ran in the first attempt; its seconds came through the checkpoint
    assert summaries[1]["seconds"]["eval_before"] >= summaries[1]["evaluations"]["before"]["seconds"] > 0
    assert summaries[1]["seconds"]["warm_start"] > 0


def test_a_warm_start_resumes_only_under_its_own_settings(tmp_path):
    from trace_jax.rl.warmstart import WarmStartConfig

    ws = WarmStartConfig(steps=6, checkpoint_every=2)
    saved = json.loads(json.dumps(dataclasses.asdict(ws)))
    loop._check_resumed_warm_start("runs/a/warm_start", saved, ws)
    loop._check_resumed_warm_start("runs/a/warm_start", saved, WarmStartConfig(steps=6, checkpoint_every=3))
    changed = WarmStartConfig(steps=8, checkpoint_every=2, learning_rate=1e-3)
    with pytest.raises(ValueError, match=r"runs/a/warm_start ran with other WarmStartConfig settings \(learning_rate: "
                                         r"0\.003 -> 0\.001, steps: 6 -> 8\); bind them back"):
        loop._check_resumed_warm_start("runs/a/warm_start", saved, changed)
    with pytest.raises(ValueError, match="WarmStartConfig.checkpoint_every must be >= 0"):
        WarmStartConfig(checkpoint_every=-1)
