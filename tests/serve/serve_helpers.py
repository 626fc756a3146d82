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



def sampler_greedy(backend, prompt_ids, max_tokens):
    """The sampler's own greedy continuation of `prompt_ids` (one row, one generate call), as text."""
    from trace_jax.rollout import sampler

    engine = backend.engine
    state = sampler.init_state(engine.model_config, 1, engine.config.max_context)
    state = sampler.append(engine.model_config, engine.params, state, [list(prompt_ids)])
    _, generation = sampler.generate(engine.model_config, engine.params, state, rng=jax.random.PRNGKey(0),
                                     active=np.ones(1, bool), max_new_tokens=max_tokens, stop_ids=backend.stop_ids,
                                     sampling=sampler.SamplingConfig(greedy=True))
    ids = [int(t) for t in generation.tokens[0]]
    if ids and ids[-1] in backend.stop_ids:
        ids = ids[:-1]
    return backend.tokenizer.decode(ids, skip_special_tokens=False)
