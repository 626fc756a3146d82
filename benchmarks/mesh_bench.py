"""One mesh for the whole RL step (issue 28): each device's resident bytes on a mesh against one device, and the
phase times, on 8 fake CPU devices.

For the tiny config (`configs/tiny.gin`'s model and step: 8 prompts x 8 samples, a fresh policy, no warm start)
and the tiny MoE preset, the loop's own pieces (`loop.Placement`, `loop.rl_step`, `pipeline.RLPipeline`) run RL
steps on one device and on each mesh, and the bench reads the real arrays' shards (`addressable_shards`) on every
device:

  policy (train layout)     the train state's params (`models.DEFAULT_RULES`: fsdp x tensor x expert)
  policy (rollout layout)   `Placement.rollout_params`: whole over the batch axes (data, fsdp), heads / mlp / vocab
                            over tensor, experts over expert (`models.ROLLOUT_RULES`): not 1/N by design
  optimizer state           the train state's optimizer moments (train layout)
  reference                 `Placement.frozen`: the frozen reference as the scorer reads it
  KV cache                  the rollout engine's page pool, read at every decode dispatch of the steps (the largest)

The table gives, per category, the bytes on one device, the largest and smallest per-device bytes on the mesh,
their ratio to one device, and the target: at most 1/N + 10% of the one-device bytes (N = the mesh's devices; for
the train state and the reference, the devices the rules split them over, `state_devices`: the `data` axis is pure
data parallelism and replicates them by design, so on data=2,fsdp=2,tensor=2 their N is 4, the cache's 8).
The rollout layout is printed against 1/N too but not held to it (a note says so): by design it keeps the
weights whole over the batch axes, a copy that lives while the step rolls out. The exit status is 1 when any
other category is over its target. Phase times
(rollout, scoring, credit, update) are of the last step (the first one compiles); there is no speed target: the
fake devices share the host's cores.

    python benchmarks/mesh_bench.py                 # tiny.gin's step: one device, fsdp=4,tensor=2,
                                                    # data=2,fsdp=2,tensor=2; the tiny MoE: one device, expert=4
    python benchmarks/mesh_bench.py --quick         # a 1-layer model, 4 prompts x 2, one step, dense meshes only
    python benchmarks/mesh_bench.py --models tiny-moe   # one model of the full run
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import os
import sys
import tempfile

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # before jax is imported
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from trace_jax.rl.gin_setup import parse  # noqa: E402
from trace_jax.rl.loop import Placement, build_environment, rl_step  # noqa: E402
from trace_jax.rl.metrics import PhaseTimer  # noqa: E402
from trace_jax.rl.pipeline import RLPipeline, UpdateConfig  # noqa: E402
from trace_jax.rollout import paged as paged_lib  # noqa: E402
from trace_jax.train.config import MeshConfig  # noqa: E402
from trace_jax.train.optimizer import make_optimizer  # noqa: E402
from trace_jax.train.state import init_train_state  # noqa: E402
from trace_jax.train.step import make_train_step  # noqa: E402

ONE_DEVICE = "devices=1"
FULL = {  # model -> (gin bindings over configs/tiny.gin, meshes as `--mesh` flags)
    "tiny": ([], [ONE_DEVICE, "fsdp=4,tensor=2", "data=2,fsdp=2,tensor=2"]),
    "tiny-moe": (["model_preset.name = 'tiny-qwen3-moe'", "model_preset.moe_intermediate_size = 96"],
                 [ONE_DEVICE, "fsdp=2,expert=4"]),
}
# tests/rl/test_mesh_step.py's run (the same programs: a test session compiles them once, through its cache)
QUICK_BINDINGS = ["model_preset.hidden_size = 32", "model_preset.intermediate_size = 64",
                  "model_preset.num_hidden_layers = 1", "model_preset.num_attention_heads = 2",
                  "model_preset.num_key_value_heads = 2", "model_preset.head_dim = 16",
                  "DataConfig.num_train_tasks = 8", "DataConfig.num_eval_tasks = 2", "RolloutConfig.group_size = 2",
                  "RolloutConfig.max_turns = 1", "RolloutConfig.max_context = 128",
                  "RolloutConfig.turn_token_budget = 8", "UpdateConfig.length_multiple = 128",
                  "TrainConfig.prompts_per_step = 4", "RolloutConfig.system_prompt = None",
                  "SamplingConfig.greedy = True", "WarmStartConfig.steps = 0", "OptimizerConfig.learning_rate = 1e-4"]
QUICK = {"tiny (1 layer)": (QUICK_BINDINGS, [ONE_DEVICE, "fsdp=4,tensor=2"])}
CATEGORIES = ("policy (train layout)", "policy (rollout layout)", "optimizer state", "reference", "KV cache")
PHASES = ("rollout", "scoring", "credit", "update")


def device_bytes(tree) -> dict:
    """{device: bytes of the shards of `tree`'s arrays it holds}, read from the arrays' own shards."""
    out: dict = collections.Counter()
    for leaf in jax.tree_util.tree_leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device] += shard.data.nbytes
    return out


@contextlib.contextmanager
def recording_caches(largest: dict):
    """While active, every decode dispatch of the rollout engine adds nothing but a look at its page pool (the KV
    cache, k and v): `largest` keeps each device's largest pool bytes seen."""
    decode_program = paged_lib.decode_program

    def recording(*build):
        program = decode_program(*build)

        def run(sampling, params, pool, *rest):
            for device, nbytes in device_bytes((pool.k, pool.v)).items():
                largest[device] = max(largest.get(device, 0), nbytes)
            return program(sampling, params, pool, *rest)

        return run

    paged_lib.decode_program = recording
    try:
        yield
    finally:
        paged_lib.decode_program = decode_program


def run_mesh(run_config, environment, mesh_flag: str, steps: int) -> dict:
    """`steps` RL steps of the run on the mesh `mesh_flag`: per-device bytes of each category and the last step's
    phase seconds."""
    run_config = dataclasses.replace(run_config, mesh=MeshConfig.from_flag(mesh_flag))
    model_config = environment.model_config
    placement = Placement(run_config, model_config)
    optimizer = make_optimizer(run_config.optimizer)
    pipeline = RLPipeline(model_config, environment.chat, environment.browser, run_config.rollout, run_config.credit,
                          run_config.loss, run_config.update or UpdateConfig(), optimizer,
                          mesh=placement.mesh,
                          train_step=make_train_step(model_config, run_config.loss, optimizer, mesh=placement.mesh))
    params = placement.policy(environment.params)
    reference = placement.frozen(params)
    state = init_train_state(model_config, optimizer, params, jax.random.PRNGKey(0), mesh=placement.mesh)
    prompts = run_config.train.prompts_per_step
    caches: dict = {}
    timer = PhaseTimer()
    with recording_caches(caches):
        for step in range(steps):
            timer.reset()
            tasks = [environment.train_tasks[(step * prompts + i) % len(environment.train_tasks)]
                     for i in range(prompts)]
            state, _, _ = rl_step(pipeline, placement, state, reference, tasks, jax.random.PRNGKey(100 + step),
                                  seed=step, timer=timer)
    rollout_params = placement.rollout_params(state.params)
    return {"devices": placement.mesh.devices.size, "state_devices": state_devices(placement.mesh, placement.rules),
            "bytes": {"policy (train layout)": device_bytes(state.params),
                      "policy (rollout layout)": device_bytes(rollout_params),
                      "optimizer state": device_bytes(state.opt_state), "reference": device_bytes(reference),
                      "KV cache": caches},
            "seconds": {phase: timer.seconds.get(phase, 0.0) for phase in PHASES}}


def state_devices(mesh, rules) -> int:
    """How many ways the rules split the train state on `mesh`: the product of the sizes of the mesh axes that any
    logical axis but `batch` and `length` (activations only) maps to. With `models.DEFAULT_RULES` that is fsdp x
    tensor x expert: the `data` axis is pure data parallelism (MaxText's convention; the axis a multi-slice run puts
    over DCN), so params, moments and reference are replicated over it by design."""
    sizes = dict(mesh.shape)
    axes = set()
    for logical, target in rules:
        if logical in ("batch", "length") or target is None:
            continue
        axes.update((target,) if isinstance(target, str) else target)
    n = 1
    for axis in axes:
        n *= sizes.get(axis, 1)
    return n


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024


def table(model: str, results: dict) -> tuple[list[str], bool]:
    """Markdown rows: per mesh and category, one device's bytes, the mesh's largest / smallest per-device bytes, the
    ratio and the target; and whether every category but the rollout layout is within its target."""
    one = results[ONE_DEVICE]
    ok = True
    lines = [f"| {model} | mesh | category | one device | per device on the mesh, max (min) | max / one device | "
             "target 1/N + 10% | within | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for mesh, result in results.items():
        if mesh == ONE_DEVICE:
            continue
        n, n_state = result["devices"], result["state_devices"]
        for category in CATEGORIES:
            alone = sum(one["bytes"][category].values())
            per_device = result["bytes"][category]
            ratio = max(per_device.values()) / alone
            target = 1 / n + 0.1
            note = ""
            if category == "policy (rollout layout)":
                note = "not held to 1/N: whole over the batch axes by design"
            else:
                if category != "KV cache" and n_state < n:
                    target = 1 / n_state + 0.1
                    note = (f"N = {n_state}: the rules shard the state over {n_state} of the {n} devices; the "
                            "data axis replicates it by design")
                ok &= ratio <= target
            lines.append(f"| {model} | {mesh} | {category} | {_size(alone)} | {_size(max(per_device.values()))} "
                         f"({_size(min(per_device.values()))}) | {ratio:.3f} | {target:.3f} | "
                         f"{'yes' if ratio <= target else 'NO'} | {note} |")
    return lines, ok


def phase_table(model: str, results: dict, steps: int) -> list[str]:
    label = "first step (includes compilation)" if steps == 1 else f"step {steps} of {steps}"
    lines = [f"| {model} | mesh | " + " | ".join(f"{p} s" for p in PHASES) + f" | ({label}; no speed target) |",
             "|---|---|" + "---|" * len(PHASES) + "---|"]
    for mesh, result in results.items():
        lines.append(f"| {model} | {mesh} | " + " | ".join(f"{result['seconds'][p]:.2f}" for p in PHASES) + " | |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 1-layer model, 4 prompts x 2, one step, dense meshes")
    parser.add_argument("--steps", type=int, default=None, help="RL steps per mesh (default 2, 1 with --quick)")
    parser.add_argument("--models", default=None,
                        help=f"comma-separated subset of the full run's models ({', '.join(FULL)}); default all")
    args = parser.parse_args(argv)
    steps = args.steps or (1 if args.quick else 2)
    runs = QUICK if args.quick else FULL
    if args.models:
        names = [name.strip() for name in args.models.split(",")]
        unknown = [name for name in names if name not in runs]
        if unknown:
            parser.error(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(runs)}")
        runs = {name: runs[name] for name in names}
    if jax.device_count() < 8:
        print(f"error: the bench needs 8 devices, jax has {jax.device_count()}: run it in a fresh process (it sets "
              "XLA_FLAGS=--xla_force_host_platform_device_count=8 before importing jax)", file=sys.stderr)
        return 2
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices; {steps} RL step(s) per "
          "mesh", flush=True)
    ok = True
    with tempfile.TemporaryDirectory(prefix="mesh_bench_") as workdir:
        for model, (bindings, meshes) in runs.items():
            run_config = parse(["configs/tiny.gin"], bindings)
            environment = build_environment(run_config, os.path.join(workdir, model.replace(" ", "_")))
            results = {}
            for mesh in meshes:
                results[mesh] = run_mesh(run_config, environment, mesh, steps)
                print(f"[{model}] {mesh}: done", flush=True)
            rows, within = table(model, results)
            ok &= within
            print("\n".join(["", *rows, "", *phase_table(model, results, steps), ""]), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
