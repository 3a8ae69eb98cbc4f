"""Training data: a tokenised corpus split into train and validation, and deterministic, resumable batches.

The batch of step `s` depends only on (seed, s), so the data position of a run is its step number: the PS
checkpoint records the last committed step, and a resumed run draws exactly the batches it would have drawn.
Sources (text, folders, JSONL, Hugging Face datasets, token files) are in `cleave.train.sources`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from cleave.errors import ConfigError
from cleave.models.tokenizer import DEFAULT_TOKENIZER, Tokenizer, load_tokenizer
from cleave.train import sources
from cleave.train.sources import builtin_text

__all__ = ["DEFAULT_MIN_TOKENS", "Corpus", "builtin_text", "check_vocab"]

DEFAULT_MIN_TOKENS = 4096
SEED_STRIDE = 1_000_003  # the generator of step s is seeded with seed * SEED_STRIDE + s


def _same_tokenizer(a: str, b: str) -> bool:
    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def _token_file(src: sources.Source, tokenizer: str | Tokenizer) -> tuple[np.ndarray, str, int]:
    tf = sources.open_tokens(src)
    name = tokenizer if isinstance(tokenizer, str) else tokenizer.name
    if tf.tokenizer is not None and not _same_tokenizer(tf.tokenizer, name):
        raise ConfigError(
            f"data={src.spec!r} was tokenised with {tf.tokenizer!r}; set tokenizer={tf.tokenizer!r} "
            f"(it is {name!r})"
        )
    vocab = tf.vocab_size
    if vocab is None:
        vocab = (load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer).vocab_size
    top = int(tf.tokens.max()) if len(tf.tokens) else -1
    if top >= vocab:
        raise ConfigError(
            f"data={src.spec!r} holds token id {top}, outside the tokenizer's vocabulary of {vocab}"
        )
    return tf.tokens, name, vocab


class Corpus:
    """The token ids of a data source, split into train (the first 1 - val_fraction) and validation parts."""

    def __init__(
        self,
        source: str = "builtin",
        val_fraction: float = 0.1,
        tokenizer: str | Tokenizer = DEFAULT_TOKENIZER,
    ) -> None:
        self.source = source
        src = sources.parse_source(source)
        if src.kind == "tokens":
            tokens, self.tokenizer, self.vocab_size = _token_file(src, tokenizer)
        else:
            tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
            tokens, self.tokenizer, self.vocab_size = sources.tokenize(src, tok), tok.name, tok.vocab_size
        if len(tokens) < DEFAULT_MIN_TOKENS:
            raise ConfigError(f"data={source!r} has {len(tokens)} tokens; need at least {DEFAULT_MIN_TOKENS}")
        split = int(len(tokens) * (1 - val_fraction))
        self.train, self.val = tokens[:split], tokens[split:]  # 1-D arrays (a memory map for token files)

    def batch(
        self, seed: int, step: int, batch_size: int, seq: int, split: str = "train"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, each (batch_size, seq) int64, fixed by (seed, step)."""
        data = self.train if split == "train" else self.val
        if len(data) <= seq + 1:
            raise ConfigError(f"the {split} split has {len(data)} tokens, fewer than seq_len+1={seq + 1}")
        g = torch.Generator().manual_seed(seed * SEED_STRIDE + step)
        ix = torch.randint(0, len(data) - seq - 1, (batch_size,), generator=g)
        rows = np.stack([data[i : i + seq + 1] for i in ix.tolist()]).astype(np.int64)  # (B, seq + 1)
        xy = torch.from_numpy(rows)
        return xy[:, :-1].contiguous(), xy[:, 1:].contiguous()


def check_vocab(corpus: Corpus, vocab_size: int, preset: str) -> None:
    """The model must have an embedding for every token id the data can hold."""
    if corpus.vocab_size > vocab_size:
        raise ConfigError(
            f"tokenizer {corpus.tokenizer!r} has {corpus.vocab_size} tokens but preset {preset!r} "
            f"has vocab_size={vocab_size}; choose a preset with a larger vocabulary or "
            f"tokenizer={DEFAULT_TOKENIZER!r}"
        )
