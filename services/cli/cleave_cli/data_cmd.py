"""`cleave prepare-data`: tokenise a text corpus once into a token file that training memory-maps.

Streams the source in bounded pieces (see `cleave.train.sources`), so the corpus may be larger than memory;
the result trains on exactly the tokens the text source itself would give.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TextIO

from cleave.errors import EXIT_INTERRUPTED
from cleave.models.tokenizer import DEFAULT_TOKENIZER, load_tokenizer
from cleave.train.sources import PrepareStats, prepare_data, sidecar_path

DEFAULT_PROGRESS_EVERY_S = 1.0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prepare-data", help="tokenise a text corpus into a token file (.u16/.u32) for training"
    )
    p.add_argument(
        "--source",
        required=True,
        help="builtin, a text file, folder or glob, data.jsonl[:field], or hf:NAME?split=..&field=..",
    )
    p.add_argument(
        "--tokenizer",
        default=DEFAULT_TOKENIZER,
        help="bytes, a tokenizer dir or tokenizer.json, or a cached repo id",
    )
    p.add_argument(
        "--out", type=Path, required=True, help="the token file: .u16 (vocab <= 65536), .u32, or .bin"
    )


class ProgressLine:
    """One status line, rewritten in place on a terminal and printed every few seconds otherwise."""

    def __init__(self, stream: TextIO | None = None, every_s: float = DEFAULT_PROGRESS_EVERY_S) -> None:
        self.stream, self.every_s = stream or sys.stderr, every_s
        self.tty = self.stream.isatty()
        self.t0 = self.last = time.monotonic()
        self.shown = False  # whether a line stands unfinished on the terminal

    def text(self, s: PrepareStats) -> str:
        dt = max(time.monotonic() - self.t0, 1e-9)
        bad = f"  {s.undecodable:,} bytes not UTF-8 (read as U+FFFD: binary files?)" if s.undecodable else ""
        return (
            f"{s.documents:,} documents  {s.chars / 1e6:,.1f} M chars  {s.tokens / 1e6:,.2f} M tokens  "
            f"{s.tokens / dt / 1e6:,.2f} M tokens/s{bad}"
        )

    def update(self, s: PrepareStats) -> None:
        now = time.monotonic()
        if now - self.last < (self.every_s if self.tty else 10 * self.every_s):
            return
        self.last, self.shown = now, self.tty
        self.stream.write(f"\r{self.text(s)}\x1b[K" if self.tty else self.text(s) + "\n")
        self.stream.flush()

    def done(self, s: PrepareStats) -> None:
        self.stream.write(("\r" if self.tty else "") + self.text(s) + ("\x1b[K\n" if self.tty else "\n"))

    def said(self, message: str) -> None:
        """`message` on a line of its own, below a status line left standing."""
        self.stream.write(("\n" if self.shown else "") + message + "\n")
        self.stream.flush()


def run(args: argparse.Namespace) -> int:
    tok = load_tokenizer(args.tokenizer)
    progress = ProgressLine()
    try:
        stats = prepare_data(args.source, tok, args.out, progress.update)
    except KeyboardInterrupt:  # (prepare_data removed its .tmp and put back a sidecar it had replaced)
        kept = f"{args.out} is as it was" if args.out.exists() else f"no {args.out} made"
        progress.said(f"cleave: prepare-data interrupted: nothing written, {kept}")
        return EXIT_INTERRUPTED
    progress.done(stats)
    print(
        f"wrote {stats.tokens:,} tokens ({tok.name}, vocab {tok.vocab_size}) to {args.out} "
        f"and {sidecar_path(args.out).name}; train on it with --data {args.out} --tokenizer {tok.name}"
    )
    return 0
