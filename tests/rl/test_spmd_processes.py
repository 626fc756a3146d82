"""The rollout and the reference scoring as one SPMD program over a mesh that spans processes: two local processes
(jax.distributed over 127.0.0.1, gloo collectives, 4 fake CPU devices each) with one mesh axis over both, fsdp=8 or
expert=8, hold per device the params and cache bytes one process with 8 devices holds on the same mesh (spanning
processes adds no copy: with expert=8 each device holds 1/8 of the experts), dispatch only programs the run's
registry lists (what `trace-jax plan` lowers), and two RL steps give the one process's rollout tokens, rewards,
reference scores and losses (tests/rl/multihost_spmd.py runs the steps). The rollout engine runs in lock step over
the processes; fsdp8 also checks the engine alone on tasks split unevenly, with tool latencies that differ per
process and, on two processes, a pool small enough that one process's rows are paused and recomputed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.multiprocess import launch, wait_all
from tests.rl import multihost_spmd

REPO = Path(__file__).resolve().parents[2]
HELPER = Path(__file__).with_name("multihost_spmd.py")
pytestmark = pytest.mark.slow  # three processes compile the step's programs on 2 busy cores (~1-2 min a setting)


@pytest.fixture(scope="module", params=sorted(multihost_spmd.SETTINGS))
def runs(request, tmp_path_factory):
    """(two processes x 4 devices, one process x 8 devices) of one setting, run side by side."""
    multi_dir = tmp_path_factory.mktemp(f"{request.param}_two")
    single_dir = tmp_path_factory.mktemp(f"{request.param}_one")
    procs = launch([str(HELPER), str(multi_dir), request.param], 2, REPO, multi_dir)
    try:
        single = multihost_spmd.run_steps(single_dir, request.param)  # the same 8 devices (conftest)
    finally:
        wait_all(procs, multi_dir)
    return request.param, json.loads((multi_dir / "result.json").read_text()), single


def test_spanning_processes_adds_no_copy_of_params_or_cache(runs):
    setting, multi, single = runs
    assert (multi["processes"], single["processes"]) == (2, 1)
    for name in ("rollout_params", "cache", "reference", "rollout_experts", "reference_experts"):
        if single["bytes"][name] == 0:  # a dense model has no experts
            continue
        assert multi["bytes"][name] <= 1.1 * single["bytes"][name], (setting, name, multi["bytes"], single["bytes"])
        assert multi["bytes"][name] >= 0.9 * single["bytes"][name], (setting, name, multi["bytes"], single["bytes"])


def test_the_paged_pool_is_split_by_process_each_holding_its_own_part_on_its_devices(runs):
    """Process 0's rows hold pages of its part, [0, pages / 2), which its 4 devices hold (pages over fsdp)."""
    setting, multi, single = runs
    if multi["engine_kind"] != "paged":
        assert multi["pool"] == {} and single["pool"] == {}
        return
    assert multi["pool"]["pages"] == single["pool"]["pages"]
    assert multi["pool"]["here"] == [0, multi["pool"]["pages"] // 2]
    assert single["pool"]["here"] == [0, single["pool"]["pages"]]


def test_with_expert8_each_device_holds_an_eighth_of_the_experts(runs):
    setting, multi, _ = runs
    for phase in ("rollout", "reference"):
        whole = multi["bytes"][f"{phase}_experts_whole"]
        if setting == "expert8":
            assert whole > 0 and multi["bytes"][f"{phase}_experts"] * 8 == whole, (phase, multi["bytes"])
        else:  # the dense model has no expert weights
            assert whole == 0 and multi["bytes"][f"{phase}_experts"] == 0


def test_every_program_the_processes_dispatch_is_a_registry_entry_at_the_global_shapes(runs):
    _, multi, single = runs
    assert multi["unlisted"] == [] and single["unlisted"] == []
    assert multi["dispatched"] == single["dispatched"]
    rollout = ({"paged_init", "paged_prefill", "paged_decode"} if multi["engine_kind"] == "paged" else
               {"init", "prefill_rows", "decode", "append"})
    assert rollout | {"score", "update"} <= set(multi["dispatched"])


def test_two_rl_steps_give_the_one_processs_tokens_log_probs_rewards_scores_and_loss(runs):
    _, multi, single = runs
    for step in range(multihost_spmd.STEPS):
        np.testing.assert_array_equal(multi["tokens"][step], single["tokens"][step], err_msg=f"step {step}")
        np.testing.assert_array_equal(multi["rewards"][step], single["rewards"][step], err_msg=f"step {step}")
        np.testing.assert_allclose(multi["logprobs"][step], single["logprobs"][step], atol=1e-5, rtol=0)
        np.testing.assert_allclose(multi["scores"][step], single["scores"][step], atol=1e-5, rtol=0)
    np.testing.assert_allclose(multi["losses"], single["losses"], atol=1e-5, rtol=0)


def test_an_evaluation_split_unevenly_over_the_processes_gives_the_one_processs_outcomes(runs):
    setting, multi, single = runs
    if setting == "fsdp8":  # evaluated in that setting only (its programs compile once for the module)
        assert multi["evaluation"] == single["evaluation"]
        assert multi["evaluation"]["num_tasks"] == 3
    else:
        assert "evaluation" not in multi and "evaluation" not in single


def test_the_paged_engine_in_lock_step_gives_the_one_processs_episodes_with_uneven_tasks_and_tool_latencies(runs):
    """fsdp8 runs the paged engine: 5 tasks (4 on process 0, whose tools are slow, 1 on process 1), sampled, with
    scripted tool calls (decoded in blocks of 8 steps a dispatch, rows stopping mid-block), and on two processes a
    pool of one row of max_context a batch shard, so process 0 pauses and recomputes rows while process 1 does not;
    the processes dispatch as many programs (padding where they have nothing to run) and give the rows one process
    gives with a pool that holds every row."""
    setting, multi, single = runs
    if setting != "fsdp8":
        assert "engine" not in multi
        return
    two, one = multi["engine"], single["engine"]
    for name in ("tokens", "status", "lengths", "loss_mask", "tool_calls"):
        np.testing.assert_array_equal(two[name], one[name], err_msg=name)
    np.testing.assert_allclose(two["sampler_logprobs"], one["sampler_logprobs"], atol=1e-5, rtol=0)
    assert len(one["tokens"]) == multihost_spmd.ENGINE_TASKS * 2  # G = 2
    assert 0 < sum(one["tool_calls"]) < len(one["tool_calls"])  # some rows ran a tool call, some did not
    (decode0, prefill0, steps0, useful0, paused0, held0), (decode1, prefill1, steps1, useful1, paused1, _) = \
        two["dispatches"]
    assert (decode0, prefill0, steps0) == (decode1, prefill1, steps1)  # lock step: the same dispatches and shapes
    assert useful1 < useful0  # process 1 (one task, fast tools) ran padding while process 0 still had rows
    # process 0's rows outgrew its part of the pool: paused and recomputed, none lost or altered (above)
    assert paused0 > 0 and paused1 == 0 and held0 <= multihost_spmd.ENGINE_POOL_ROWS * 8  # 8 pages a row
    assert one["dispatches"][0][4] == 0  # one process, a pool of every row: nothing preempted
