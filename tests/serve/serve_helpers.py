"""Constants and the generation reference shared by the serve tests (imported by conftest and the test modules)."""

import functools

import jax
import numpy as np

WORDS = ["search", "query", "Alpha", "river", "Paris", "city", "Which", "does", "the", "flow", "through", "Find",
         "documents", "text", "string", "object", "properties", "type", "description", "required", "Hello", "world"]
SEARCH_TOOL = {"type": "function", "function": {
    "name": "search", "description": "Find documents",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
TOOL_QUESTION = "Which city does the Alpha river flow through?"
TOOL_ARGUMENTS = {"query": "Alpha river"}


@functools.partial(jax.jit, static_argnums=0)
def _next_logits(config, params, tokens, length):
    from trace_jax import models

    return models.forward(config, params, tokens)[:, length - 1]


def reference_ids(config, params, prompt_ids, max_tokens, width, stop_ids=(), *, sampling=None, key=None,
                  slice_tokens=16):
    """The engine's documented tokens of one choice, without any cache: every token is drawn from a full forward
    pass over the sequence so far (padded to `width` positions, so it compiles once). Greedy: the argmax. Sampled
    (`sampling`, the choice's raw `key`): token t is drawn with `fold_in(fold_in(key, t0), t - t0)`, t0 the first
    token of its slice of `slice_tokens` (the engine's key rule, the dense engine's before the paged port)."""
    from trace_jax.rollout import sampler

    greedy = sampling is None or sampling.greedy
    rows = None if greedy else sampler.RowSampling.of([sampling])
    rows = None if greedy else rows.replace(filter_top_p=rows.sample)
    buffer = np.zeros((1, width), np.int32)
    buffer[0, :len(prompt_ids)] = prompt_ids
    length, out = len(prompt_ids), []
    while len(out) < max_tokens and length < width:
        logits = _next_logits(config, params, buffer, length)
        if greedy:
            token = int(np.argmax(np.asarray(logits[0])))
        else:
            t = len(out)
            step_key = jax.random.fold_in(jax.random.fold_in(key, t - t % slice_tokens), t % slice_tokens)
            token = int(sampler.sample_from_logits(logits, np.asarray(step_key)[None], rows)[0][0])
        out.append(token)
        buffer[0, length] = token
        length += 1
        if token in stop_ids:
            break
    return tuple(out)


def greedy_ids(config, params, prompt_ids, max_tokens, max_context, stop_ids=()):
    """The greedy continuation of `prompt_ids` (`reference_ids`), as token ids."""
    return reference_ids(config, params, prompt_ids, max_tokens, max_context, stop_ids)


def sampler_greedy(backend, prompt_ids, max_tokens):
    """`greedy_ids` on the backend's model, stop ids and context, decoded as text (the stop token dropped)."""
    engine = backend.engine
    ids = list(greedy_ids(engine.model_config, engine.params, prompt_ids, max_tokens, engine.config.max_context,
                          backend.stop_ids))
    if ids and ids[-1] in backend.stop_ids:
        ids = ids[:-1]
    return backend.tokenizer.decode(ids, skip_special_tokens=False)
