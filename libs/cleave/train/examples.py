"""Instruction data: JSON lines of prompt/response pairs or chat messages, tokenised with a loss mask.

A JSONL source whose rows have no "text" field but either

    {"prompt": "...", "response": "..."}                       the response follows the prompt directly
    {"messages": [{"role": "user", "content": "..."}, ...]}    rendered with the tokenizer's chat template

is instruction data (`kind`). Each row becomes one example: its token ids and a mask that is 1 exactly on the
tokens the loss is taken on: the response (and the end-of-text token after it, when the tokenizer has one), or
every assistant turn of a conversation. A conversation's turns are located by rendering its prefixes (the
messages before an assistant turn with the generation prompt, then with that turn), so any template whose
renderings extend one another works; one that does not is refused with the reason. Rows with nothing to
learn from (no response token) are left out and counted.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cleave.errors import ConfigError
from cleave.models.tokenizer import Tokenizer, render_chat
from cleave.train.reading import open_text
from cleave.train.sources import DEFAULT_JSONL_FIELD, Source

KINDS = ("prompt", "messages")
IGNORE = -100  # a target the loss skips (torch's cross_entropy ignore_index)
PEEK_ROWS = 16  # rows read to decide what kind of JSONL a source is


@dataclass(frozen=True)
class Example:
    ids: np.ndarray  # int64 token ids
    mask: np.ndarray  # bool, True on the tokens the loss is taken on


def _rows(src: Source) -> Iterator[tuple[int, object]]:
    with open_text(Path(src.path).expanduser(), src.spec, errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"data={src.spec!r}: line {lineno} is not JSON ({e.msg} at column "
                                      f"{e.colno})") from None


def kind(src: Source) -> str | None:
    """"prompt" or "messages" when a JSONL source holds instruction data, else None (plain text)."""
    if src.kind != "jsonl" or src.text_field != DEFAULT_JSONL_FIELD:
        return None
    for i, (_, row) in enumerate(_rows(src)):
        if not isinstance(row, dict) or DEFAULT_JSONL_FIELD in row or i >= PEEK_ROWS:
            return None
        if isinstance(row.get("messages"), list):
            return "messages"
        if isinstance(row.get("prompt"), str) and isinstance(row.get("response"), str):
            return "prompt"
    return None


def _encode(tok: Tokenizer, pieces: Sequence[tuple[str, bool]], eos_after: bool, special: bool = False) -> Example:
    """`special`: the pieces are a chat template's rendering, whose control tokens are meant as such."""
    ids: list[int] = []
    mask: list[bool] = []
    for text, learn in pieces:
        got = tok.encode(text, special) if text else []
        ids += got
        mask += [learn] * len(got)
    if eos_after and tok.eos_id is not None:
        ids.append(tok.eos_id)
        mask.append(True)
    return Example(np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool))


def _chat_pieces(tok: Tokenizer, messages: list[dict], where: str) -> list[tuple[str, bool]]:
    """The rendered conversation cut into (text, is an assistant turn) pieces."""
    full = render_chat(tok, messages)
    pieces, pos = [], 0
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        prompt = render_chat(tok, messages[:i], add_generation_prompt=True)
        upto = render_chat(tok, messages[: i + 1])
        start = len(prompt)
        if not (full.startswith(upto) and upto.startswith(prompt) and pos <= start):
            raise ConfigError(f"{where}: the chat template of tokenizer {tok.name!r} does not render a "
                              "conversation as the extension of its first turns; its assistant turns cannot "
                              "be told apart (use prompt/response rows)")
        pieces += [(full[pos:start], False), (full[start:len(upto)], True)]
        pos = len(upto)
    pieces.append((full[pos:], False))
    return pieces


def _messages(row: dict, where: str) -> list[dict]:
    messages = row.get("messages")
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    ):
        raise ConfigError(f"{where}: 'messages' must be a list of {{\"role\": ..., \"content\": ...}}")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def read_examples(src: Source, tok: Tokenizer) -> tuple[list[Example], int]:
    """Every example of an instruction source, in file order, and how many rows had nothing to learn from."""
    what = kind(src)
    if what is None:
        raise ConfigError(f"data={src.spec!r} is not instruction data (rows with prompt/response or messages)")
    out, empty = [], 0
    for lineno, row in _rows(src):
        where = f"data={src.spec!r}, line {lineno}"
        if not isinstance(row, dict):
            raise ConfigError(f"{where}: expected a JSON object")
        if what == "prompt":
            prompt, response = row.get("prompt"), row.get("response")
            if not (isinstance(prompt, str) and isinstance(response, str)):
                raise ConfigError(f"{where}: expected string fields 'prompt' and 'response'")
            ex = _encode(tok, [(prompt, False), (response, True)], eos_after=True)
        else:
            ex = _encode(tok, _chat_pieces(tok, _messages(row, where), where), eos_after=False, special=True)
        if ex.mask[1:].any():  # a target of the loss is a token after the first
            out.append(ex)
        else:
            empty += 1
    if not out:
        raise ConfigError(f"data={src.spec!r}: no example has a response to learn from")
    return out, empty


def window(ex: Example, seq: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """One example as a row of seq + 1 token ids and seq targets (IGNORE off the mask and on padding).

    A longer example keeps a window that starts at most half a row before its first response token."""
    n, width = len(ex.ids), seq + 1
    first = int(np.argmax(ex.mask))
    start = max(0, min(first - width // 2, n - width))
    ids, mask = ex.ids[start : start + width], ex.mask[start : start + width]
    row = np.full(width, pad_id, dtype=np.int64)
    learn = np.zeros(width, dtype=bool)
    row[: len(ids)], learn[: len(ids)] = ids, mask
    targets = np.where(learn[1:], row[1:], IGNORE)
    return row[:-1], targets
