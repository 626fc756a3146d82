"""`trace-jax eval` on the run's mesh (trace_jax/rl/loop.py `evaluate_run`): on 8 fake CPU devices the policy is
restored onto the mesh the run recorded (or the one `--mesh` names) and placed there as `train` places it, and the
evaluation gives the same greedy episodes as on one device."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from trace_jax.cli import main
from trace_jax.rl import evaluate as evaluate_lib
from trace_jax.rl.gin_setup import parse
from trace_jax.rl.loop import evaluate_run, train
from trace_jax.train.config import MeshConfig, TrainConfigError

from tests.rl.test_mesh_step import GIN

pytestmark = pytest.mark.slow  # a 0-step run and two evaluations (~25 s of CPU)
Q_PROJ = ("layers", "attn", "q_proj")  # [layers, embed 32, heads 2, head_dim 16]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run trained (0 RL steps: its step-0 checkpoint is the initial policy) on `fsdp=4, tensor=2`."""
    root = tmp_path_factory.mktemp("eval_mesh")
    gin = root / "run.gin"
    gin.write_text(GIN + "TrainConfig.steps = 0\nTrainConfig.receipts = 0\nEvalConfig.num_tasks = 2\n"
                   "MeshConfig.fsdp = 4\nMeshConfig.tensor = 2\n")
    train(parse([str(gin)]), root / "run", progress=False, log=lambda _line: None)
    return root / "run"


def _recorded_eval(run_dir, monkeypatch, mesh=None):
    """`evaluate_run`, recording the tokens of every episode and the layout of the params it rolled out with."""
    seen = {"tokens": [], "q_proj": []}
    run_episodes = evaluate_lib.run_episodes

    def recording(model_config, params, *args, **kwargs):
        result = run_episodes(model_config, params, *args, **kwargs)
        seen["tokens"].append(np.asarray(result.batch.tokens))
        q_proj = params[Q_PROJ[0]][Q_PROJ[1]][Q_PROJ[2]]
        seen["q_proj"].append((q_proj.sharding.mesh, tuple(q_proj.sharding.shard_shape(q_proj.shape))))
        return result

    monkeypatch.setattr(evaluate_lib, "run_episodes", recording)
    lines: list[str] = []
    results = evaluate_run(run_dir, mesh=mesh, log=lines.append)  # {set: result}; the run has one set
    assert list(results) == ["heldout"]
    return results["heldout"], seen, lines


@pytest.fixture(scope="module")
def evaluations(run_dir):
    with pytest.MonkeyPatch.context() as patch:
        on_mesh = _recorded_eval(run_dir, patch)
    with pytest.MonkeyPatch.context() as patch:
        one_device = _recorded_eval(run_dir, patch, MeshConfig.from_flag("devices=1"))
    return {"mesh": on_mesh, "one_device": one_device}


def test_eval_restores_the_policy_onto_the_recorded_mesh_in_the_rollout_layout(evaluations):
    _, seen, lines = evaluations["mesh"]
    for mesh, shard in seen["q_proj"]:
        assert dict(mesh.shape) == {"data": 1, "fsdp": 4, "tensor": 2, "expert": 1}
        assert shard == (1, 32, 2 // 2, 16)  # whole over fsdp, heads over tensor
    assert "mesh data=1 fsdp=4 tensor=2 expert=1 (8 cpu devices, 1 process)" in lines[0]


def test_a_mesh_flag_replaces_the_recorded_mesh(evaluations):
    _, seen, lines = evaluations["one_device"]
    for mesh, shard in seen["q_proj"]:
        assert list(mesh.devices.flat) == [jax.devices()[0]] and shard == (1, 32, 2, 16)
    assert "(1 cpu devices, 1 process)" in lines[0]


def test_eval_on_the_mesh_gives_the_episodes_and_figures_of_one_device(evaluations):
    (on_mesh, mesh_seen, _), (one, one_seen, _) = evaluations["mesh"], evaluations["one_device"]
    assert len(mesh_seen["tokens"]) == len(one_seen["tokens"]) >= 1
    for tokens, expected in zip(mesh_seen["tokens"], one_seen["tokens"]):
        np.testing.assert_array_equal(tokens, expected)
    assert (on_mesh.correct, on_mesh.task_ids, on_mesh.statuses) == (one.correct, one.task_ids, one.statuses)
    assert (on_mesh.accuracy, on_mesh.mean_reward, on_mesh.tool_calls_per_episode, on_mesh.turns_per_episode) == (
        one.accuracy, one.mean_reward, one.tool_calls_per_episode, one.turns_per_episode)


def test_the_eval_command_takes_a_mesh_and_writes_its_result(run_dir, evaluations):
    assert main(["eval", "--run-dir", str(run_dir), "--mesh", "devices=1"]) == 0
    written = json.loads((run_dir / "eval_step0.json").read_text())
    assert written["correct"] == list(evaluations["one_device"][0].correct)


def test_a_mesh_that_does_not_fit_the_devices_fails_naming_the_flag(run_dir, capsys):
    assert main(["eval", "--run-dir", str(run_dir), "--mesh", "fsdp=3"]) == 2
    assert "--mesh sets the mesh" in capsys.readouterr().err


def test_a_malformed_mesh_flag_names_the_expected_form():
    with pytest.raises(TrainConfigError, match=r"--mesh 'model=4': expected AXIS=SIZE"):
        MeshConfig.from_flag("model=4")
    with pytest.raises(TrainConfigError, match=r"--mesh 'fsdp=0'.*MeshConfig.fsdp"):
        MeshConfig.from_flag("fsdp=0")
    assert MeshConfig.from_flag("fsdp=-1,tensor=2") == MeshConfig(data=1, fsdp=-1, tensor=2, expert=1)
