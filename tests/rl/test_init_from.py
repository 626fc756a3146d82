"""`TrainConfig.init_from`: a run starts from another run's warm-started policy instead of warm-starting again."""

import json

import jax
import numpy as np
import pytest

from tests.rl.test_rl_pipeline import SMALL, WARM_START_TURNS
from trace_jax.rl import cli as train_cli
from trace_jax.rl.gin_setup import parse
from trace_jax.rl.loop import train
from trace_jax.train.checkpoint import Checkpointer
from trace_jax.train.config import CheckpointConfig

pytestmark = pytest.mark.slow  # two short runs of the small config

# Neither run takes an RL step: the claims are about the policy a run starts from (its step 0 reference) and its
# first evaluation, which both runs make before any step. One SFT batch of all 4 trajectories: both warm-start
# steps pad to the same length, so the SFT step compiles once. The second run's evaluations reuse the first's
# programs (same model, same shapes, same process).
RUN = SMALL + "TrainConfig.steps = 0\n"
WARM = RUN + WARM_START_TURNS + "WarmStartConfig.steps = 2\nWarmStartConfig.num_trajectories = 4\nWarmStartConfig.batch_size = 4\n"


def _initial_params(run_dir):
    store = Checkpointer(CheckpointConfig(directory=str(run_dir / "reference"), async_save=False))
    try:
        return store.restore_params(0)
    finally:
        store.close()


@pytest.fixture(scope="module")
def warm_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("init_from")
    (root / "warm.gin").write_text(WARM)
    assert train_cli.run_train([str(root / "warm.gin")], [], str(root / "warm"), progress=False) == 0
    return root


def test_a_run_started_from_another_starts_from_its_warm_started_params_without_a_warm_start(warm_run):
    gin = warm_run / "reuse.gin"
    gin.write_text(RUN)
    lines = []
    config = parse([str(gin)], [f"TrainConfig.init_from = {str(warm_run / 'warm')!r}"])
    summary = train(config, warm_run / "reuse", progress=False, log=lines.append)
    first, second = _initial_params(warm_run / "warm"), _initial_params(warm_run / "reuse")
    for a, b in zip(jax.tree_util.tree_leaves(first), jax.tree_util.tree_leaves(second), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert "warm_start" not in summary["seconds"] and "before" not in summary["evaluations"]
    assert any("initial policy from" in line for line in lines)
    warm = json.loads((warm_run / "warm" / "summary.json").read_text())
    # the same policy on the same held-out tasks: the same greedy accuracy as the warm run's own evaluation
    assert summary["evaluations"]["initial"]["accuracy"] == warm["evaluations"]["initial"]["accuracy"]


def test_init_from_a_directory_without_a_run_fails_before_compute_and_creates_nothing(tmp_path):
    gin = tmp_path / "s.gin"
    gin.write_text(SMALL)
    config = parse([str(gin)], [f"TrainConfig.init_from = {str(tmp_path / 'nothing')!r}"])
    with pytest.raises(FileNotFoundError, match="TrainConfig.init_from.*no initial policy"):
        train(config, tmp_path / "run", progress=False, log=lambda _line: None)
    assert not (tmp_path / "nothing").exists() and not (tmp_path / "run" / "checkpoints").exists()


def test_init_from_a_run_of_another_model_names_the_binding(warm_run, tmp_path):
    gin = tmp_path / "wide.gin"
    gin.write_text(SMALL + "model_preset.hidden_size = 48\n")
    config = parse([str(gin)], [f"TrainConfig.init_from = {str(warm_run / 'warm')!r}"])
    with pytest.raises(ValueError, match="TrainConfig.init_from.*not this run's model"):
        train(config, tmp_path / "run", progress=False, log=lambda _line: None)
