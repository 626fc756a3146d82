"""The multi-host runtime: two local processes (jax.distributed over 127.0.0.1, gloo collectives, 4 fake CPU devices
each) train like one process with 8 devices, and what they checkpoint restores in one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from tests.multiprocess import free_port, launch, wait_all
from trace_jax import models
from trace_jax.train import distributed
from trace_jax.train.distributed import DistributedConfig

REPO = Path(__file__).resolve().parents[2]
HELPER = Path(__file__).with_name("multihost_step.py")


def _flat(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


# ------------------------------------------------------------------------------------------------ config
def test_the_environment_overrides_the_fields_and_implies_explicit():
    config = distributed.from_environment(DistributedConfig(), {"TRACE_JAX_COORDINATOR": "10.0.0.2:8476",
                                                                "TRACE_JAX_NUM_PROCESSES": "4",
                                                                "TRACE_JAX_PROCESS_ID": "3"})
    assert config == DistributedConfig(mode="explicit", coordinator_address="10.0.0.2:8476", num_processes=4,
                                       process_id=3)


def test_without_the_environment_the_config_is_unchanged():
    config = DistributedConfig(mode="auto")
    assert distributed.from_environment(config, {"PATH": "/bin"}) is config


def test_a_process_id_without_a_coordinator_names_the_missing_variable():
    with pytest.raises(ValueError, match="TRACE_JAX_COORDINATOR"):
        distributed.from_environment(DistributedConfig(), {"TRACE_JAX_NUM_PROCESSES": "2",
                                                           "TRACE_JAX_PROCESS_ID": "1"})


def test_a_non_integer_process_count_in_the_environment_is_a_clear_error():
    with pytest.raises(ValueError, match="TRACE_JAX_NUM_PROCESSES='two' must be an integer"):
        distributed.from_environment(DistributedConfig(), {"TRACE_JAX_COORDINATOR": "h:1",
                                                           "TRACE_JAX_NUM_PROCESSES": "two"})


@pytest.mark.parametrize("fields, message", [
    ({"mode": "slurm"}, "mode must be one of"),
    ({"mode": "explicit", "coordinator_address": "localhost", "num_processes": 2}, "must be 'host:port'"),
    ({"mode": "explicit", "coordinator_address": "h:1", "num_processes": 2, "process_id": 2},
     r"process_id must be in \[0, num_processes = 2\)"),
    ({"local_device_ids": (-1,)}, "local_device_ids"),
    ({"initialization_timeout_s": 0}, "initialization_timeout_s"),
])
def test_invalid_fields_are_rejected_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        DistributedConfig(**fields)


def test_gin_binds_the_distributed_config(tmp_path):
    from trace_jax.rl.gin_setup import parse

    config = parse(["configs/tiny.gin"], ["DistributedConfig.mode = 'auto'",
                                          "DistributedConfig.local_device_ids = [0, 1]"])
    assert config.distributed == DistributedConfig(mode="auto", local_device_ids=(0, 1))


def test_mode_off_initialises_nothing_and_reports_one_process():
    assert distributed.initialize(DistributedConfig(), environ={}, log=None) == (0, 1)
    assert not jax.distributed.is_initialized()


def test_each_process_gets_a_contiguous_equal_share_in_process_order():
    shares = [distributed.process_share(8, process_index=i, process_count=4) for i in range(4)]
    assert shares == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]
    assert distributed.process_share(6) == slice(0, 6)  # one process (this one) holds everything


def test_a_count_the_processes_cannot_share_evenly_is_a_clear_error():
    with pytest.raises(ValueError, match="6 prompts cannot be split evenly over 4 processes"):
        distributed.process_share(6, what="prompts", process_index=0, process_count=4)


def test_parsing_a_config_leaves_jax_free_to_join_a_multi_process_run(tmp_path):
    """`trace-jax train` parses the gin config before `distributed.initialize`: nothing that parsing imports may
    initialise JAX's backend (bm25s runs a JAX computation when imported, so it is imported on first use)."""
    script = ("from trace_jax.rl.gin_setup import parse\n"
              "from trace_jax.train import distributed\n"
              "config = parse(['configs/tiny.gin'])\n"
              f"print(distributed.initialize(config.distributed, environ={{'TRACE_JAX_COORDINATOR': "
              f"'127.0.0.1:{free_port()}', 'TRACE_JAX_NUM_PROCESSES': '1', 'TRACE_JAX_PROCESS_ID': '0'}}))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "distributed: process 0 of 1 via 127.0.0.1" in done.stdout and "(0, 1)" in done.stdout


def test_a_multi_process_train_without_run_dir_is_a_clear_error(monkeypatch, capsys):
    from trace_jax.rl.cli import run_train

    monkeypatch.setattr(distributed, "initialize", lambda config: (0, 2))
    assert run_train(["configs/tiny.gin"], [], None) == 2
    assert "a multi-process run needs --run-dir" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ two processes
@pytest.mark.slow
def test_two_processes_train_like_one_and_their_checkpoint_restores_in_one_process(tmp_path):
    from tests.train import multihost_step

    from trace_jax.train.checkpoint import Checkpointer, abstract_train_state
    from trace_jax.train.config import CheckpointConfig

    multi_dir, single_dir = tmp_path / "two_processes", tmp_path / "one_process"
    multi_dir.mkdir()
    procs = launch([str(HELPER), str(multi_dir)], 2, REPO, multi_dir)
    try:
        single = multihost_step.run_steps(single_dir)  # meanwhile: one process, the same 8 devices (conftest)
    finally:
        wait_all(procs, multi_dir)
    assert single["processes"] == 1
    logs = [(multi_dir / f"process{i}.log").read_text() for i in range(2)]
    assert "distributed: process 0 of 2" in logs[0] and "distributed: process 1 of 2" in logs[1]

    multi = np.load(multi_dir / "result.npz")
    assert multi["restores_on_the_mesh"] and single["restores_on_the_mesh"]
    assert multi["refuses_too_few_rows"]  # 4 rows on 8 devices of 2 processes cannot be a global batch
    np.testing.assert_allclose(multi["losses"], single["losses"], rtol=1e-5, atol=1e-6)
    single_params = _flat(single["params"])
    assert set(single_params) == set(multi.files) - {"losses", "restores_on_the_mesh", "refuses_too_few_rows"}
    initial = _flat(models.init_params(multihost_step.setup()[0], jax.random.PRNGKey(0), dtype="float32"))
    assert max(float(np.abs(value - initial[name]).max()) for name, value in single_params.items()) > 1e-4
    for name, value in single_params.items():
        # 3 Adam steps at lr 1e-4 from gradients all-reduced in another order (gloo): float32 round-off only
        np.testing.assert_allclose(multi[name], value, atol=1e-5, rtol=0, err_msg=name)

    model_config, optimizer, _ = multihost_step.setup()
    with Checkpointer(CheckpointConfig(directory=str(multi_dir / "checkpoints"), async_save=False)) as store:
        assert store.latest_step() == multihost_step.STEPS
        state, host = store.restore(abstract_train_state(model_config, optimizer))
    np.testing.assert_allclose(host["losses"], multi["losses"], rtol=0, atol=0)
    for name, value in _flat(state.params).items():
        np.testing.assert_array_equal(value, multi[name], err_msg=name)


LOOP_STEPS = 2


@pytest.mark.slow
def test_two_processes_run_the_rl_loop_and_only_process_0_writes_the_record(tmp_path):
    """`trace-jax train` on two processes: each rolls out 2 of the step's 4 prompts on its block of the mesh and
    evaluates 4 of the 8 held-out tasks, the update runs on the mesh over both, process 0 alone logs and writes
    metrics and summary (its evaluations the one process's, task by task), the checkpoint restores
    in one process (the whole state onto a target, and the params alone as `trace-jax eval` reads them), and one
    process of 8 devices gives the same metrics and params within 1e-5."""
    from tests.rl.test_rl_pipeline import SMALL
    from trace_jax.train.checkpoint import Checkpointer, abstract_train_state
    from trace_jax.train.config import CheckpointConfig
    from trace_jax.rl.gin_setup import parse
    from trace_jax.rl.loop import build_environment
    from trace_jax.rl.metrics import read_metrics
    from trace_jax.train.optimizer import make_optimizer

    from trace_jax.rl.loop import train

    gin_file = tmp_path / "two.gin"
    # mini-batches gather rows across the processes; greedy rollouts are the same tokens whichever process (and
    # whichever key) samples a row, so one process of 8 devices must train the same. 8 held-out tasks, greedy like
    # the rollouts: each process evaluates its 4 (and the one process all 8), the batch shape of its rollouts, so
    # the evaluations reuse the rollouts' decode and append programs; one tool call an episode: fewer decode and
    # append shapes to compile.
    gin_file.write_text(SMALL + f"TrainConfig.prompts_per_step = 4\nTrainConfig.steps = {LOOP_STEPS}\n"
                        "UpdateConfig.mini_batches = 2\nSamplingConfig.greedy = True\n"
                        "DataConfig.num_eval_tasks = 8\nEvalConfig.num_tasks = 8\nRolloutConfig.max_turns = 1\n")
    run_dir = tmp_path / "run"
    procs = launch(["-m", "trace_jax.cli", "train", "--gin-file", str(gin_file), "--run-dir", str(run_dir),
                     "--no-progress"], 2, REPO, tmp_path)
    try:  # meanwhile: one process, the same 8 devices (conftest)
        train(parse([str(gin_file)]), tmp_path / "one_process", progress=False, log=lambda _line: None)
    finally:
        wait_all(procs, tmp_path)
    logs = [(tmp_path / f"process{i}.log").read_text() for i in range(2)]
    assert "run " in logs[0] and "after RL" in logs[0]
    assert "distributed: process 1 of 2" in logs[1] and "eval (" not in logs[1]

    records = [r for r in read_metrics(run_dir) if "reward" in r]
    assert [r["step"] for r in records] == list(range(1, LOOP_STEPS + 1))  # one writer: no duplicate lines
    # the evaluations, split over the processes, give the one process's figures and per-task outcomes
    summaries = [json.loads((d / "summary.json").read_text()) for d in (run_dir, tmp_path / "one_process")]
    assert summaries[0]["outcomes"] == summaries[1]["outcomes"]
    assert [len(sets["heldout"]) for sets in summaries[0]["outcomes"].values()] == [8, 8]  # initial, final
    assert summaries[0]["eval_sets"] == summaries[1]["eval_sets"]
    assert all(np.isfinite(r["loss"]) and r["updates"] == 2 for r in records)
    assert (run_dir / "summary.json").exists()
    single = [r for r in read_metrics(tmp_path / "one_process") if "reward" in r]
    for name in ("loss", "reward", "length", "credit/mean_abs_token_advantage", "grad_norm"):
        np.testing.assert_allclose([r[name] for r in records], [r[name] for r in single], atol=1e-5, rtol=1e-5,
                                   err_msg=name)

    config = parse([str(gin_file)])
    model_config = build_environment(config, tmp_path / "env", load_params=False).model_config
    with Checkpointer(CheckpointConfig(directory=str(run_dir / "checkpoints"), async_save=False)) as store:
        assert store.latest_step() == LOOP_STEPS
        state, host = store.restore(abstract_train_state(model_config, make_optimizer(config.optimizer)))
        params = store.restore_params()  # what `trace-jax eval` and the HF export read, here on another topology
    assert int(state.step) == LOOP_STEPS
    for name, value in _flat(params).items():
        np.testing.assert_array_equal(value, _flat(state.params)[name], err_msg=name)
    with Checkpointer(CheckpointConfig(directory=str(tmp_path / "one_process" / "checkpoints"),
                                       async_save=False)) as store:
        single_params = _flat(store.restore_params(LOOP_STEPS))
    for name, value in _flat(params).items():
        np.testing.assert_allclose(value, single_params[name], atol=1e-5, rtol=0, err_msg=name)
    assert host["data_position"] == 4 * LOOP_STEPS  # every prompt of every step, across both processes
    assert all(np.isfinite(leaf).all() for leaf in jax.tree_util.tree_leaves(state.params))


@pytest.mark.slow
def test_two_processes_split_the_evaluation_and_both_get_the_one_process_result(tmp_path):
    """`evaluate` on two processes: each runs only its part of the 5 tasks (2 and 3, greedy and sampled) and both
    end with the result of one process evaluating every task: figures, pass@k and every task's outcome (episodes
    scripted by task; tests/rl/test_loop_evaluate.py checks that unscripted samples do not depend on the chunk)."""
    from tests.train import multihost_eval

    multi_dir, single_dir = tmp_path / "two_processes", tmp_path / "one_process"
    multi_dir.mkdir()
    single_dir.mkdir()
    procs = launch([str(REPO / "tests" / "train" / "multihost_eval.py"), str(multi_dir)], 2, REPO, multi_dir)
    try:
        single = multihost_eval.run_eval(single_dir)  # meanwhile: one process
    finally:
        wait_all(procs, multi_dir)
    records = [json.loads((multi_dir / f"process{i}.json").read_text()) for i in range(2)]
    assert single["processes"] == 1 and all(r["processes"] == 2 for r in records)
    # greedy, then sampled (2 samples a task, 4 tasks a chunk): process 1's sampled chunk is not one of the
    # one-process chunks, yet every task draws the same samples
    assert single["calls"] == [["q0", "q1", "q2", "q3", "q4"], ["q0", "q1", "q2", "q3"], ["q4"]]
    assert records[0]["calls"] == [["q0", "q1"]] * 2
    assert records[1]["calls"] == [["q2", "q3", "q4"]] * 2
    for record in records:
        assert record["result"] == single["result"]
    assert single["result"]["task_ids"] == ["q0", "q1", "q2", "q3", "q4"]
    outcomes = single["result"]["outcomes"]
    assert [o["task_id"] for o in outcomes] == single["result"]["task_ids"]
    assert [(o["correct"], o["tool_calls"], o["status"], o["samples_correct"]) for o in outcomes] == [
        (True, 1, "answered", 0), (False, 0, "answered", 1), (True, 0, "answered", 2), (False, 2, "max_turns", 0),
        (False, 0, "answered", 1)]
    assert single["result"]["pass_k"] == {"1": 0.4, "2": 0.6}  # pass@1: mean c/2; pass@2: share with c >= 1
