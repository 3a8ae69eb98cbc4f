"""Instruction data (prompt/response and chat messages, loss only on the responses) and epoch sampling."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as HFTok
from tokenizers import decoders, models, pre_tokenizers, trainers

from cleave.errors import ConfigError
from cleave.methods.common import lm_loss
from cleave.models import build_model, get_preset
from cleave.models.tokenizer import load_tokenizer
from cleave.train.data import Corpus
from cleave.train.examples import IGNORE
from cleave.train.job import JobConfig

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def bpe_dir(tmp_path: Path, template: str | None) -> Path:
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["what is two and two? four. hello there, how are you?"] * 10, trainer)
    d = tmp_path / "tok"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    config = {"eos_token": "<|endoftext|>", **({"chat_template": template} if template else {})}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


def targets_text(corpus: Corpus, tok, y: torch.Tensor) -> list[str]:
    return [tok.decode([int(t) for t in row if t != IGNORE]) for row in y]


def test_prompt_response_rows_learn_only_the_response(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"Q{i}: what? ", "response": f"answer {i}."} for i in range(6)])
    corpus = Corpus(data, val_fraction=0.0)
    assert corpus.examples is not None and corpus.sampling == "epochs" and len(corpus.examples["train"]) == 6
    x, y = corpus.batch(0, 0, 6, 32)
    assert x.shape == y.shape == (6, 32)
    tok = load_tokenizer("bytes")
    got = sorted(targets_text(corpus, tok, y))
    # the first response byte is predicted from the prompt's last: every response byte is a target, no prompt byte
    assert got == sorted(f"answer {i}." for i in range(6))
    model = build_model(get_preset("tiny"), seed=0)
    assert torch.isfinite(lm_loss(model, x, y))  # padding and prompts are skipped by the loss


def test_chat_messages_use_the_tokenizers_template_and_learn_assistant_turns(tmp_path):
    tok = load_tokenizer(str(bpe_dir(tmp_path, TEMPLATE)))
    assert tok.chat_template == TEMPLATE and tok.eos_id is not None
    rows = [{"messages": [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "how are you"},
                          {"role": "user", "content": "what is two and two"}, {"role": "assistant", "content": "four"}]}]
    corpus = Corpus(write_jsonl(tmp_path / "c.jsonl", rows), val_fraction=0.0, tokenizer=tok)
    (ex,) = corpus.examples["train"]
    assert tok.decode(ex.ids.tolist()) == ("<|user|>hello there<|endoftext|><|assistant|>how are you<|endoftext|>"
                                           "<|user|>what is two and two<|endoftext|><|assistant|>four<|endoftext|>")
    learned = tok.decode(ex.ids[ex.mask].tolist())
    assert learned == "how are you<|endoftext|>four<|endoftext|>"


def test_chat_without_a_template_uses_plain_lines(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}] * 3
    corpus = Corpus(write_jsonl(tmp_path / "c.jsonl", rows), val_fraction=0.0)
    ex = corpus.examples["train"][0]
    tok = load_tokenizer("bytes")
    assert tok.decode(ex.ids.tolist()) == "user: hi\nassistant: hello\n"
    assert tok.decode(ex.ids[ex.mask].tolist()) == "hello\n"


def test_rows_without_anything_to_learn_are_skipped_and_bad_rows_refused(tmp_path):
    rows = [{"prompt": "p", "response": ""}, {"prompt": "p", "response": "r!"}]
    corpus = Corpus(write_jsonl(tmp_path / "a.jsonl", rows), val_fraction=0.0)
    assert corpus.skipped == 1 and len(corpus.examples["train"]) == 1
    bad = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "p", "response": "r"}, {"prompt": 3, "response": "r"}])
    with pytest.raises(ConfigError, match="line 2"):
        Corpus(bad)
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": "plain " * 2000}])
    assert Corpus(text).examples is None  # a "text" field is plain text, as before


def test_epochs_visit_every_item_once_per_epoch_and_are_resumable(tmp_path):
    rows = [{"prompt": f"{i:02d}", "response": f"<{i:02d}>"} for i in range(10)]
    corpus = Corpus(write_jsonl(tmp_path / "d.jsonl", rows), val_fraction=0.0)
    seen = [targets_text(corpus, load_tokenizer("bytes"), corpus.batch(3, s, 5, 8)[1]) for s in range(4)]
    first, second = sum(seen[:2], []), sum(seen[2:], [])
    assert sorted(first) == sorted(second) == sorted(f"<{i:02d}>" for i in range(10))  # without replacement
    assert first != second  # each epoch in its own order
    again = Corpus(write_jsonl(tmp_path / "d.jsonl", rows), val_fraction=0.0)
    assert torch.equal(again.batch(3, 2, 5, 8)[0], corpus.batch(3, 2, 5, 8)[0])  # a function of (seed, step)


def test_text_in_epochs_covers_each_window_once(tmp_path):
    job = JobConfig(preset="tiny", sampling="epochs", seq_len=16, batch_size=4, val_fraction=0.0)
    corpus = Corpus.for_job(job)
    n = (len(corpus.train) - 1) // 16
    starts = []
    for s in range(-(-n // 4)):
        x, _ = corpus.batch(job.seed, s, 4, 16)
        starts += [row.tolist() for row in x]
    firsts = Counter(tuple(r) for r in starts[:n])
    want = Counter(tuple(corpus.train[i * 16 : i * 16 + 16].astype(np.int64).tolist()) for i in range(n))
    assert firsts == want  # the first epoch is every window once
    assert corpus.train_tokens == len(corpus.train)
