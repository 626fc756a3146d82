"""The dense KV-cache sampler (serve/engine.py's, until it moves to the paged engine): same tokens and log-probs as
full recompute (tests/rollout/naive_reference.py), log-probs equal the model's, stops, admission, sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.rollout.naive_reference import _last_logits, generate_without_cache
from trace_jax import models
from trace_jax.rollout import sampler as S

PROMPTS = [[5, 9, 17, 33, 2, 71, 8], [100, 3], [44, 45, 46, 47, 48], [7]]
MAX_LEN = 64
# Few distinct sampling configs and one batch shape, so the tests share compiled steps.
FILTERED = S.SamplingConfig(temperature=0.8, top_k=64, top_p=0.95)
GREEDY = S.SamplingConfig(greedy=True)


@pytest.fixture(scope="module")
def model():
    config = models.get_preset("tiny-qwen3")
    return config, models.init_params(config, jax.random.PRNGKey(0))


def cached_generate(config, params, sampling, rng, *, budget=12, stop_ids=(), prompts=PROMPTS, sync_every=4,
                    mesh=None, **kwargs):
    state = S.init_state(config, len(prompts), MAX_LEN, mesh=mesh)
    state = S.prefill_rows(config, params, state, list(range(len(prompts))), prompts)
    return S.generate(config, params, state, rng=rng, active=np.ones(len(prompts), bool), max_new_tokens=budget,
                      stop_ids=stop_ids, sampling=sampling, sync_every=sync_every, **kwargs)


@pytest.mark.parametrize("sampling", [FILTERED, GREEDY], ids=["temperature-topk-topp", "greedy"])
def test_cached_sampler_equals_full_recompute_for_the_same_keys(model, sampling):
    config, params = model
    rng = jax.random.PRNGKey(3)
    _, cached = cached_generate(config, params, sampling, rng)
    reference = generate_without_cache(config, params, PROMPTS, rng=rng, max_new_tokens=12, stop_ids=(),
                                       sampling=sampling, max_len=MAX_LEN)
    for row in range(len(PROMPTS)):
        np.testing.assert_array_equal(cached.tokens[row], reference.tokens[row])
        np.testing.assert_allclose(cached.logprobs[row], reference.logprobs[row], atol=1e-5)
        np.testing.assert_allclose(cached.sampling_logprobs[row], reference.sampling_logprobs[row], atol=1e-5)


def test_sampler_logprobs_match_token_logprobs_of_the_model(model):
    """The recorded log-probs are the raw model's (T=1, unfiltered), even when sampling is tempered/filtered."""
    config, params = model
    _, gen = cached_generate(config, params, FILTERED, jax.random.PRNGKey(5), budget=20)
    sequences = [prompt + gen.tokens[row].tolist() for row, prompt in enumerate(PROMPTS)]
    width = max(len(sequence) for sequence in sequences)
    # every row in one call (one program): the padding follows each row's tokens, which a causal model never reads
    padded = jnp.asarray([sequence + [0] * (width - len(sequence)) for sequence in sequences])
    trainer_rows = np.asarray(models.to_token_aligned(models.token_logprobs(config, params, padded)))
    gaps = []
    for row, prompt in enumerate(PROMPTS):
        recomputed = trainer_rows[row, len(prompt):len(prompt) + len(gen.tokens[row])]
        gaps.append(np.abs(recomputed - gen.logprobs[row]).max())
        # the sampled distribution is sharper than the model's: its log-probs are higher on average
        assert gen.sampling_logprobs[row].mean() > gen.logprobs[row].mean()
    max_gap = float(max(gaps))
    print(f"max |sampler - token_logprobs| = {max_gap:.2e}")
    assert max_gap < 1e-4


def test_rows_stop_at_stop_ids_and_budgets(model):
    config, params = model
    _, free = cached_generate(config, params, S.SamplingConfig(greedy=True), jax.random.PRNGKey(0), budget=12)
    stop = int(free.tokens[0][3])  # row 0 emits this token at step 3 under greedy decoding
    state, gen = cached_generate(config, params, S.SamplingConfig(greedy=True), jax.random.PRNGKey(0),
                                 budget=np.asarray([12, 5, 12, 1]), stop_ids=[stop])
    first = list(free.tokens[0]).index(stop)
    assert gen.tokens[0].tolist() == free.tokens[0][:first + 1].tolist()
    assert gen.stop_reason[0] == S.STOP_TOKEN
    assert len(gen.tokens[1]) <= 5 and len(gen.tokens[3]) == 1 and gen.stop_reason[3] == S.BUDGET
    expected_lengths = [len(p) + len(t) for p, t in zip(PROMPTS, gen.tokens)]
    np.testing.assert_array_equal(state.lengths, expected_lengths)


def test_generate_with_no_active_row_returns_an_empty_generation(model):
    config, params = model
    state = S.prefill_rows(config, params, S.init_state(config, 4, MAX_LEN), [0, 1, 2, 3],
                           [[1, 2], [3], [4, 5, 6], [7]])
    state, gen = S.generate(config, params, state, rng=jax.random.PRNGKey(0), active=np.zeros(4, bool),
                            max_new_tokens=4, stop_ids=[5], sampling=GREEDY)
    assert gen.steps == 0 and [len(t) for t in gen.tokens] == [0, 0, 0, 0]
    assert gen.stop_reason.tolist() == [S.RUNNING] * 4
    np.testing.assert_array_equal(state.lengths, [2, 1, 3, 1])


