"""Constants and the sampler reference shared by the serve tests (imported by conftest and the test modules)."""

import jax
import numpy as np

WORDS = ["search", "query", "Alpha", "river", "Paris", "city", "Which", "does", "the", "flow", "through", "Find",
         "documents", "text", "string", "object", "properties", "type", "description", "required", "Hello", "world"]
SEARCH_TOOL = {"type": "function", "function": {
    "name": "search", "description": "Find documents",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
TOOL_QUESTION = "Which city does the Alpha river flow through?"
TOOL_ARGUMENTS = {"query": "Alpha river"}



def greedy_ids(config, params, prompt_ids, max_tokens, max_context, stop_ids=()):
    """The sampler's own greedy continuation of `prompt_ids` (one row, one generate call), as token ids."""
    from trace_jax.rollout import sampler

    state = sampler.prefill_rows(config, params, sampler.init_state(config, 1, max_context), [0], [list(prompt_ids)])
    _, generation = sampler.generate(config, params, state, rng=jax.random.PRNGKey(0), active=np.ones(1, bool),
                                     max_new_tokens=max_tokens, stop_ids=stop_ids,
                                     sampling=sampler.SamplingConfig(greedy=True))
    return tuple(int(t) for t in generation.tokens[0])


def sampler_greedy(backend, prompt_ids, max_tokens):
    """`greedy_ids` on the backend's model, stop ids and context, decoded as text (the stop token dropped)."""
    engine = backend.engine
    ids = list(greedy_ids(engine.model_config, engine.params, prompt_ids, max_tokens, engine.config.max_context,
                          backend.stop_ids))
    if ids and ids[-1] in backend.stop_ids:
        ids = ids[:-1]
    return backend.tokenizer.decode(ids, skip_special_tokens=False)
