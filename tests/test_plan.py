"""`trace-jax plan`: topologies and meshes are checked before anything compiles, and the tiny config's programs
compile for a real TPU topology (v5e:2x2) on this CPU host with a FIT verdict and the compiler's figures.

The compile tests need `libtpu` (the `tpu` extra, which CI installs); without it they skip and say so.
"""

import math
import os

import jax
import pytest

from trace_jax import cli
from trace_jax import plan
from trace_jax.rl.gin_setup import parse
from trace_jax.train import MeshConfig

pytestmark = pytest.mark.usefixtures("tpu_compiles")  # see tests/conftest.py
GIB = 1024**3
needs_libtpu = pytest.mark.skipif(not plan.libtpu_installed(),
                                  reason="libtpu is not installed: pip install -e '.[tpu]' (the tpu extra) to "
                                         "AOT-compile for TPU topologies on a CPU host")
# The tiny config at small shapes: 2 prompts x 2 samples of 256 tokens, 2 turns (compiles in seconds).
SMALL = ["TrainConfig.prompts_per_step = 2", "RolloutConfig.group_size = 2", "RolloutConfig.max_context = 256",
         "RolloutConfig.max_turns = 2"]


@pytest.fixture(scope="module")
def tiny_run():
    return parse(["configs/tiny.gin"], SMALL)


@pytest.mark.parametrize("text, chip, shape, chips", [
    ("v5e:4x4", "v5e", (4, 4), 16),
    ("v5e-16", "v5e", (4, 4), 16),
    ("v5p-8", "v5p", (2, 2, 1), 4),     # v5p slice names count TensorCores, two per chip
    ("v5p-16", "v5p", (2, 2, 2), 8),
    ("v6e-8", "v6e", (2, 4), 8),
    ("v4:2x2x2", "v4", (2, 2, 2), 8),
    ("h100:2x8", "h100", (2, 8), 16),
])
def test_topology_names_give_chip_shape_and_chip_count(text, chip, shape, chips):
    topology = plan.parse_topology(text)
    assert (topology.chip.name, topology.shape, topology.num_chips) == (chip, shape, chips)


@pytest.mark.parametrize("text, words", [
    ("v9z:2x2", "known chips"),
    ("v5e:2x2x2", "2 dimensions"),
    ("v5e-12", "no standard v5e slice"),
    ("v5p-3", "TensorCores"),
])
def test_unknown_topologies_are_errors_that_say_the_accepted_forms(text, words):
    with pytest.raises(plan.PlanError, match=words):
        plan.parse_topology(text)


def test_mesh_flag_sets_the_named_axes_and_rejects_unknown_ones():
    assert plan.parse_mesh("fsdp=8,tensor=2", None) == MeshConfig(data=1, fsdp=8, tensor=2, expert=1)
    with pytest.raises(plan.PlanError, match="axes data, fsdp, tensor, expert"):
        plan.parse_mesh("model=4", None)


def test_a_mesh_that_does_not_match_the_chip_count_fails_before_compiling(tiny_run):
    with pytest.raises(plan.PlanError, match="v5e:2x2 has 4 chips"):
        plan.plan(tiny_run, plan.PlanConfig("v5e:2x2"), MeshConfig(data=1, fsdp=3, tensor=1, expert=1))


def test_without_libtpu_a_tpu_plan_names_the_tpu_extra(tiny_run, monkeypatch):
    monkeypatch.setattr(plan, "libtpu_installed", lambda: False)
    with pytest.raises(plan.PlanError, match=r"tpu` extra \(pip install -e '\.\[tpu\]'"):
        plan.plan(tiny_run, plan.PlanConfig("v5e:2x2"))


def test_cli_errors_exit_2_with_the_message(capsys):
    assert cli.main(["plan", "--gin-file", "configs/tiny.gin", "--topology", "v5e:3x3x3"]) == 2
    assert "2 dimensions" in capsys.readouterr().err


