"""Search environment: an offline corpus, BM25 search, gpt-oss-style browser tools and answer checking.

The task generator, oracle and datasets live in sibling modules (``world``, ``tasks``, ``oracle``) and are imported
from there directly.
"""

from trace_jax.envs.answers import (
    RewardResult,
    answer_reward,
    exact_match,
    extract_answer,
    normalize_answer,
    token_f1,
)
from trace_jax.envs.browser import (
    BROWSER_INSTRUCTIONS,
    Browser,
    Link,
    Observation,
    Page,
    ToolError,
    observation_templates,
    parse_arguments,
    tool_schemas,
)
from trace_jax.envs.corpus import Corpus, CorpusError, Document
from trace_jax.envs.search_index import SearchIndex, tokenize

__all__ = [
    "BROWSER_INSTRUCTIONS",
    "Browser",
    "Corpus",
    "CorpusError",
    "Document",
    "Link",
    "Observation",
    "Page",
    "RewardResult",
    "SearchIndex",
    "ToolError",
    "answer_reward",
    "exact_match",
    "extract_answer",
    "normalize_answer",
    "observation_templates",
    "parse_arguments",
    "token_f1",
    "tokenize",
    "tool_schemas",
]
