"""Text data: the built-in corpus, byte-level tokens, and deterministic, resumable batches.

The batch of step `s` depends only on (seed, s), so the data position of a run is just its step number.
"""

from __future__ import annotations

from pathlib import Path

import torch

from cleave.errors import ConfigError

DEFAULT_MIN_TOKENS = 4096


def builtin_text() -> str:
    """Python's own documentation topics: ships with every CPython, so the demo needs no download."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def load_text(source: str) -> str:
    if source == "builtin":
        return builtin_text()
    path = Path(source)
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise ConfigError(f"data={source!r}: cannot read it ({e.strerror})") from None


class Corpus:
    """Byte-level tokens of a text, split into train and validation parts."""

    def __init__(self, source: str = "builtin", val_fraction: float = 0.1) -> None:
        tokens = torch.frombuffer(bytearray(load_text(source).encode("utf-8")), dtype=torch.uint8)
        if tokens.numel() < DEFAULT_MIN_TOKENS:
            raise ConfigError(f"data={source!r} has {tokens.numel()} bytes; need at least {DEFAULT_MIN_TOKENS}")
        split = int(tokens.numel() * (1 - val_fraction))
        self.train, self.val = tokens[:split].long(), tokens[split:].long()

    def batch(self, seed: int, step: int, batch_size: int, seq: int, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, each (batch_size, seq), fixed by (seed, step)."""
        data = self.train if split == "train" else self.val
        if data.numel() <= seq + 1:
            raise ConfigError(f"the {split} split has {data.numel()} tokens, fewer than seq_len+1={seq + 1}")
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        ix = torch.randint(0, data.numel() - seq - 1, (batch_size,), generator=g)
        x = torch.stack([data[i : i + seq] for i in ix.tolist()])
        y = torch.stack([data[i + 1 : i + 1 + seq] for i in ix.tolist()])
        return x, y