def test_a_gpu_target_reports_what_shapes_determine_and_says_the_rest_is_not_checked(tiny_run):
    report = plan.plan(tiny_run, plan.PlanConfig("h100:8"), model_preset="tiny-qwen3")
    assert report.verdict == "NOT CHECKED"
    text = plan.format_report(report)
    assert "not checked: activation temporaries" in text
    # the float32 train state (params + two AdamW moments) over 8 fsdp shards: about 3 x params bytes / 8
    assert 0 < report.resident["train state"] <= 3 * report.resident["reference"] * 1.01



def test_plan_shards_the_params_by_the_runs_rule_overrides():
    # on an fsdp-only mesh the embed rule alone splits every weight: replicated, each device holds the whole model
    sharded = plan.plan(parse(["configs/tiny.gin"], SMALL), plan.PlanConfig("h100:8"), model_preset="tiny-qwen3")
    whole = plan.plan(parse(["configs/tiny.gin"], SMALL + ["MeshConfig.rules = (('embed', None),)"]),
                      plan.PlanConfig("h100:8"), model_preset="tiny-qwen3")
    assert whole.resident["reference"] > 4 * sharded.resident["reference"]
@needs_libtpu
@pytest.mark.slow
def test_plan_of_the_tiny_config_on_v5e_2x2_compiles_every_program_of_the_step_and_fits(capsys):
    argv = ["plan", "--gin-file", "configs/tiny.gin", "--topology", "v5e:2x2"]
    for binding in SMALL:
        argv += ["--gin-param", binding]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "plan: v5e:2x2 (v5e-4, 4 chips, 16 GiB HBM each), mesh {'data': 1, 'fsdp': 4" in out
    assert "verdict: FIT" in out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    # every kind the step dispatches (no TIS here: no "behaviour"): reshard, init, prefill, decode, ...
    assert set(plan.PROGRAMS) - {"behaviour"} <= set(rows)
    assert "attention pallas_tpu" in out  # the splash kernel lowers on the 4-chip mesh (under shard_map)
    assert "roofline estimate" in out and "-> implied MFU" in out
    assert "resident per chip across phases: train state" in out and "rollout copy" in out
    assert "rollout (paged engine): a pool of 64 pages x 16 tokens (1024 tokens) under no KV budget" in out
    assert "step time estimate per chip: rollout" in out and "+ score" in out and "+ update" in out


@needs_libtpu
def test_libtpu_is_not_shown_the_xla_cpu_flags_it_aborts_on(monkeypatch):
    # XLA:CPU's flags (this suite runs with `--xla_cpu_use_fusion_emitters=false`) make libtpu abort the process
    monkeypatch.setenv("XLA_FLAGS", os.environ["XLA_FLAGS"] + " --xla_cpu_enable_fast_math=false")
    assert len(plan.tpu_devices(plan.parse_topology("v5e:2x2"))) == 4
    flags = os.environ["XLA_FLAGS"].split()
    assert not any(flag.startswith("--xla_cpu_") for flag in flags)
    assert "--xla_force_host_platform_device_count=8" in flags


