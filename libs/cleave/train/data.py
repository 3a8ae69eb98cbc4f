"""Training data: a tokenised corpus split into train and validation, and deterministic, resumable batches.

The batch of step `s` depends only on (seed, s), so the data position of a run is its step number: the PS
checkpoint records the last committed step, and a resumed run draws exactly the batches it would have drawn.
Sources (text, folders, JSONL, Hugging Face datasets, token files) are in `cleave.train.sources`; instruction
data (prompt/response, chat messages: loss on the responses only) in `cleave.train.examples`.

Two ways of drawing a batch (the job's `sampling`):
- `random`: each row a window of seq + 1 tokens at a random place, drawn anew for every batch;
- `epochs`: the items (the non-overlapping windows of the text, or the examples of instruction data) in a
  shuffled order per epoch, each once per epoch, batch after batch: row b of step s is item
  `order(epoch)[i mod n]` with i = s * batch_size + b and epoch = i div n. Instruction data is always read so.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from cleave.errors import ConfigError
from cleave.models.tokenizer import DEFAULT_TOKENIZER, Tokenizer, load_tokenizer
from cleave.train import examples, sources
from cleave.train.job import JobConfig
from cleave.train.sources import builtin_text

__all__ = ["DEFAULT_MIN_TOKENS", "Corpus", "builtin_text", "check_vocab"]

DEFAULT_MIN_TOKENS = 4096
SEED_STRIDE = 1_000_003  # the generator of step s is seeded with seed * SEED_STRIDE + s
EPOCH_SALT = 7_919  # the order of epoch e is seeded with seed * SEED_STRIDE + EPOCH_SALT - e (apart from steps')


def _home(spec: str) -> Path | None:
    """Where a local tokenizer lives: its folder (a `tokenizer.json` named by itself is its folder's), resolved."""
    p = Path(spec).expanduser()
    if p.name == "tokenizer.json" and p.is_file():
        p = p.parent
    return p.resolve() if p.exists() else None


def _same_tokenizer(a: str, b: str) -> bool:
    return a == b or (_home(a) is not None and _home(a) == _home(b))


def _check_tokenizer(src: sources.Source, tf: sources.TokenFile, name: str) -> None:
    if tf.tokenizer is not None and not _same_tokenizer(tf.tokenizer, name):
        raise ConfigError(
            f"data={src.spec!r} was tokenised with {tf.tokenizer!r}; set tokenizer={tf.tokenizer!r} "
            f"(it is {name!r})"
        )


def check_token_file(src: sources.Source, tokenizer: str, model_vocab: int, preset: str) -> None:
    """What a token file's sidecar says, against the job, without reading its ids (the PS reads them): the
    tokenizer it was made with, and a vocabulary the model has an embedding for every id of."""
    tf = sources.open_tokens(src)
    _check_tokenizer(src, tf, tokenizer)
    if tf.vocab_size is not None:
        check_vocab(tf.tokenizer or tokenizer, tf.vocab_size, model_vocab, preset)


def _token_file(src: sources.Source, tokenizer: str | Tokenizer) -> tuple[np.ndarray, str, int]:
    tf = sources.open_tokens(src)
    name = tokenizer if isinstance(tokenizer, str) else tokenizer.name
    _check_tokenizer(src, tf, name)
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
    """The token ids of a data source, split into train (the first 1 - val_fraction) and validation parts; for
    instruction data, its examples (the last val_fraction of them for validation)."""

    def __init__(
        self,
        source: str = "builtin",
        val_fraction: float = 0.1,
        tokenizer: str | Tokenizer = DEFAULT_TOKENIZER,
        sampling: str = "random",
    ) -> None:
        self.source = source
        src = sources.parse_source(source)
        self.examples: dict[str, list[examples.Example]] | None = None
        self.skipped = 0  # instruction rows with nothing to learn from
        self._orders: dict[tuple[str, int, int], np.ndarray] = {}
        if src.kind == "tokens":
            tokens, self.tokenizer, self.vocab_size = _token_file(src, tokenizer)
        else:
            tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
            self.tokenizer, self.vocab_size, self.pad_id = tok.name, tok.vocab_size, tok.eos_id or 0
            if examples.kind(src) is not None:
                self._split_examples(*examples.read_examples(src, tok), val_fraction)
                self.sampling = "epochs"
                return
            tokens = sources.tokenize(src, tok)
        self.sampling = sampling
        if len(tokens) < DEFAULT_MIN_TOKENS:
            raise ConfigError(f"data={source!r} has {len(tokens)} tokens; need at least {DEFAULT_MIN_TOKENS}")
        split = int(len(tokens) * (1 - val_fraction))
        self.train, self.val = tokens[:split], tokens[split:]  # 1-D arrays (a memory map for token files)

    @classmethod
    def for_job(cls, job: JobConfig, source: str | None = None, tokenizer: str | Tokenizer | None = None) -> Corpus:
        """The job's data (or `source`, a client's own) read as the job says, with its tokenizer (or `tokenizer`)."""
        return cls(source or job.data, job.val_fraction, tokenizer or job.tokenizer, job.sampling)

    def _split_examples(self, items: list[examples.Example], skipped: int, val_fraction: float) -> None:
        n_val = int(len(items) * val_fraction)
        if val_fraction > 0 and len(items) > 1:
            n_val = max(1, n_val)
        self.examples = {"train": items[: len(items) - n_val], "val": items[len(items) - n_val :]}
        self.skipped = skipped
        if not self.examples["train"]:
            raise ConfigError(f"data={self.source!r} has {len(items)} examples: none left to train on")

    @property
    def train_tokens(self) -> int:
        """The size of the training part in tokens (what a client reports about its data, and nothing else)."""
        if self.examples is not None:
            return sum(len(ex.ids) for ex in self.examples["train"])
        return len(self.train)

    def _order(self, split: str, seed: int, epoch: int, n: int) -> np.ndarray:
        key = (split, seed, epoch)
        if key not in self._orders:
            if len(self._orders) > 4:
                self._orders.clear()
            g = torch.Generator().manual_seed(seed * SEED_STRIDE + EPOCH_SALT - epoch)
            self._orders[key] = torch.randperm(n, generator=g).numpy()
        return self._orders[key]

    def _items(self, split: str, seed: int, step: int, batch_size: int, n: int) -> list[int]:
        """The items of `step`'s rows under epoch sampling: each item once per epoch, in the epoch's order."""
        first = step * batch_size
        return [int(self._order(split, seed, i // n, n)[i % n]) for i in range(first, first + batch_size)]

    def batch(
        self, seed: int, step: int, batch_size: int, seq: int, split: str = "train"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, each (batch_size, seq) int64, fixed by (seed, step); targets the
        loss skips (prompts, padding) are `examples.IGNORE`."""
        if self.examples is not None:
            items = self.examples[split]
            if not items:
                raise ConfigError(f"data={self.source!r} has no {split} examples; raise val_fraction")
            picked = [examples.window(items[i], seq, self.pad_id)
                      for i in self._items(split, seed, step, batch_size, len(items))]
            x, y = (torch.from_numpy(np.stack(t)) for t in zip(*picked, strict=True))
            return x, y
        data = self.train if split == "train" else self.val
        if len(data) <= seq + 1:
            raise ConfigError(f"the {split} split has {len(data)} tokens; it needs at least seq_len + 2 = {seq + 2}")
        if self.sampling == "epochs":
            starts = [i * seq for i in self._items(split, seed, step, batch_size, (len(data) - 1) // seq)]
        else:
            g = torch.Generator().manual_seed(seed * SEED_STRIDE + step)
            starts = torch.randint(0, len(data) - seq - 1, (batch_size,), generator=g).tolist()
        rows = np.stack([data[i : i + seq + 1] for i in starts]).astype(np.int64)  # (B, seq + 1)
        xy = torch.from_numpy(rows)
        return xy[:, :-1].contiguous(), xy[:, 1:].contiguous()


def check_vocab(tokenizer: str, tokens: int, vocab_size: int, preset: str) -> None:
    """The model must have an embedding for every token id the data can hold (`tokens`: its tokenizer's)."""
    if tokens > vocab_size:
        raise ConfigError(
            f"tokenizer {tokenizer!r} has {tokens} tokens but preset {preset!r} "
            f"has vocab_size={vocab_size}; choose a preset with a larger vocabulary or "
            f"tokenizer={DEFAULT_TOKENIZER!r}"
        )
