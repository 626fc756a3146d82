"""launch/gpu/single_host.sh and slurm.sh: the exact commands and batch scripts of --dry-run, the mesh checked against
nodes x GPUs before anything is submitted, and a generated batch script run under a fake srun, which shows that every
task gets the trainer's arguments intact and the jax.distributed environment of its process layout (one process
per node by default, one per GPU with --processes gpu)."""

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
QWEN3_4B = ["--gin-file", "configs/qwen3_4b.gin", "--gin-param", "TrainConfig.checkpoint = '/shared/models/Qwen3-4B'"]


def test_single_host_dry_run_runs_one_process_on_the_named_gpus(launch):
    result = launch("gpu/single_host.sh", "--gpus", "4", "--python", "python3", *QWEN3_4B, "--run-dir", "runs/q4b",
                    "--dry-run")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "env CUDA_VISIBLE_DEVICES=0,1,2,3 python3 -m trace_jax.cli train --gin-file configs/qwen3_4b.gin --gin-param "
        "\"TrainConfig.checkpoint = '/shared/models/Qwen3-4B'\" --run-dir runs/q4b"]
    assert "mesh data=1 fsdp=2 tensor=2 expert=1" in result.stderr


def test_single_host_refuses_a_mesh_that_does_not_fit_its_gpus(launch):
    result = launch("gpu/single_host.sh", "--gpus", "6", "--gin-file", "configs/qwen3_30b_a3b.gin",
                    "--run-dir", "runs/q30", "--dry-run")
    assert result.returncode == 2 and result.stdout == ""
    assert "the mesh does not fit 6 GPUs" in result.stderr and "MeshConfig.expert = 2" in result.stderr


def slurm_dry_run(launch, *args):
    result = launch("gpu/slurm.sh", "--nodes", "2", "--gpus-per-node", "8", "--python", "/opt/venv/bin/python",
                    *QWEN3_4B, "--run-dir", "/shared/runs/q4b", "--partition", "gpu", "--time", "24:00:00",
                    *args, "--dry-run")
    assert result.returncode == 0, result.stderr
    return re.sub(r"slurm-\d{8}-\d{6}\.sbatch", "slurm-TIME.sbatch", result.stdout).splitlines()


HEADER = ["# the batch script (/shared/runs/q4b/launch/slurm-TIME.sbatch):", "#!/bin/bash",
          "#SBATCH --job-name=trace-jax", "#SBATCH --nodes=2"]
TRAIN = ("/opt/venv/bin/python -m trace_jax.cli train --gin-file configs/qwen3_4b.gin --gin-param \"TrainConfig."
         "checkpoint = '/shared/models/Qwen3-4B'\"")


def test_slurm_gpu_processes_run_one_task_per_gpu_and_let_jax_read_slurm(launch):
    assert slurm_dry_run(launch, "--processes", "gpu") == HEADER + [
        "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8", f"#SBATCH --chdir={REPO}",
        "#SBATCH --output=/shared/runs/q4b/logs/slurm-%j.out", "#SBATCH --signal=TERM@300",
        "#SBATCH --partition=gpu", "#SBATCH --time=24:00:00", "set -euo pipefail", "mkdir -p /shared/runs/q4b/logs",
        f"srun --kill-on-bad-exit=1 --output=/shared/runs/q4b/logs/slurm-%j-%t.log {TRAIN} --gin-param "
        "'DistributedConfig.mode = \"auto\"' --run-dir /shared/runs/q4b --no-progress",
        "# submitted with:", "sbatch /shared/runs/q4b/launch/slurm-TIME.sbatch"]


def test_slurm_runs_one_process_per_node_by_default_with_the_trace_jax_coordinator_variables(launch):
    assert slurm_dry_run(launch, "--port", "1234", "--requeue") == HEADER + [
        "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8", f"#SBATCH --chdir={REPO}",
        "#SBATCH --output=/shared/runs/q4b/logs/slurm-%j.out", "#SBATCH --signal=TERM@300",
        "#SBATCH --partition=gpu", "#SBATCH --time=24:00:00", "#SBATCH --requeue", "set -euo pipefail",
        "mkdir -p /shared/runs/q4b/logs",
        'TRACE_JAX_COORDINATOR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p):1234"',
        "export TRACE_JAX_COORDINATOR TRACE_JAX_NUM_PROCESSES=2",
        "srun --kill-on-bad-exit=1 --output=/shared/runs/q4b/logs/slurm-%j-%t.log bash -c "
        "'TRACE_JAX_PROCESS_ID=$SLURM_PROCID exec \"$@\"' trace-jax " + TRAIN + " --run-dir /shared/runs/q4b "
        "--no-progress",
        "# submitted with:", "sbatch /shared/runs/q4b/launch/slurm-TIME.sbatch"]


