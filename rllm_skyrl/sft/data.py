"""rLLM's ``messages`` rows -> SkyRL's pretokenized SFT rows, masked the way rLLM defines it.

SkyRL's SFT trainer tokenizes with its own rule (the chat template; the last or every assistant
turn). rLLM's ``SFTSpec.tokenize_method`` means something else: ``cumulative`` renders each message
with rLLM's chat-template parser and trains on every assistant message, ``stepwise`` on the last one
only, ``hf_template`` cuts the tokenizer's own rendering of the conversation at message boundaries
and trains on every assistant message. Rows are tokenized here, before Ray starts, and SkyRL's
trainer reads them through its pretokenized path (``input_ids`` with a full-length 0/1
``loss_mask``), so both trainers' code runs unchanged. A bad row is refused naming its index.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rllm.trainer.sft.backend import SFTConfigError
from rllm.trainer.sft.spec import TOKENIZE_METHODS

Message = dict[str, Any]


def rows_of(dataset: Any) -> list[Any]:
    """The rows of an rLLM ``Dataset`` (``get_data()``), an HF dataset or a plain list."""
    if hasattr(dataset, "get_data"):
        return list(dataset.get_data())
    return list(dataset)


def _plain(value: Any) -> Any:
    """Parquet hands nested lists back as numpy arrays (of dicts); templates want lists."""
    if isinstance(value, np.ndarray):
        return [_plain(item) for item in value.tolist()]
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    return value


def conversation(row: Any, label: str) -> list[Message]:
    """The row's messages as plain dicts; an error naming ``label`` if it cannot be trained on."""
    messages = _plain(row.get("messages")) if isinstance(row, Mapping) else None
    if not isinstance(messages, list) or not messages:
        raise SFTConfigError(
            f"{label}: 'messages' must be a non-empty list of {{'role', 'content'}} turns, "
            f"got {messages!r:.80}"
        )
    for index, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or "content" not in message
        ):
            raise SFTConfigError(
                f"{label}, message {index}: needs a string 'role' and a 'content', got {message!r:.80}"
            )
        if message["content"] is None:
            message["content"] = ""
        if not isinstance(message["content"], str):
            raise SFTConfigError(
                f"{label}, message {index}: 'content' must be text, got {type(message['content']).__name__}"
            )
    if not any(message["role"] == "assistant" for message in messages):
        raise SFTConfigError(f"{label}: no assistant message, so nothing to train on")
    return messages


def check_rows(dataset: Any, split: str) -> int:
    """Every row of ``dataset`` is a trainable conversation; returns how many there are."""
    rows = rows_of(dataset) if dataset is not None else []
    if not rows:
        raise SFTConfigError(f"{split} dataset is empty: give rows with a 'messages' column")
    for index, row in enumerate(rows):
        conversation(row, f"{split} row {index}")
    return len(rows)


def _template_segments(messages: Sequence[Message], tokenizer: Any) -> list[str]:
    """The tokenizer's rendering of the whole conversation, cut where each message's prefix ends."""
    ends = [
        len(tokenizer.apply_chat_template(list(messages[: i + 1]), tokenize=False))
        for i in range(len(messages))
    ]
    text = tokenizer.apply_chat_template(list(messages), tokenize=False)
    return [text[start:end] for start, end in zip([0, *ends[:-1]], ends, strict=True)]


def tokens_and_mask(
    messages: Sequence[Message], tokenizer: Any, method: str, parser: Any = None
) -> tuple[list[int], list[int]]:
    """``input_ids`` and a 0/1 ``loss_mask`` of the same length, by rLLM's ``method``.

    ``parser``: rLLM's ``ChatTemplateParser`` for the tokenizer (needed for cumulative and stepwise).
    """
    if method not in TOKENIZE_METHODS:
        raise SFTConfigError(f"tokenize_method={method!r}: use one of {', '.join(TOKENIZE_METHODS)}")
    if method == "hf_template":
        segments = _template_segments(messages, tokenizer)
    else:
        segments = [
            parser.parse([m], is_first_msg=i == 0, add_generation_prompt=False)
            for i, m in enumerate(messages)
        ]
    assistant = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    trained = set(assistant[-1:] if method == "stepwise" else assistant)
    ids: list[int] = []
    mask: list[int] = []
    for index, segment in enumerate(segments):
        piece = tokenizer.encode(segment, add_special_tokens=False)
        ids += piece
        mask += [int(index in trained)] * len(piece)
    return ids, mask


@dataclass(frozen=True)
class TokenizedSplit:
    """One split written for SkyRL's pretokenized loader."""

    path: Path
    rows: int
    dropped: int  # rows whose trained tokens all lay beyond max_length
    loss_tokens: int


def write_pretokenized(
    rows: Iterable[Any], tokenizer: Any, method: str, max_length: int | None, path: Path, split: str
) -> TokenizedSplit:
    """Tokenize ``rows`` into a parquet file of ``input_ids`` / ``loss_mask`` rows at ``path``."""
    import pandas as pd
    from rllm.parser import ChatTemplateParser

    parser = None if method == "hf_template" else ChatTemplateParser.get_parser(tokenizer)
    kept: list[dict[str, list[int]]] = []
    dropped = 0
    for index, row in enumerate(rows):
        ids, mask = tokens_and_mask(conversation(row, f"{split} row {index}"), tokenizer, method, parser)
        if max_length is not None:
            ids, mask = ids[:max_length], mask[:max_length]
        if not any(mask):
            dropped += 1
            continue
        kept.append({"input_ids": ids, "loss_mask": mask})
    if not kept:
        raise SFTConfigError(
            f"{split} dataset: no row keeps an assistant token within max_length={max_length}; "
            "raise max_length"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(kept).to_parquet(path, index=False)
    loss_tokens = sum(sum(row["loss_mask"]) for row in kept)
    return TokenizedSplit(path=path, rows=len(kept), dropped=dropped, loss_tokens=loss_tokens)
