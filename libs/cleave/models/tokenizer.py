"""Tokenizers: the byte-level default that always works, and BPE tokenizers read from local files.

`load_tokenizer(spec)` takes `"bytes"`, a directory (with `tokenizer.json`, or GPT-2's `vocab.json` and
`merges.txt`), a `tokenizer.json` file, or a Hugging Face repo id already in the local cache. Nothing is
ever downloaded. BPE tokenizers need the `tokenizers` package (installed with `transformers`).

A tokenizer whose `tokenizer_config.json` (or `chat_template.jinja`) carries a chat template renders messages with it
(`render_chat`, Jinja2 in a sandbox, as transformers does); one without uses `PLAIN_CHAT`, one line per turn.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from cleave.errors import ConfigError
from cleave.models.hub import cached_snapshot

if TYPE_CHECKING:
    import tokenizers

DEFAULT_TOKENIZER = "bytes"
TOKENIZER_RECORD = "cleave_tokenizer.json"  # written next to an exported checkpoint: {"tokenizer": spec}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)
# end-of-text tokens of the families we know, in the order they are tried
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<|eot_id|>")
# a document's first token: Llama 3's, SentencePiece's; GPT-2 has none and Hugging Face names its eos there
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<|endoftext|>")
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"  # where transformers >= 4.43 saves a tokenizer's chat template
# the chat format of a tokenizer without a template: "role: content" lines
PLAIN_CHAT = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> token ids. `name` is the spec that `load_tokenizer` turns back into this tokenizer."""

    @property
    def name(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_id(self) -> int | None: ...

    @property
    def bos_id(self) -> int | None: ...

    def encode(self, text: str, special: bool = False) -> list[int]:
        """`text`'s ids; a special token's string in it ("<|endoftext|>") is text like any other unless
        `special` (a chat template's rendering, whose control tokens are meant)."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, no files, no dependencies."""

    name = DEFAULT_TOKENIZER
    vocab_size = 256
    eos_id = None
    bos_id = None
    chat_template = None
    special_tokens: dict[str, str] = {}  # noqa: RUF012 - read only

    def encode(self, text: str, special: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        bad = [i for i in ids if not 0 <= i < 256]
        if bad:
            raise ValueError(f"byte tokenizer got ids outside 0..255: {bad[:5]}")
        return bytes(ids).decode("utf-8", errors="replace")  # a cut multi-byte character decodes as U+FFFD

    def write_hf(self, out: Path) -> None:
        """Files `transformers.AutoTokenizer` loads as this tokenizer (an export's): byte b is token b, a
        byte-level BPE of GPT-2's byte alphabet without merges; `tokenizer_files` still reads the folder as
        "bytes" by its record."""
        tk = _tokenizers_module()
        tok = tk.Tokenizer(tk.models.BPE(vocab={c: b for b, c in enumerate(_byte_chars())}, merges=[]))
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = tk.decoders.ByteLevel()
        tok.save(str(out / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
        (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def _byte_chars() -> list[str]:
    """The character a byte-level pre-tokenizer turns each byte into, in byte order (GPT-2's `bytes_to_unicode`:
    printable bytes stay themselves, the others go to U+0100 on, in order)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)}
    chars, moved = [], 0
    for b in range(256):
        chars.append(chr(b) if b in printable else chr(256 + moved))
        moved += b not in printable
    return chars


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` (GPT-2 BPE, Llama 3, ...); special tokens are not added."""

    def __init__(self, tok: tokenizers.Tokenizer, name: str, files: Sequence[Path] = ()) -> None:
        self._tok = tok
        # the same tokenizer reading special tokens' strings as text (quoted "<|endoftext|>" in a corpus
        # forged a document boundary): a copy, as the setting is the tokenizer's own, not an encode argument
        self._ordinary = type(tok).from_str(tok.to_str())
        self._ordinary.encode_special_tokens = True
        self._name = name
        self.files = tuple(files)  # the local files it was read from, copied next to an exported checkpoint
        self._eos_id = next((i for t in EOS_CANDIDATES if (i := tok.token_to_id(t)) is not None), None)
        config = _config_of(self.files)
        template = config.get("chat_template")
        in_file = next((f for f in self.files if f.name == TEMPLATE_FILE), None)
        if in_file is not None:
            template = in_file.read_text()
        self.chat_template: str | None = template if isinstance(template, str) else None
        # bos_token, eos_token, ...: the names a chat template refers to
        self.special_tokens = {k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, str)}
        if self._eos_id is None and "eos_token" in self.special_tokens:
            self._eos_id = tok.token_to_id(self.special_tokens["eos_token"])
        named = self.special_tokens.get("bos_token")
        self._bos_id = next((i for t in (named, *BOS_CANDIDATES) if t and (i := tok.token_to_id(t)) is not None),
                            None)

    @property
    def name(self) -> str:
        return self._name

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    def encode(self, text: str, special: bool = False) -> list[int]:
        return (self._tok if special else self._ordinary).encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


def _config_of(files: Sequence[Path]) -> dict[str, Any]:
    """tokenizer_config.json among a tokenizer's files, or {}; special tokens given as {"content": ...} flattened."""
    path = next((f for f in files if f.name == CONFIG_FILE), None)
    if path is None:
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    return {k: v.get("content") if isinstance(v, dict) and k.endswith("_token") else v for k, v in raw.items()}


def render_chat(tok: Tokenizer, messages: Sequence[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """The conversation as text: the tokenizer's chat template (Jinja2, sandboxed), or `PLAIN_CHAT`."""
    try:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ConfigError("chat messages need the `jinja2` package (installed with transformers)") from None

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    source = getattr(tok, "chat_template", None) or PLAIN_CHAT
    try:
        return env.from_string(source).render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                              **getattr(tok, "special_tokens", {}))
    except TemplateError as e:
        raise ConfigError(f"the chat template of tokenizer {tok.name!r} refused the messages: {e}") from None


def _tokenizers_module() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise ConfigError(
            "BPE tokenizers need the `tokenizers` package: pip install tokenizers (or transformers), "
            f"or use tokenizer {DEFAULT_TOKENIZER!r}"
        ) from None
    return tokenizers


def _from_tokenizer_json(path: Path, name: str) -> HFTokenizer:
    tk = _tokenizers_module()
    try:
        tok = tk.Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises plain Exception subclasses
        raise ConfigError(f"cannot read tokenizer file {path}: {e}") from None
    extra = [
        path.parent / f for f in TOKENIZER_FILES if f != "tokenizer.json" and (path.parent / f).is_file()
    ]
    return HFTokenizer(tok, name, [path, *extra])


def _from_vocab_merges(directory: Path, name: str) -> HFTokenizer:
    """GPT-2's original format: byte-level BPE from vocab.json and merges.txt, no prefix space."""
    tk = _tokenizers_module()
    vocab, merges = directory / "vocab.json", directory / "merges.txt"
    try:
        tok = tk.Tokenizer(tk.models.BPE.from_file(str(vocab), str(merges)))
    except Exception as e:
        raise ConfigError(f"cannot read BPE files {vocab} and {merges}: {e}") from None
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    files = [directory / f for f in TOKENIZER_FILES if (directory / f).is_file()]
    return HFTokenizer(tok, name, files)


def tokenizer_files(directory: Path) -> str | None:
    """Which tokenizer `directory` holds, by its files: "tokenizer.json", "vocab.json" (with merges.txt),
    "record" (an export's record of a tokenizer without files), "sentencepiece" (tokenizer.model alone, which
    needs converting), or None (no tokenizer at all). An export of the byte tokenizer is "record", whose
    tokenizer.json is for `transformers` (`ByteTokenizer.write_hf`)."""
    if recorded_tokenizer(directory) == DEFAULT_TOKENIZER:
        return "record"
    if (directory / "tokenizer.json").is_file():
        return "tokenizer.json"
    if (directory / "vocab.json").is_file() and (directory / "merges.txt").is_file():
        return "vocab.json"
    if (directory / TOKENIZER_RECORD).is_file():
        return "record"
    if (directory / "tokenizer.model").is_file():
        return "sentencepiece"
    return None


def recorded_tokenizer(directory: Path) -> str | None:
    """The tokenizer spec an export's record in `directory` names; None where there is none or it cannot be read."""
    try:
        return json.loads((directory / TOKENIZER_RECORD).read_text()).get("tokenizer")
    except (OSError, ValueError, AttributeError):
        return None


def _from_directory(directory: Path, name: str) -> Tokenizer:
    kind = tokenizer_files(directory)
    if kind == "tokenizer.json":
        return _from_tokenizer_json(directory / "tokenizer.json", name)
    if kind == "vocab.json":
        return _from_vocab_merges(directory, name)
    if kind == "record":
        record = directory / TOKENIZER_RECORD
        try:
            recorded = json.loads(record.read_text()).get("tokenizer")
        except (OSError, ValueError, AttributeError) as e:
            raise ConfigError(f"{record} cannot be read: {e}") from None
        if recorded == DEFAULT_TOKENIZER:
            return ByteTokenizer()
        raise ConfigError(f"{record} names tokenizer {recorded!r} but its files are not in {directory}")
    if kind == "sentencepiece":
        raise ConfigError(
            f"{directory} has only a sentencepiece tokenizer.model; convert it to tokenizer.json once with "
            "transformers: AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)"
        )
    raise ConfigError(
        f"no tokenizer files in {directory}: expected tokenizer.json, or vocab.json and merges.txt, "
        f"or {TOKENIZER_RECORD}"
    )


def recorded_spec(spec: str) -> str:
    """A tokenizer (or model) spec as a file records it (a job, a token file's sidecar, an export's record): a
    local path made absolute, so that it names the same tokenizer read from any working directory; others as
    they are."""
    path = Path(spec).expanduser()
    return str(path.resolve()) if spec != DEFAULT_TOKENIZER and path.exists() else spec


def load_tokenizer(spec: str | Path = DEFAULT_TOKENIZER) -> Tokenizer:
    """`"bytes"`, a local directory or tokenizer.json, or a repo id in the local Hugging Face cache."""
    name = str(spec)
    if name == DEFAULT_TOKENIZER:
        return ByteTokenizer()
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix != ".json":
            raise ConfigError(f"tokenizer file {path} is not a tokenizer.json; pass its directory instead")
        return _from_tokenizer_json(path, name)
    if path.is_dir():
        return _from_directory(path, name)

    snapshot = cached_snapshot(name)
    if snapshot is None:
        raise ConfigError(
            f"tokenizer {name!r} is not {DEFAULT_TOKENIZER!r}, not a local path, and not in the local "
            "Hugging Face cache (nothing is downloaded)"
        )
    return _from_directory(snapshot, name)
