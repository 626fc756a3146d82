"""The sampling rules (`rollout.sampler`) as the paged engine's programs apply them (rows driven through
`paged.prefill_program` / `paged.decode_program` by tests/rollout/paged_programs.py): tokens and both log-probs equal
a full recompute with the same keys (tests/rollout/naive_reference.py), the raw log-probs are the model's, rows stop
at stop ids, budgets and a full row, one decode compile serves new prompts and budgets, and on a mesh the programs
keep the pool's layout and give one device's tokens. Host-side rules: top-k / top-p filtering against a float64
reference, stop strings spelt over several tokens, bucket lengths."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.rollout.naive_reference import generate_without_cache
from tests.rollout.paged_programs import decode, prefill, run_rows
from trace_jax import models
from trace_jax.rollout import paged
from trace_jax.rollout import sampler as S

PROMPTS = [[5, 9, 17, 33, 2, 71, 8], [100, 3], [44, 45, 46, 47, 48], [7]]
MAX_LEN = 64
# Few distinct sampling configs and one batch shape, so the tests share compiled programs.
FILTERED = S.SamplingConfig(temperature=0.8, top_k=64, top_p=0.95)
GREEDY = S.SamplingConfig(greedy=True)


@pytest.fixture(scope="module")
def model():
    config = models.get_preset("tiny-qwen3")
    return config, models.init_params(config, jax.random.PRNGKey(0))


def _keys(seed, rows=len(PROMPTS)):
    return np.asarray(jax.random.split(jax.random.PRNGKey(seed), rows))


def _run(config, params, sampling, keys, *, budget=12, prompts=PROMPTS, **kwargs):
    return run_rows(config, params, prompts, max_len=MAX_LEN, keys=keys, sampling=sampling, budget=budget, **kwargs)


@pytest.mark.parametrize("sampling", [FILTERED, GREEDY], ids=["temperature-topk-topp", "greedy"])
def test_paged_decode_equals_full_recompute_for_the_same_keys(model, sampling):
    config, params = model
    keys = _keys(3)
    _, cached = _run(config, params, sampling, keys)
    reference = generate_without_cache(config, params, PROMPTS, rng=keys, max_new_tokens=12, stop_ids=(),
                                       sampling=sampling, max_len=MAX_LEN)
    assert cached.dispatches == 3  # 12 tokens in blocks of 4 steps: the keys run on across dispatches
    for row in range(len(PROMPTS)):
        np.testing.assert_array_equal(cached.tokens[row], reference.tokens[row])
        np.testing.assert_allclose(cached.logprobs[row], reference.logprobs[row], atol=1e-5)
        np.testing.assert_allclose(cached.sampling_logprobs[row], reference.sampling_logprobs[row], atol=1e-5)


def test_sampler_logprobs_match_token_logprobs_of_the_model(model):
    """The recorded log-probs are the raw model's (T=1, unfiltered), even when sampling is tempered/filtered."""
    config, params = model
    _, gen = _run(config, params, FILTERED, _keys(5), budget=20)
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
    """Each row stops at the first stop id it draws (kept) or at its own budget, whichever comes first."""
    config, params = model
    _, free = _run(config, params, GREEDY, _keys(0), budget=12)
    stop = int(free.tokens[0][3])  # row 0 emits this token at step 3 under greedy decoding
    budgets = [12, 5, 12, 1]
    pool, gen = _run(config, params, GREEDY, _keys(0), budget=np.asarray(budgets), stop_ids=[stop])
    for row, budget in enumerate(budgets):
        free_ids = free.tokens[row][:budget].tolist()
        cut = free_ids.index(stop) + 1 if stop in free_ids else budget
        assert gen.tokens[row].tolist() == free_ids[:cut], row
        assert gen.stop_reason[row] == (S.STOP_TOKEN if stop in free_ids else S.BUDGET), row
    assert gen.stop_reason[0] == S.STOP_TOKEN and gen.stop_reason[3] == S.BUDGET and len(gen.tokens[3]) == 1
    np.testing.assert_array_equal(pool.lengths, [len(p) + len(t) for p, t in zip(PROMPTS, gen.tokens)])


def test_rows_stop_when_the_row_is_full(model):
    config, params = model
    prompts = [list(range(1, MAX_LEN - 2)), [1, 2], [3], [4]]
    _, gen = _run(config, params, GREEDY, _keys(0), budget=10, prompts=prompts)
    assert len(gen.tokens[0]) == 3 and gen.stop_reason[0] == S.CONTEXT_FULL
    assert len(gen.tokens[1]) == 10 and gen.stop_reason[1] == S.BUDGET


def test_the_decode_program_compiles_once_across_calls_prompt_lengths_and_budgets(model):
    config, params = model
    _run(config, params, FILTERED, _keys(0), budget=3)
    before = paged.compiled_programs("paged_decode")
    for seed, prompts in enumerate([[[1] * 20, [2], [3, 4], [5]], [[9, 9], [8] * 9, [7], [6]]]):
        _run(config, params, FILTERED, _keys(seed), budget=5 + seed, prompts=prompts)
    assert paged.compiled_programs("paged_decode") == before