def test_rows_stop_when_the_cache_is_full(model):
    config, params = model
    prompts = [list(range(1, MAX_LEN - 2)), [1, 2], [3], [4]]
    _, gen = cached_generate(config, params, GREEDY, jax.random.PRNGKey(0), budget=10, prompts=prompts)
    assert len(gen.tokens[0]) == 3 and gen.stop_reason[0] == S.CONTEXT_FULL
    assert len(gen.tokens[1]) == 10 and gen.stop_reason[1] == S.BUDGET


def test_logits_hook_forces_tokens(model):
    config, params = model
    forced = [11, 12, 13, 14]

    def hook(step, generated):
        bias = np.zeros((len(PROMPTS), config.vocab_size), np.float32)
        bias[:, forced[min(step, 3)]] = 1e4
        return bias

    _, gen = cached_generate(config, params, S.SamplingConfig(), jax.random.PRNGKey(0), budget=4, logits_hook=hook)
    for row in range(len(PROMPTS)):
        assert gen.tokens[row].tolist() == forced


class _CharTokenizer:
    """Each id is one character, so multi-token stop strings are easy to write."""

    alphabet = "abcdefghijklmnopqrstuvwxyz</>_ "

    def __len__(self):
        return len(self.alphabet)

    def convert_ids_to_tokens(self, ids):
        return [self.alphabet[i] for i in ids]

    def decode(self, ids, **_):
        return "".join(self.alphabet[int(i)] for i in ids)


def test_stop_string_rolls_back_the_overshoot(model):
    config, params = model
    tokenizer = _CharTokenizer()
    text = "ab</x>cdefgh"
    script = [tokenizer.alphabet.index(ch) for ch in text]

    def hook(step, generated):
        bias = np.zeros((4, config.vocab_size), np.float32)
        bias[:, script[min(step, len(script) - 1)]] = 1e4
        return bias

    state, gen = cached_generate(config, params, S.SamplingConfig(), jax.random.PRNGKey(0), budget=[12, 3, 0, 0],
                                 prompts=[[1, 2, 3], [4], [5], [6]], logits_hook=hook,
                                 stop_strings=S.StopStrings(tokenizer, ["</x>"]))
    assert tokenizer.decode(gen.tokens[0]) == "ab</x>" and gen.stop_reason[0] == S.STOP_STRING
    assert tokenizer.decode(gen.tokens[1]) == "ab<" and gen.stop_reason[1] == S.BUDGET
    np.testing.assert_array_equal(state.lengths, [3 + 6, 1 + 3, 1, 1])


def test_decode_step_compiles_once_across_calls_and_prompt_lengths(model):
    config, params = model
    sampling = FILTERED
    cached_generate(config, params, sampling, jax.random.PRNGKey(0), budget=3)
    before = S._decode_jit._cache_size()
    for seed, prompts in enumerate([[[1] * 20, [2], [3, 4], [5]], [[9, 9], [8] * 9, [7], [6]]]):
        cached_generate(config, params, sampling, jax.random.PRNGKey(seed), budget=5 + seed, prompts=prompts)
    assert S._decode_jit._cache_size() == before


def test_sharded_sampler_equals_single_device(model):
    """Rows over `data` (4) and kv heads / mlp / vocab over `tensor` (2) on 8 fake CPU devices. Eight tokens: two
    host syncs that attend the same 16 cache slots, so one sharded decode program compiles."""
    config, params = model
    mesh = models.make_mesh({"data": 4, "tensor": 2})
    sharded_params = models.shard_params(params, config, mesh)
    sampling = FILTERED
    rng = jax.random.PRNGKey(9)
    state, sharded = cached_generate(config, sharded_params, sampling, rng, budget=8, mesh=mesh)
    assert len(state.cache.k.sharding.device_set) == 8
    _, single = cached_generate(config, params, sampling, rng, budget=8)
    for row in range(len(PROMPTS)):
        np.testing.assert_array_equal(sharded.tokens[row], single.tokens[row])
        np.testing.assert_allclose(sharded.logprobs[row], single.logprobs[row], atol=1e-5)


def test_out_of_range_token_ids_raise_naming_the_row():
    """A token id >= vocab_size would give NaN embeddings on the device: the host entry points refuse it."""
    config = models.get_preset("tiny-qwen3")
    params = models.init_params(config, jax.random.PRNGKey(0))
    state = S.init_state(config, 2, 32)
    with pytest.raises(ValueError, match=r"prompt for row 1 holds token id 512 .*vocab_size=512"):
        S.prefill_rows(config, params, state, [0, 1], [[1, 2], [3, config.vocab_size]])