@needs_libtpu
def test_a_program_lowered_again_alike_is_not_compiled_again_and_gets_the_same_figures(tiny_run, monkeypatch):
    # libtpu's compile-only executables do not load back from JAX's caches, so `plan` remembers what each
    # distinct program's compile gave (the estimate's variants and repeated plans lower the same programs again)
    import jax

    config = plan.PlanConfig("v5e:2x2", programs=("reshard", "score"), estimate_time=False)
    first = plan.plan(tiny_run, config, model_preset="tiny-qwen3")
    compiles = []
    compile_lowered = jax.stages.Lowered.compile

    def counted(self, *args, **kwargs):
        compiles.append(self)
        return compile_lowered(self, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", counted)
    again = plan.plan(tiny_run, config, model_preset="tiny-qwen3")
    assert compiles == []
    assert again.programs == first.programs and all(r.temp_bytes is not None for r in again.programs)
    # another topology's devices are another target: compiled, not taken from v5e's figures
    other = plan.plan(tiny_run, plan.PlanConfig("v5p-8", programs=("reshard",), estimate_time=False),
                      model_preset="tiny-qwen3")
    assert len(compiles) == 1 and other.programs[0].temp_bytes is not None


@needs_libtpu
def test_plan_compiles_the_rollout_engines_pool_prefill_and_decode_and_reports_the_pool(tiny_run):
    report = plan.plan(tiny_run, plan.PlanConfig("v5e:2x2", programs=("init", "prefill", "decode"),
                                                 estimate_time=False), model_preset="tiny-qwen3")
    assert report.verdict == "FIT"
    # each program is the engine's builder's largest entry (observations are prefilled: there is no append)
    assert [p.name for p in report.programs] == ["init", "prefill", "decode"]
    assert all("a pool of 64 pages x 16 tokens, 4 slots" in p.shape for p in report.programs)  # 4 rows x 256
    assert all(p.temp_bytes is not None for p in report.programs)
    text = plan.format_report(report)
    assert "rollout (paged engine): a pool of 64 pages x 16 tokens (1024 tokens)" in text
    assert "4 of 4 rows in flight" in text and "(the page pool, during the rollout)" in text


@needs_libtpu
def test_a_kv_budget_sets_the_rollout_pool_in_whole_pages_per_chip(tiny_run):
    # tiny-qwen3: 2 layers x 2 kv heads x 16 dims x K,V x 4 bytes = 512 B a token, 8 KiB a 16-token page; a 1 GiB
    # budget holds 131072 pages per chip, 524288 over the 4 batch shards of v5e:2x2, shared by every row in flight
    import dataclasses

    from trace_jax import models

    run = dataclasses.replace(tiny_run, train=dataclasses.replace(tiny_run.train, prompts_per_step=64),
                              rollout=dataclasses.replace(tiny_run.rollout, group_size=64, max_context=16384))
    mesh = models.make_mesh({"data": 1, "fsdp": 4, "tensor": 1, "expert": 1},
                            plan.tpu_devices(plan.parse_topology("v5e:2x2")))
    config = models.get_preset("tiny-qwen3")
    programs = plan._Programs(config, run, mesh, plan.PlanConfig("v5e:2x2", kv_budget_gib=1.0))
    assert (programs.rows, programs.rows_at_once, programs.pool) == (4096, 4096, (4 * 131072, 16))
    assert programs.kv_cache_bytes == GIB
    # a row's pages lie on one batch shard: each chip's 131 pages must hold one row
    with pytest.raises(plan.PlanError, match=r"kv_budget_gib = 0.001 gives a pool of 524 pages of 16 tokens over 4 "
                                             r"batch shards, 131 a shard; a row's pages lie on one shard and one row "
                                             r"of max_context = 16384 needs 1024: raise it \(to 4096 pages at least"):
        plan._Programs(config, run, mesh, plan.PlanConfig("v5e:2x2", kv_budget_gib=0.001))


def test_on_several_hosts_the_paged_engine_lists_every_processs_pool_part_and_rows(tiny_run):
    # v6e-8: two hosts of 4 chips, 8 rows each (2 prompts x 4), 256 tokens a row in pages of 16: each process's part
    # of the pool is 8 x 16 pages, the pool 256 pages and 16 slots; process p's part lives on its own 4 chips
    # (pages over fsdp), and every dispatch takes both processes' rows (decode batches of 2 x 1..8 rows)
    import dataclasses

    from trace_jax import models

    run = dataclasses.replace(tiny_run, train=dataclasses.replace(tiny_run.train, prompts_per_step=4),
                              rollout=dataclasses.replace(tiny_run.rollout, group_size=4, max_context=256))
    devices = plan.tpu_devices(plan.parse_topology("v6e-8"))
    mesh = models.make_mesh({"data": 1, "fsdp": 8, "tensor": 1, "expert": 1}, devices)
    programs = plan._Programs(models.get_preset("tiny-qwen3"), run, mesh, plan.PlanConfig("v6e-8"))
    decodes = programs.registry.named("paged_decode")
    assert {entry.args[3].shape[0] for entry in decodes} == {2, 4, 8, 16}
    assert all(entry.args[12][0].shape[0] % 2 == 0 for entry in decodes)  # work items: both processes' parts
    pool = decodes[0].args[2].k
    assert pool.shape[2] == 256 and decodes[0].args[2].slots == 16  # [kv heads, layers, pages, page, head dim]
    for process in (0, 1):
        pages = {index[2].indices(256)[:2] for device, index in pool.sharding.devices_indices_map(pool.shape).items()
                 if device.process_index == process}
        assert min(a for a, _ in pages) == 128 * process and max(b for _, b in pages) == 128 * (process + 1)


def test_plan_reaches_other_packages_only_through_public_names_and_patches_nothing():
    """`plan` compiles the loop's programs through their owners' public builders: no `from x import _name`, no
    `module._name` of an imported trace_jax module other than plan itself, and no assignment to an attribute of
    another module (the old global `jax.lax.scan` patch)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(plan))
    imported = {}  # local name -> module path, for every import of a module or a name
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            private = [part for part in node.module.split(".") if part.startswith("_") and part != "__future__"]
            assert not private, f"line {node.lineno}: from {node.module} import ... (a private module)"
            for alias in node.names:
                assert not alias.name.startswith("_"), f"line {node.lineno}: from {node.module} import {alias.name}"
                imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                assert not any(part.startswith("_") for part in alias.name.split(".")), \
                    f"line {node.lineno}: import {alias.name} (a private module)"
                imported[(alias.asname or alias.name).split(".")[0]] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in imported:
            private = node.attr.startswith("_") and not node.attr.startswith("__")
            assert not private, f"line {node.lineno}: {node.value.id}.{node.attr} reaches a private name"
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                while isinstance(target, ast.Attribute):
                    assert not (isinstance(target.value, ast.Name) and target.value.id in imported), \
                        f"line {node.lineno}: assigns to an attribute of module {target.value.id}"
                    target = target.value


@needs_libtpu
def test_a_kv_cache_larger_than_hbm_does_not_fit_exits_1_and_the_advice_names_the_rollout_rows(capsys):
    # 4096 rollout rows x 16384 tokens of float32 keys and values: 2 layers x 2 kv heads x 16 dims x 8 bytes
    # = 512 B a token (tiny-qwen3), 32 GiB in all, 8 GiB on each of 4 chips; the decode step's temporaries
    # take it over v5e's 16 GiB.
    argv = ["plan", "--gin-file", "configs/tiny.gin", "--topology", "v5e:2x2", "--programs", "decode",
            "--model-preset", "tiny-qwen3", "--gin-param", "TrainConfig.prompts_per_step = 64",
            "--gin-param", "RolloutConfig.group_size = 64", "--gin-param", "RolloutConfig.max_context = 16384"]
    assert cli.main(argv) == 1
    out = capsys.readouterr().out
    decode = next(line for line in out.splitlines() if line.startswith("| decode"))
    arguments = float(decode.split("|")[2].strip().rstrip("G"))
    assert 8.0 <= arguments < 8.1  # the cache (8 GiB) plus logits and params
    assert "verdict: DOES NOT FIT" in out
    assert "advice: decode peaks at" in out and "TrainConfig.prompts_per_step" in out


def test_the_variants_extend_linearly_to_the_steps_layers_and_micro_batches():
    # A step linear in layers per micro-batch and in micro-batches (the optimizer 7 and 1 a layer, a micro-batch
    # outside its layers 3, a layer of one micro-batch 5): the 1-2 layer x 1-2 micro-batch variants give back the
    # whole step exactly. (A cost the second micro-batch adds once, like the accumulator's zeros, would be
    # counted again for every further one: the compiled check below bounds that on a real step.)
    def step(layers, micro):
        return 7 + layers + micro * 3 + micro * layers * 5

    one = {(1, 1): step(1, 1), (2, 1): step(2, 1)}
    assert plan._combine(one, 36, 1) == step(36, 1)
    assert plan._combine({**one, (1, 2): step(1, 2), (2, 2): step(2, 2)}, 36, 16) == step(36, 16)


@pytest.mark.parametrize("length, q_block, k_block", [(1024, 128, 128), (640, 128, 256), (1000, 256, 128)])
def test_splash_kernel_flops_count_the_visited_causal_blocks_and_the_shards(length, q_block, k_block):
    import jax
    import numpy as np

    from trace_jax import models

    config = models.get_preset("tiny-qwen3").replace(attention_q_block=q_block, attention_k_block=k_block,
                                                     remat="full", head_dim=128)
    i = np.arange(length)
    causal = i[:, None] >= i[None, :]
    nq, nk = -(-length // q_block), -(-length // k_block)
    pad = np.zeros((nq * q_block, nk * k_block), bool)
    pad[:length, :length] = causal
    blocks = pad.reshape(nq, q_block, nk, k_block).any(axis=(1, 3)).sum()  # blocks holding a visible key
    rows, H, L = 8, config.num_attention_heads, config.num_hidden_layers
    expected = 11 * 2 * q_block * k_block * 128 * blocks * rows * H * L  # 2 + 2 (remat) + 3 (dq) + 4 (dkv) dots
    one = jax.sharding.AbstractMesh((1,), ("fsdp",))
    assert plan.splash_kernel_flops(config, rows, length, one) == expected
    mesh = jax.sharding.AbstractMesh((4, 2), ("fsdp", "tensor"))  # rows over fsdp, 4 heads over tensor
    assert plan.splash_kernel_flops(config, rows, length, mesh) == expected / 8
    three = config.replace(num_attention_heads=3, num_key_value_heads=1)  # 3 heads do not split over 2
    assert plan.splash_kernel_flops(three, rows, length, mesh) == expected * 3 / 4 / 4


@needs_libtpu
def test_the_step_time_estimate_matches_compiling_the_whole_step_unrolled(tiny_run):
    """The estimate extends 1-2 layer variants to the step; for a 4-layer, 2-micro-batch step that is small
    enough to compile unrolled whole, the compiler's own figures for the whole step agree to within 1%. (128
    tokens a row, one splash block: its 1-micro-batch variants are those the extension in tokens below compiles
    at 128.)"""
    import dataclasses

    import jax

    from trace_jax import models

    topology = plan.parse_topology("v5e:2x2")
    mesh = models.make_mesh({"data": 1, "fsdp": 4, "tensor": 1, "expert": 1}, plan.tpu_devices(topology))
    # 8 rows in 2 micro-batches of 4: a micro-batch holds one row per batch shard, as the scaling table's cells do
    # (a micro-batch with fewer rows than shards is sharded differently from the one-micro-batch variants)
    run = dataclasses.replace(tiny_run, loss=dataclasses.replace(tiny_run.loss, micro_batches=2),
                              train=dataclasses.replace(tiny_run.train, prompts_per_step=4),
                              rollout=dataclasses.replace(tiny_run.rollout, max_context=128))
    config, _ = plan.resolve_model(run)
    config = plan._override_model(config.replace(num_hidden_layers=4), plan.PlanConfig("v5e:2x2"), "tpu")
    programs = plan._Programs(config, run, mesh, plan.PlanConfig("v5e:2x2"))
    estimate, why = plan.estimate_train_time(programs, mesh.devices.flat[0])
    assert estimate is not None, why
    whole = plan.ProgramReport("train", "")
    programs.train(whole, count_loops=True, unroll=True)
    jax.clear_caches()
    assert whole.loops == 0
    assert estimate.xla_flops == pytest.approx(whole.flops, rel=0.01)
    assert estimate.xla_seconds == pytest.approx(whole.raw_seconds, rel=0.01)
    assert 0.9 < estimate.xla_flops / estimate.expected_xla_flops < 1.15
    assert estimate.kernel_flops == 2 * plan.splash_kernel_flops(config, 4, 128, mesh)  # 2 micro-batches of 4 rows
    assert estimate.seconds == pytest.approx(estimate.xla_seconds + estimate.kernel_flops / estimate.dot_rate)


def test_figures_extend_affinely_in_tokens():
    short = {((1, 1), 64): (10.0, 1.0, 5.0), ((1, 1), 128): (18.0, 1.5, 9.0)}
    assert plan._extend_in_tokens(short, (64, 128), 256) == {(1, 1): (34.0, 2.5, 17.0)}
    assert plan.short_context_lengths(49152) == (3072, 6144)
    assert plan.short_context_lengths(2048) == (512, 1024)  # never below one attention block


@needs_libtpu
def test_variants_at_a_shorter_context_extended_in_tokens_match_the_full_context_ones(tiny_run):
    """The fallback for steps whose unrolled variants do not fit: compiled at 128 and 256 tokens a row (whole
    splash blocks) and extended to 512, the estimate agrees with the variants compiled at 512 (the tiny step of
    one micro-batch: the extension in tokens is per variant, so the micro-batch variants add compiles, not cover;
    the test above checks the extension over micro-batches)."""
    import dataclasses

    from trace_jax import models

    topology = plan.parse_topology("v5e:2x2")
    mesh = models.make_mesh({"data": 1, "fsdp": 4, "tensor": 1, "expert": 1}, plan.tpu_devices(topology))
    # 4 rows (2 prompts x 2 samples), one per batch shard
    run = dataclasses.replace(tiny_run, rollout=dataclasses.replace(tiny_run.rollout, max_context=512))
    assert run.loss.micro_batches == 1
    config, _ = plan.resolve_model(run)
    config = plan._override_model(config, plan.PlanConfig("v5e:2x2"), "tpu")
    programs = plan._Programs(config, run, mesh, plan.PlanConfig("v5e:2x2"))
    full, why = plan.estimate_train_time(programs, mesh.devices.flat[0])
    assert full is not None and full.lengths is None, why
    scaled, why = plan.estimate_train_time(programs, mesh.devices.flat[0], lengths=(128, 256))
    assert scaled is not None, why
    assert scaled.lengths == (128, 256) and scaled.context == 512
    assert scaled.xla_flops == pytest.approx(full.xla_flops, rel=0.02)
    assert scaled.xla_seconds == pytest.approx(full.xla_seconds, rel=0.02)
    assert scaled.kernel_flops == full.kernel_flops  # the kernel is costed at the step's own context
    report = plan.PlanReport(topology, {}, "tiny", {}, [], {}, estimate=scaled)
    report.programs.append(plan.ProgramReport("train", "", model_flops=1e12))
    assert any("compiled at 128 and 256 tokens per row" in line for line in plan.format_estimate(report))


@needs_libtpu
@pytest.mark.parametrize("topology, hbm_bandwidth", [("v5e:2x2", 819e9), ("v6e:2x4", 1640e9)])
def test_the_compilers_memory_rate_is_near_the_chips_hbm_bandwidth(topology, hbm_bandwidth):
    # the rate behind the roofline fallback for negative optimal_seconds (v6e): bytes over time of a copy-like op
    device = plan.tpu_devices(plan.parse_topology(topology))[0]
    assert 0.7 * hbm_bandwidth < plan.compiler_memory_rate(device) <= 1.05 * hbm_bandwidth


def test_short_contexts_halve_until_the_variants_fit(tiny_run, monkeypatch):
    """Without a TPU: a stand-in for the variants' compiles that runs out of HBM above 2048 tokens and costs
    (layers, micro-batches, tokens) affinely: the estimate halves 3072/6144 to 1536/3072 and then to 768/1536,
    where both fit, and extends them back to the step's 49152 tokens exactly."""
    import dataclasses
    import types

    from trace_jax import models

    compiled = []

    def cost(layers, micro, length):
        return 5.0 + layers * micro * (2.0 + 3.0 * length)  # per-step + per-token work

    class FakePrograms:
        def __init__(self, config, run, mesh, plan_config):
            self.config, self.length = config, run.rollout.max_context
            self.micro = run.loss.micro_batches

        def train(self, report, *, rows, count_loops, unroll):
            assert count_loops and unroll  # the variants are compiled unrolled, their loops counted
            compiled.append(self.length)
            if self.length > 2048:
                report.out_of_memory = "the compiler ran out of HBM"
                return
            value = cost(self.config.num_hidden_layers, self.micro, self.length)
            report.flops, report.raw_seconds, report.bytes_accessed, report.loops = value, value, value, 0

    monkeypatch.setattr(plan, "_Programs", FakePrograms)
    monkeypatch.setattr(plan, "compiler_dot_rate", lambda device: 1.0)
    config = models.get_preset("tiny-qwen3").replace(num_hidden_layers=4, attention_impl="xla")
    run = dataclasses.replace(tiny_run, loss=dataclasses.replace(tiny_run.loss, micro_batches=2),
                              rollout=dataclasses.replace(tiny_run.rollout, max_context=49152))
    programs = types.SimpleNamespace(config=config, run=run, rows=4, mesh=types.SimpleNamespace(size=1),
                                     plan=None, length=49152, update_length=49152)
    estimate, why = plan.estimate_train_time(programs, None)
    assert estimate is not None, why
    assert estimate.lengths == (768, 1536)
    assert estimate.xla_seconds == pytest.approx(cost(4, 2, 49152))
    assert 6144 in compiled and 3072 in compiled and compiled.count(1536) == 4  # each length compiled once


