"""launch/check.py, the launchers' pre-flight: slice names, the config's mesh against the chip count, run directories,
and the pinned dependencies the workers install. Run in-process (the scripts call it as a subprocess)."""

import importlib.util
import re
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("launch_check", REPO / "launch" / "check.py")
check = importlib.util.module_from_spec(_spec)
sys.modules["launch_check"] = check  # dataclasses look their module up there
_spec.loader.exec_module(check)

QWEN3_4B = "TrainConfig.checkpoint = '/mnt/gcs/models/Qwen3-4B'"
QWEN3_30B = "TrainConfig.checkpoint = '/mnt/gcs/models/Qwen3-30B-A3B'"


def run_check(capsys, *argv):
    status = check.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def records(out: str) -> list[tuple[str, str]]:
    """check.py's output: NUL-terminated NAME, VALUE pairs (what launch/lib.sh's preflight reads)."""
    assert out == "" or out.endswith("\0"), repr(out)
    fields = out.split("\0")[:-1]
    assert len(fields) % 2 == 0, fields
    return list(zip(fields[0::2], fields[1::2]))


@pytest.mark.parametrize("name, chips, accelerator_type, runtime", [
    ("v5e:4x4", 16, "v5litepod-16", "v2-alpha-tpuv5-lite"),
    ("v5litepod-16", 16, "v5litepod-16", "v2-alpha-tpuv5-lite"),
    ("v5p:2x2x2", 8, "v5p-16", "v2-alpha-tpuv5"),
    ("v5p-8", 4, "v5p-8", "v2-alpha-tpuv5"),
    ("v6e:2x4", 8, "v6e-8", "v2-alpha-tpuv6e"),
    ("v4:2x2x1", 4, "v4-8", "tpu-ubuntu2204-base"),
])
def test_a_slice_named_by_shape_or_accelerator_type_gives_chips_type_and_image(name, chips, accelerator_type,
                                                                                 runtime):
    tpu_slice = check.parse_slice(name)
    assert (tpu_slice.chips, tpu_slice.accelerator_type, tpu_slice.generation.runtime_version) == (
        chips, accelerator_type, runtime)


@pytest.mark.parametrize("name, message", [
    ("v5e:3x3", "v5e has no 3x3 slice; supported shapes: 1x1, 2x2, 2x4, 4x4"),
    ("v5e:2x2x2", "v5e slices are 2D"),
    ("v7x:2x2", "unknown TPU generation 'v7x'"),
    ("v5p-7", "must be even (v5p-8 = 4 chips)"),
    ("tpu16", "is not a TPU slice; write GENERATION:SHAPE"),
])
def test_a_bad_slice_name_is_refused_with_the_accepted_forms(name, message):
    with pytest.raises(check.LaunchError, match=re.escape(message)):
        check.parse_slice(name)


def test_qwen3_4b_fills_a_v5e_4x4_with_tensor_2_and_fsdp_over_the_rest(capsys):
    status, out, _ = run_check(capsys, "tpu", "--topology", "v5e:4x4", "--run-dir", "/mnt/gcs/runs/q4b",
                               "--gin-file", "configs/qwen3_4b.gin", "--gin-param", QWEN3_4B)
    assert status == 0
    assert records(out) == [("ACCELERATOR_TYPE", "v5litepod-16"), ("RUNTIME_VERSION", "v2-alpha-tpuv5-lite"),
                            ("CHIPS", "16"), ("MESH", "data=1 fsdp=8 tensor=2 expert=1")]


def test_a_batch_the_mesh_cannot_split_is_a_warning_that_names_the_shards(capsys):
    # Qwen3-4B: 128 rows in 4 mini-batches of 8 micro-batches = 4 rows per micro-batch, over fsdp = 8 batch shards
    # (tensor = 2 on 16 chips).
    status, _, err = run_check(capsys, "tpu", "--topology", "v5e:4x4", "--run-dir", "/mnt/gcs/runs/q4b",
                               "--gin-file", "configs/qwen3_4b.gin", "--gin-param", QWEN3_4B)
    assert status == 0
    assert "a micro-batch holds 4 rows, not divisible by the 8 batch shards" in err


def test_qwen3_30b_a3b_expert_axis_8_does_not_fit_a_v5p_8_and_the_fix_is_named(capsys):
    status, out, err = run_check(capsys, "tpu", "--topology", "v5p-8", "--run-dir", "/mnt/gcs/runs/q30",
                                 "--gin-file", "configs/qwen3_30b_a3b.gin", "--gin-param", QWEN3_30B,
                                 "--gin-param", "MeshConfig.expert = 8")
    assert status == 2 and out == ""
    assert err.startswith("error: the mesh does not fit v5p-8 (4 chips): MeshConfig.fsdp: -1 cannot fill 4 devices")
    assert "bound: MeshConfig data=1 fsdp=-1 tensor=1 expert=8" in err
    assert "--gin-param 'MeshConfig.expert = 4'" in err