def test_prefill_rows_gives_admitted_rows_the_models_logits_and_leaves_the_others(model):
    """Admitting prompts into rows of a running batch (what the server does): the admitted rows' pending logits are
    the full forward's over their prompt and they continue as a fresh greedy run of it; the other rows are
    untouched, and a prompt given to two rows runs once."""
    config, params = model
    state = S.prefill_rows(config, params, S.init_state(config, 4, MAX_LEN), [0, 1, 2, 3], PROMPTS)
    state = S.generate(config, params, state, rng=jax.random.PRNGKey(1), active=np.ones(4, bool),
                       max_new_tokens=5, stop_ids=(), sampling=GREEDY, sync_every=4)[0]
    rows, prompts = [3, 1, 0], [[21, 22, 23], [40] * 20, [21, 22, 23]]
    kept_k, kept_logits = np.asarray(state.cache.k[:, 2]), np.asarray(state.logits[2])
    admitted = S.prefill_rows(config, params, state, rows, prompts)

    assert admitted.lengths.tolist() == [3, 20, len(PROMPTS[2]) + 5, 3]
    for row, prompt in zip(rows, prompts):
        padded = np.zeros((1, MAX_LEN), np.int32)
        padded[0, :len(prompt)] = prompt
        np.testing.assert_allclose(np.asarray(admitted.logits[row]),
                                   np.asarray(_last_logits(config, params, padded, np.asarray([len(prompt)])))[0],
                                   atol=1e-4)
    np.testing.assert_array_equal(np.asarray(admitted.cache.k[:, 2]), kept_k)
    np.testing.assert_array_equal(np.asarray(admitted.logits[2]), kept_logits)
    continued = S.generate(config, params, admitted, rng=jax.random.PRNGKey(2), active=np.ones(4, bool),
                           max_new_tokens=8, stop_ids=(), sampling=GREEDY, sync_every=4)[1].tokens
    fresh = generate_without_cache(config, params, prompts, rng=jax.random.PRNGKey(2), max_new_tokens=8,
                                   stop_ids=(), sampling=GREEDY, max_len=MAX_LEN)
    for row, tokens in zip(rows, fresh.tokens):
        np.testing.assert_array_equal(continued[row], tokens)

    state = S.init_state(config, 4, MAX_LEN)
    with pytest.raises(ValueError, match="distinct rows"):
        S.prefill_rows(config, params, state, [1, 1], [[3], [4]])
    with pytest.raises(ValueError, match="distinct rows"):
        S.prefill_rows(config, params, state, [4], [[3]])
    with pytest.raises(ValueError, match="1 to 64"):
        S.prefill_rows(config, params, state, [0], [[3] * 65])
    with pytest.raises(ValueError, match="prompt for row 2"):
        S.prefill_rows(config, params, state, [2], [[-1]])


def test_prefill_rows_on_a_mesh_keeps_the_caches_layout(model):
    """The server's admission program is pinned to the cache's layout (rows over `data`, kv heads over `tensor`),
    as the rollout's prefill is: no leaf of the state comes back replicated or re-laid out."""
    config, params = model
    mesh = models.make_mesh({"data": 4, "tensor": 2})
    state = S.prefill_rows(config, models.shard_params(params, config, mesh),
                           S.init_state(config, 4, MAX_LEN, mesh=mesh), [0, 1, 2, 3], PROMPTS)
    layout = jax.tree_util.tree_map(lambda x: x.sharding, state)
    admitted = S.prefill_rows(config, models.shard_params(params, config, mesh), state, [2, 0], [[3, 4], [5]])
    for leaf, sharding in zip(jax.tree_util.tree_leaves(admitted), jax.tree_util.tree_leaves(layout)):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), (leaf.shape, leaf.sharding, sharding)
    assert admitted.lengths.tolist() == [1, len(PROMPTS[1]), 2, len(PROMPTS[3])]


def test_decode_step_writes_the_cache_once_outside_loops_and_conditionals(model):
    """The compiled decode step writes the donated KV cache once, in place, at top level: no scatter into the whole
    cache inside the layer loop (a per-layer scatter into the cache carry was copied each step on CPU) and no
    conditional passing the cache (a `lax.cond` around the model copied it each step)."""
    config, params = model
    state = S.init_state(config, len(PROMPTS), MAX_LEN)
    batch = len(PROMPTS)
    hlo = S._decode_jit.lower(config, GREEDY, params, state, jnp.ones(batch, bool), jnp.full(batch, 4, jnp.int32),
                              jnp.asarray([-1], jnp.int32), jax.random.PRNGKey(0), None).compile(
        {"xla_cpu_use_fusion_emitters": True}).as_text()  # as users compile it (tests/conftest.py turns them off)
    cache_shape = "f32[" + ",".join(str(d) for d in state.cache.k.shape) + "]"
    nested, entry = hlo.split("\nENTRY ", 1)
    is_write = lambda line: f"= {cache_shape}" in line and "scatter" in line  # noqa: E731
    assert [line for line in entry.splitlines() if is_write(line)], "no top-level cache write found"
    assert not [line for line in nested.splitlines() if is_write(line) and " fusion(" in line], \
        "a scatter into the whole cache runs inside a nested computation (the layer loop)"
    assert not [line for line in hlo.splitlines() if cache_shape in line and " conditional(" in line]