def _tpu_programs(topology_name, axes):
    """`plan`'s registry of the tiny config (head_dim 128, 4 kv heads: the kernel's shapes) for a TPU topology and
    mesh axes, as `plan.plan` builds it."""
    from trace_jax import models

    topology = plan.parse_topology(topology_name)
    mesh = models.make_mesh({"data": 1, "fsdp": axes["fsdp"], "tensor": axes["tensor"], "expert": 1},
                            plan.tpu_devices(topology))
    run = parse(["configs/tiny.gin"], SMALL + ["model_preset.head_dim = 128", "model_preset.num_key_value_heads = 4"])
    config, _ = plan.resolve_model(run)
    config = plan._override_model(config, plan.PlanConfig(topology_name), "tpu")
    return plan._Programs(config, run, mesh, plan.PlanConfig(topology_name))


@needs_libtpu
def test_for_a_tpu_topology_the_paged_decode_lowers_to_the_pallas_kernel_and_the_prefill_does_not():
    """The kernel is chosen by the target the program is compiled for (the CPU host's backend notwithstanding):
    the paged decode program of `plan`'s registry lowers to a Mosaic custom call; the prefill stays XLA. The mesh
    splits heads, not pages (pages over batch shards: the next test)."""
    programs = _tpu_programs("v5e:2x2", {"fsdp": 1, "tensor": 4})
    assert "tpu_custom_call" in programs.registry.largest("paged_decode").lower().as_text()
    assert "tpu_custom_call" not in programs.registry.largest("paged_prefill").lower().as_text()