@pytest.fixture(scope="module")
def sharded(model):
    """Rows over `data` (4) and kv heads / mlp / vocab over `tensor` (2) on 8 fake CPU devices: the pool's layout
    after the prefill, and the pool and generation after decoding with FILTERED."""
    config, params = model
    mesh = models.make_mesh({"data": 4, "tensor": 2})
    sharded_params = models.shard_params(params, config, mesh)
    pool = prefill(config, sharded_params, PROMPTS, max_len=MAX_LEN, mesh=mesh)
    after_prefill = jax.tree_util.tree_map(lambda x: x.sharding, pool.state)
    pool, gen = decode(config, sharded_params, pool, keys=_keys(9), sampling=FILTERED, budget=8)
    return mesh, after_prefill, pool, gen


def test_on_a_mesh_the_prefill_and_decode_programs_keep_the_pools_layout(model, sharded):
    """Pages over `data`, kv heads over `tensor` (`paged.abstract_state`): no leaf of the pool comes back
    replicated or re-laid out from either program."""
    config, _ = model
    mesh, after_prefill, pool, _ = sharded
    pages = len(PROMPTS) * paged.pages_for(MAX_LEN, pool.page_size)
    expected = paged.abstract_state(config, pages, pool.page_size, len(PROMPTS), mesh=mesh)
    assert len(pool.state.k.sharding.device_set) == 8
    for layout in (after_prefill, jax.tree_util.tree_map(lambda x: x.sharding, pool.state)):
        for sharding, want in zip(jax.tree_util.tree_leaves(layout), jax.tree_util.tree_leaves(expected)):
            assert sharding.is_equivalent_to(want.sharding, len(want.shape)), (want.shape, sharding, want.sharding)


def test_on_a_mesh_the_programs_give_one_devices_tokens(model, sharded):
    config, params = model
    _, _, _, on_mesh = sharded
    _, single = _run(config, params, FILTERED, _keys(9), budget=8)
    for row in range(len(PROMPTS)):
        np.testing.assert_array_equal(on_mesh.tokens[row], single.tokens[row])
        np.testing.assert_allclose(on_mesh.logprobs[row], single.logprobs[row], atol=1e-5)


def _filtered_reference(logits, temperature, top_k, top_p):
    """float64: tempered logits, those below the k-th largest removed, then those outside the smallest set whose
    probability reaches top_p (the most likely token always stays); -inf = removed."""
    z = np.asarray(logits, np.float64) / temperature
    if top_k:
        z = np.where(z < np.sort(z)[-top_k], -np.inf, z)
    if top_p < 1.0:
        order = np.argsort(-z)
        probs = np.exp(z[order] - z[order][0])
        probs /= probs.sum()
        keep = np.cumsum(probs) - probs < top_p
        z = np.where(z < z[order][keep].min(), -np.inf, z)
    return z


def test_sampling_logits_keep_the_top_k_then_the_top_p_set_of_the_tempered_softmax():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 50)).astype(np.float32) * 3.0
    settings = [S.SamplingConfig(temperature=t, top_k=10, top_p=p) for t, p in
                [(0.7, 0.9), (1.3, 1.0), (1.0, 0.5), (0.2, 0.99)]]
    filtered = np.asarray(S.sampling_logits(jnp.asarray(logits), S.RowSampling.of(settings)))
    for row, s in enumerate(settings):
        want = _filtered_reference(logits[row], s.temperature, s.top_k, s.top_p)
        np.testing.assert_array_equal(np.isinf(filtered[row]), np.isinf(want), err_msg=str(s))
        kept = np.isfinite(want)
        np.testing.assert_allclose(filtered[row][kept], want[kept], rtol=1e-5, err_msg=str(s))
    assert 1 < np.isfinite(filtered[2]).sum() < 10  # top-p removed some of the top-k's tokens


class _CharTokenizer:
    """Each id is one character, so multi-token stop strings are easy to write."""

    alphabet = "abcdefghijklmnopqrstuvwxyz</>_ "

    def __len__(self):
        return len(self.alphabet)

    def convert_ids_to_tokens(self, ids):
        return [self.alphabet[i] for i in ids]

    def decode(self, ids, **_):
        return "".join(self.alphabet[int(i)] for i in ids)

    def encode(self, text):
        return [self.alphabet.index(ch) for ch in text]


def test_stop_strings_find_the_token_that_completes_a_tag_spelt_over_several_tokens():
    tokenizer = _CharTokenizer()
    stops = S.StopStrings(tokenizer, ["</x>"])
    assert stops.candidates == {tokenizer.alphabet.index(">")}  # only a token with the tag's last character
    ids = tokenizer.encode("ab</x>cd</x>e")
    assert stops.first_stop(ids) == 5
    assert stops.first_stop(ids, start=4) == 5  # a tag begun before the tokens already checked is still found
    assert stops.first_stop(ids, start=6) is None  # one already complete before `start` is not reported again
    assert stops.first_stop(tokenizer.encode("ab</x")) is None
    assert stops.first_stop(tokenizer.encode("a>b</y>")) is None


def test_bucket_length_pads_to_powers_of_two_up_to_512_then_to_multiples_of_256():
    assert [S.bucket_length(n) for n in (1, 16, 17, 100, 512, 513, 645, 1025)] == \
        [16, 16, 32, 128, 512, 768, 768, 1280]
    assert [S.bucket_length(n, minimum=1) for n in (1, 2, 3, 5)] == [1, 2, 4, 8]
