"""Search environment: an offline corpus, BM25 search (cached on disk), gpt-oss-style browser tools over any corpus
(``corpus_browser``) and answer checking; a synthetic BrowseComp-Plus-sized corpus for benchmarks (``synthetic``).

Also the procedural task family: seeded worlds (``world``), verified multi-hop questions with gold clue chains
(``tasks``) and an oracle agent that solves them through the tools (``oracle``). Datasets live in ``trace_jax.data``.
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
from trace_jax.envs.corpus_browser import corpus_browser, retrieval_noise_filter
from trace_jax.envs.oracle import (
    SYSTEM_PROMPT,
    OracleConfig,
    OracleResult,
    initial_messages,
    make_browser,
    solve,
    solve_all,
    solve_rate,
    trajectory_vocabulary,
)
from trace_jax.envs.search_index import SearchIndex, default_cache_dir, index_key, tokenize
from trace_jax.envs.synthetic import SyntheticCorpusConfig, synthetic_corpus, synthetic_documents
from trace_jax.envs.tasks import (
    QUESTION_TYPES,
    Clue,
    Task,
    TaskConfig,
    TaskError,
    clue_matches,
    generate_splits,
    generate_tasks,
    verify_task,
)
from trace_jax.envs.world import World, WorldConfig, build_world, vocabulary

__all__ = [
    "QUESTION_TYPES",
    "SYSTEM_PROMPT",
    "Clue",
    "OracleConfig",
    "OracleResult",
    "Task",
    "TaskConfig",
    "TaskError",
    "World",
    "WorldConfig",
    "build_world",
    "clue_matches",
    "generate_splits",
    "generate_tasks",
    "initial_messages",
    "make_browser",
    "solve",
    "solve_all",
    "solve_rate",
    "trajectory_vocabulary",
    "verify_task",
    "vocabulary",
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
    "SyntheticCorpusConfig",
    "ToolError",
    "answer_reward",
    "corpus_browser",
    "default_cache_dir",
    "exact_match",
    "extract_answer",
    "index_key",
    "normalize_answer",
    "observation_templates",
    "parse_arguments",
    "retrieval_noise_filter",
    "synthetic_corpus",
    "synthetic_documents",
    "token_f1",
    "tokenize",
    "tool_schemas",
]