@needs_libtpu
def test_for_a_tpu_topology_with_pages_over_fsdp_shards_the_paged_decode_lowers_to_the_pallas_kernel():
    """The pool's pages over 4 fsdp shards (the pod setting): the engine's allocator keeps each row's pages on one
    shard, so the decode program of `plan`'s registry runs the kernel there too (in `shard_map`, each shard its
    rows with local page ids)."""
    from trace_jax.rollout import paged

    programs = _tpu_programs("v6e:2x2", {"fsdp": 4, "tensor": 1})
    decode = programs.registry.largest("paged_decode")
    pool = decode.args[2]
    assert paged.page_shards(paged.state_layout(pool)) == 4
    lowered = decode.lower()
    assert "tpu_custom_call" in lowered.as_text()
    # compiled, it writes each layer's new keys into the pool in the layout the kernel reads: no copy of the pool
    # (written with the kv heads in the scatter's window, XLA:TPU laid the pool out heads-minor and copied it whole
    # back to the kernel's layout in every layer: 14.16 GiB of temporaries for Qwen3-4B's 6.8 GiB pool)
    compiled = lowered.compile()
    local = pool.k.sharding.shard_shape(pool.k.shape)
    pool_shaped = f"[{','.join(map(str, local))}]"

    def copies(text):
        return [line for line in text.splitlines() if " copy(" in line and pool_shaped in line.split("copy(")[0]]

    assert copies(compiled.as_text()) == []
    keys = math.prod(local) * pool.k.dtype.itemsize
    assert compiled.memory_analysis().temp_size_in_bytes < keys  # less than a device's part of the keys
    # nor does the prefill (its one write of every layer's new keys: the same rule, `paged.write_pages`)
    assert copies(programs.registry.largest("paged_prefill").lower().compile().as_text()) == []