@pytest.mark.parametrize("older, processes", [("env", "node"), ("auto", "gpu")])
def test_the_older_mode_flag_still_chooses_the_processes(launch, older, processes):
    assert slurm_dry_run(launch, "--mode", older) == slurm_dry_run(launch, "--processes", processes)


@pytest.mark.parametrize("args, message", [
    (["--nodes", "0"], "--nodes must be an integer >= 1"),
    (["--processes", "mpi"], "--processes must be 'node'"),
    (["--mode", "mpi"], "--mode must be 'env'"),
    (["--sbatch-arg", "qos=high"], "give a long sbatch option"),
    (["--gpus-per-node", "3"], "the mesh does not fit 6 GPUs"),
])
def test_slurm_bad_arguments_are_named_before_anything_is_submitted(launch, fake_gcloud, args, message):
    base = {"--nodes": "2", "--gpus-per-node": "8", "--run-dir": "/shared/r"}
    for flag in args[::2]:
        base.pop(flag, None)
    argv = [x for kv in base.items() for x in kv] + ["--gin-file", "configs/qwen3_30b_a3b.gin"] + args
    result = launch("gpu/slurm.sh", *argv)
    assert result.returncode == 2 and message in result.stderr
    assert fake_gcloud.calls() == []  # sbatch (the fake) never called


FAKE_SRUN = """#!/usr/bin/env bash
# srun stand-in: runs the command once per task of a 2-node, 1-task-per-node job, each into its --output file.
output=""
while [[ $1 == --* ]]; do [[ $1 == --output=* ]] && output=${1#--output=}; shift; done
for task in 0 1; do
  SLURM_PROCID=$task "$@" > "${output//%t/$task}" 2>&1 || exit 1
done
"""


def test_a_per_node_batch_script_gives_each_task_its_process_id_and_the_same_train_arguments(launch, fake_gcloud,
                                                                                              tmp_path):
    trainer = tmp_path / "python"
    trainer.write_text('#!/usr/bin/env bash\necho "$TRACE_JAX_COORDINATOR $TRACE_JAX_NUM_PROCESSES '
                       '$TRACE_JAX_PROCESS_ID"\nprintf "%s\\n" "$@"\n', encoding="utf-8")
    trainer.chmod(0o755)
    run_dir = tmp_path / "shared" / "run"
    result = launch("gpu/slurm.sh", "--nodes", "2", "--gpus-per-node", "1", "--python", str(trainer),
                    "--gin-param", "TrainConfig.steps = 3", "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    (sbatch_call,) = fake_gcloud.calls()
    script = Path(sbatch_call[0])
    assert script.parent == run_dir / "launch"
    for name, text in (("srun", FAKE_SRUN), ("scontrol", "#!/usr/bin/env bash\necho node-a\necho node-b\n")):
        (fake_gcloud.bin / name).write_text(text, encoding="utf-8")
        (fake_gcloud.bin / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{fake_gcloud.bin}{os.pathsep}{os.environ['PATH']}",
           "SLURM_JOB_NODELIST": "node-[a-b]"}
    subprocess.run(["bash", str(script)], check=True, env=env, cwd=tmp_path, timeout=60)
    for task in (0, 1):
        lines = (run_dir / "logs" / f"slurm-%j-{task}.log").read_text(encoding="utf-8").splitlines()
        assert lines == [f"node-a:29500 2 {task}", "-m", "trace_jax.cli", "train", "--gin-param",
                         "TrainConfig.steps = 3", "--run-dir", str(run_dir), "--no-progress"]


def test_single_host_counts_the_gpus_nvidia_smi_lists_when_not_told(launch, fake_gcloud):
    smi = fake_gcloud.bin / "nvidia-smi"
    smi.write_text("#!/usr/bin/env bash\necho 'GPU 0: NVIDIA H100 (UUID: a)'\necho 'GPU 1: NVIDIA H100 (UUID: b)'\n",
                   encoding="utf-8")
    smi.chmod(0o755)
    result = launch("gpu/single_host.sh", "--python", "python3", "--run-dir", "runs/t", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["env CUDA_VISIBLE_DEVICES=0,1 python3 -m trace_jax.cli train --run-dir runs/t"]


@pytest.mark.parametrize("spelling", [("--run_dir", "--gin_file", "--gin_param"), ("--run-dir", "--gin-file",
                                                                                   "--gin-param")])
def test_launchers_take_both_flag_spellings_and_pass_kebab_case_on(launch, spelling):
    run_dir, gin_file, gin_param = spelling
    result = launch("gpu/single_host.sh", "--gpus", "1", "--python", "python3", run_dir, "runs/t", gin_file,
                    "configs/tiny.gin", gin_param, "TrainConfig.steps = 1", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["env CUDA_VISIBLE_DEVICES=0 python3 -m trace_jax.cli train --gin-file "
                                          "configs/tiny.gin --gin-param 'TrainConfig.steps = 1' --run-dir runs/t"]