def test_fixed_axes_that_multiply_past_the_chips_are_refused(capsys):
    status, _, err = run_check(capsys, "tpu", "--topology", "v5e:2x2", "--run-dir", "/mnt/gcs/runs/t",
                               "--gin-param", "MeshConfig.fsdp = 2", "--gin-param", "MeshConfig.tensor = 4")
    assert status == 2
    assert "multiply to 8 but there are 4 devices" in err and "v5e:2x2 (4 chips)" in err
    assert "--gin-param 'MeshConfig.tensor = 2'" in err


def test_the_gpu_check_resolves_the_mesh_on_the_gpu_count(capsys):
    status, out, _ = run_check(capsys, "gpu", "--num-devices", "16", "--run-dir", "runs/q30",
                               "--gin-file", "configs/qwen3_30b_a3b.gin")
    assert status == 0 and records(out) == [("MESH", "data=1 fsdp=4 tensor=1 expert=4")]


@pytest.mark.parametrize("run_dir, message", [
    ("gs://bucket/runs/q4b", "a URL does not work; mount the bucket on every host"),
    ("runs/q4b", "is relative: every host must write the same run directory on durable storage"),
    ("", "--run-dir is required"),
])
def test_a_tpu_run_dir_must_be_an_absolute_mounted_path(capsys, run_dir, message):
    status, _, err = run_check(capsys, "tpu", "--topology", "v5e:2x2", "--run-dir", run_dir)
    assert status == 2 and message in err


def test_a_relative_pretrained_checkpoint_is_refused_on_tpu_workers(capsys):
    status, _, err = run_check(capsys, "tpu", "--topology", "v5e:4x4", "--run-dir", "/mnt/gcs/runs/q4b",
                               "--gin-file", "configs/qwen3_4b.gin")
    assert status == 2
    assert "TrainConfig.checkpoint = 'checkpoints/Qwen3-4B' is relative" in err


def test_a_misspelt_binding_is_named_before_anything_is_spent(capsys):
    status, _, err = run_check(capsys, "tpu", "--topology", "v5e:2x2", "--run-dir", "/mnt/gcs/runs/t",
                               "--gin-param", "MeshConfg.fsdp = 4")
    assert status == 2
    assert "--gin-param 'MeshConfg.fsdp = 4': unknown config 'MeshConfg'" in err and "did you mean MeshConfig" in err


def test_every_run_of_a_sweep_is_checked_and_listed_with_its_train_arguments(capsys, tmp_path):
    sweep = tmp_path / "mesh.gin"
    sweep.write_text("sweep.name = 'mesh'\nsweep.base = ['configs/tiny.gin']\n"
                     "sweep.axes = {'MeshConfig.tensor': [1, 2, 8]}\n", encoding="utf-8")
    status, _, err = run_check(capsys, "sweep", str(sweep), "--topology", "v5e:2x2", "--runs-root", "/mnt/s")
    assert status == 2 and "in sweep run 'tensor=8'" in err
    sweep.write_text(sweep.read_text(encoding="utf-8").replace(", 8]", "]"), encoding="utf-8")
    status, out, _ = run_check(capsys, "sweep", str(sweep), "--topology", "v5e:2x2", "--runs-root", "/mnt/s")
    assert status == 0
    got = records(out)
    assert [v for n, v in got if n == "RUN_NAMES[]"] == ["tensor=1", "tensor=2"]
    counts = [int(v) for n, v in got if n == "RUN_ARGC[]"]
    argv = [v for n, v in got if n == "RUN_ARGV[]"]
    assert counts == [6, 6] and argv[6:] == ["--gin-file", "configs/tiny.gin", "--gin-param", "MeshConfig.tensor = 2",
                                             "--run-dir", "/mnt/s/mesh/tensor=2"]


def test_constraints_pin_every_runtime_dependency_exactly_and_libtpu_as_jax_tpu_does():
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    from packaging.requirements import Requirement

    pins = [line for line in (REPO / "launch" / "constraints.txt").read_text(encoding="utf-8").splitlines()
            if line and not line.startswith("#")]
    pinned = {Requirement(line).name.lower(): Requirement(line) for line in pins}
    wanted = {Requirement(r).name.lower() for r in project["dependencies"]} | {"libtpu"}
    assert set(pinned) == wanted
    for name, requirement in pinned.items():
        specifiers = list(requirement.specifier)
        assert len(specifiers) == 1 and specifiers[0].operator == "==", f"{name} is not pinned exactly"
    for dependency in project["dependencies"]:  # a pin pyproject would reject could never install
        requirement = Requirement(dependency)
        assert requirement.specifier.contains(next(iter(pinned[requirement.name.lower()].specifier)).version)