@needs_libtpu
def test_the_decode_roofline_reports_both_engines_and_the_pool_holds_more_rows_than_the_dense_budget(monkeypatch):
    """16 rows of 256 tokens under a KV budget that holds 1 whole row a chip: the dense engine runs 4 at once, the
    paged pool (rows at half the context) 8; every figure is positive, and the paged one's compiled step is the
    decode batch of those 8 rows, not the registry's largest (16 rows, every slot)."""
    run = parse(["configs/tiny.gin"], SMALL + [
        "model_preset.head_dim = 128", "TrainConfig.prompts_per_step = 4",
        "RolloutConfig.group_size = 4", "RolloutConfig.kv_budget_gib = 0.00125"])
    largest = []
    rooflines = plan.decode_rooflines
    monkeypatch.setattr(plan, "decode_rooflines", lambda programs, topology: largest.append(
        programs.registry.largest("paged_decode").args[3].shape[0]) or rooflines(programs, topology))
    report = plan.plan(run, plan.PlanConfig("v5e:2x2", programs=("decode",), estimate_time=False))
    paged, dense = report.decode
    assert (paged.engine, dense.engine) == ("paged", "dense")
    assert dense.rows_in_flight == 4 and paged.rows_in_flight == 8
    assert paged.context == 128 and dense.context == 256
    for d in (paged, dense):
        assert d.weight_bytes > 0 and d.kv_bytes > 0 and d.tokens_per_second > 0
        assert d.hbm_bandwidth == 819e9 and d.chips == 4
    assert largest == [16] and paged.compiled_rows == 8
    assert paged.compiled_bytes > 0 and 0 < paged.fraction_of_roofline
    # the kernel path: the rows' KV the kernel reads by DMA (unseen by the cost analysis) is added to its bytes
    assert paged.kernel_kv_bytes == paged.kv_bytes  # the compiled batch is the rows in flight
    assert paged.compiled_tokens_per_second == pytest.approx(
        8 / 4 * paged.hbm_bandwidth / (paged.compiled_bytes + paged.kv_bytes))
    assert dense.compiled_bytes is None and dense.fraction_of_roofline is None
    text = plan.format_report(report)
    assert "not a measurement" in text and "paged: 8 rows in flight" in text and "dense: 4 rows in flight" in text
    assert "of KV reads (DMA, unseen by the cost analysis)" in text
    assert "% of the roofline" in text


