"""Tokenizers: load a Hugging Face tokenizer directory, and build a tiny word-level one for test and CPU policies.

Every policy, Qwen3 or a tiny test model, goes through the same `AutoTokenizer.from_pretrained(local_dir)` path,
so the chat format, the sampler and the scorer never know which kind of tokenizer they hold. This module knows
nothing about chat turns (that is `trace_jax.models.chat`) or model weights.

The tiny tokenizer is a Unigram model over GPT-2 style byte-level pieces:

- the 256 byte symbols are always in the vocabulary, so every string is encodable and
  `decode(encode(text)) == text` holds exactly for any unicode text (no normalisation, no unknown token);
- each given word is one piece, both bare (`word`) and with its leading space (`Ġword`), and so are the digits and
  ASCII punctuation, so ordinary text costs about one token per word;
- the chat and tool tags are added tokens with Qwen3's flags: `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` are
  special (dropped by `decode(..., skip_special_tokens=True)`), while `<tool_call>`, `</tool_call>`,
  `<tool_response>`, `</tool_response>`, `<think>`, `</think>` (and this project's `<answer>`, `</answer>`) are
  added but not special, exactly as in Qwen3's `tokenizer.json`, so they survive `skip_special_tokens=True`.
  `eos_token` is `<|im_end|>` and `pad_token` is `<|endoftext|>`, as in Qwen3's `tokenizer_config.json`.
"""

from __future__ import annotations

import logging
import os
import string
from collections.abc import Iterable, Sequence
from pathlib import Path


class _NoTorchNotice(logging.Filter):
    """Drops transformers' import-time notice "PyTorch was not found. Models won't be available ...": this
    project uses transformers for tokenizers only (its models are JAX), so the line only alarms a new user."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("PyTorch was not found")


# Before any `import transformers` below: the notice is logged by the "transformers" logger as the package loads.
logging.getLogger("transformers").addFilter(_NoTorchNotice())

# Special tokens (Qwen3 marks these `special: true`): control tokens, removed by skip_special_tokens.
CHAT_SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Added but not special in Qwen3 (`special: false`): kept by skip_special_tokens so tool calls stay readable.
# `<answer>`/`</answer>` are not in Qwen3; this project's answer format uses them.
TOOL_TAG_TOKENS: tuple[str, ...] = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<answer>",
    "</answer>",
)
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# Unigram log-probabilities: any whole word beats spelling it out, and fewer pieces always win.
_WORD_SCORE = -1.0
_SYMBOL_SCORE = -8.0
_BYTE_SCORE = -12.0
# Words the chat template itself writes, so role headers and tool-call JSON keys are one token each.
TEMPLATE_WORDS: tuple[str, ...] = ("system", "user", "assistant", "tool", "name", "arguments", "Tools", "function")


def load_tokenizer(path: str | os.PathLike):
    """Load a Hugging Face tokenizer from a local directory (never the hub).

    Args:
      path: a directory holding `tokenizer.json` and/or `tokenizer_config.json` (as written by
        `build_word_tokenizer`, `convert_gguf` or `save_pretrained`).

    Returns:
      a `transformers` tokenizer.

    Raises:
      FileNotFoundError: the directory or its tokenizer files are missing.
    """
    from transformers import AutoTokenizer

    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(
            f"tokenizer directory {str(directory)!r} does not exist; expected a local directory with tokenizer.json "
            "(build one with trace_jax.models.tokenizer.build_word_tokenizer or `trace-jax convert-gguf`)"
        )
    if not any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise FileNotFoundError(
            f"{str(directory)!r} has no tokenizer.json or tokenizer_config.json; expected a Hugging Face tokenizer "
            "directory (save one with tokenizer.save_pretrained(dir))"
        )
    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def _byte_symbols() -> dict[int, str]:
    """GPT-2's byte -> printable symbol table (the alphabet of the ByteLevel pre-tokenizer)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return symbols


def _to_byte_level(text: str, symbols: dict[int, str]) -> str:
    return "".join(symbols[b] for b in text.encode("utf-8"))


def build_word_tokenizer(
    words: Iterable[str],
    out_dir: str | os.PathLike,
    *,
    extra_special_tokens: Sequence[str] = (),
) -> Path:
    """Build a word-level tokenizer with byte fallback and save it as a Hugging Face tokenizer directory.

    Vocabulary, in id order: the chat special tokens (ids 0, 1, 2), `extra_special_tokens` (added, special), the
    tool tags (added, not special), the 256 byte symbols, digits and ASCII punctuation (bare and with a leading
    space), then `TEMPLATE_WORDS` and `words` (bare and with a leading space), deduplicated in first-seen order.

    Text is split like GPT-2 (letters, digits, punctuation runs and whitespace runs are separate pieces), so a
    word is matched whole only when it is one such piece: `"don't"` or `"e-mail"` are spelt from smaller
    pieces. Anything not covered falls back to byte symbols; nothing is ever unknown and
    `decode(encode(text)) == text` for every string.

    Args:
      words: vocabulary words; non-empty, no whitespace (unicode is fine).
      out_dir: directory to write `tokenizer.json` and `tokenizer_config.json` into (created if missing).
      extra_special_tokens: more special tokens (e.g. task markers), added after the chat tokens.

    Returns:
      `Path(out_dir)`, loadable with `load_tokenizer` / `AutoTokenizer.from_pretrained`.

    Raises:
      ValueError: a word is empty or contains whitespace.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = _byte_symbols()
    specials = list(CHAT_SPECIAL_TOKENS) + [t for t in extra_special_tokens if t not in CHAT_SPECIAL_TOKENS]
    tags = [t for t in TOOL_TAG_TOKENS if t not in specials]
    pieces: dict[str, float] = {}

    def add(piece: str, score: float) -> None:
        pieces.setdefault(piece, score)

    # Added tokens sit in the model vocabulary too, so their ids are fixed and small; the ByteLevel split never
    # produces them as pieces, and the added-token pass extracts them before the model runs.
    for token in specials + tags:
        add(token, -100.0)
    for byte in range(256):
        add(symbols[byte], _BYTE_SCORE)
    for symbol in string.digits + string.punctuation:
        add(symbol, _SYMBOL_SCORE)
        add(_to_byte_level(" " + symbol, symbols), _SYMBOL_SCORE)
    for word in (*TEMPLATE_WORDS, *words):
        if not isinstance(word, str) or not word or any(ch.isspace() for ch in word):
            raise ValueError(f"word {word!r} must be a non-empty string without whitespace")
        add(_to_byte_level(word, symbols), _WORD_SCORE)
        add(_to_byte_level(" " + word, symbols), _WORD_SCORE)

    backend = Tokenizer(models.Unigram(list(pieces.items()), None, False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in tags])

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
        extra_special_tokens=[t for t in specials if t not in (EOS_TOKEN, PAD_TOKEN)],
    )
    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(directory))
    return directory