def test_the_step_split_models_the_paged_engine_rows_in_flight_not_waves(monkeypatch):
    """16 rows of 256 tokens: the rollout's decode steps are every row's decoded tokens over the rows in flight
    (continuous batching: the rows at half the context each shard's block of the pool holds), which the KV budget
    sets."""
    monkeypatch.setattr(plan, "compiler_dot_rate", lambda device: 1e14)  # the rates' own test is elsewhere
    monkeypatch.setattr(plan, "compiler_memory_rate", lambda device: 1e12)

    def split(budget):
        run = parse(["configs/tiny.gin"], SMALL + [
            "TrainConfig.prompts_per_step = 4", "RolloutConfig.group_size = 4",
            f"RolloutConfig.kv_budget_gib = {budget}"])
        report = plan.plan(run, plan.PlanConfig("v5e:2x2", programs=("init",)))
        return run, report.split, report.settings["pool_pages"]

    run, wide, pool = split(0.05)
    decoded = min(256, (run.rollout.max_turns + 1) * run.rollout.turn_token_budget)
    assert wide.rows_in_flight == 16 and wide.decoded_tokens == decoded  # every row fits at half its context
    assert wide.decode_steps == decoded and 0 < wide.prefill < wide.rollout
    _, narrow, pool = split(0.0004)
    # a row at 128 tokens holds 8 pages of 16, and a row's pages lie on one of the 4 batch shards' blocks
    assert narrow.rows_in_flight == (pool // 4 // 8) * 4 < 16
    assert narrow.decode_steps == -(-16 * decoded // narrow.rows_in_flight)
    assert narrow.rollout > wide.rollout and narrow.prefill == wide.prefill
    assert "decode steps of 16 rows in flight" in plan.format_split(plan.PlanReport(
        None, None, "", {"mini_batches": 1}, [], {}, split=wide))[0]


def test_every_chip_has_an_hbm_bandwidth():
    assert {name: chip.hbm_bandwidth for name, chip in plan.CHIPS.items()}["v6e"] == 1640e9
    assert all(chip.hbm_bandwidth > 0 for chip in plan.CHIPS.values())
