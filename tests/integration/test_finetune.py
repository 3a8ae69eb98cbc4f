"""Federated fine-tuning as a lab does it (docs/methods.md, "Fine-tuning across sites", is this test):

a tiny GPT-2 saved by transformers with its own BPE tokenizer (and chat template) on the PS only; two sites,
each a worker holding private data the other cannot see (site A: plain notes; site B: chat conversations),
neither able to read the base model's directory (each runs in a mount namespace where that directory, the
other site's data and the PS's data are empty). FedAvg with `own_data`, the whole model, then LoRA. The
exports load in transformers; scored by transformers with the job's tokenizer on the sites' text they have a
lower loss than the base; the LoRA run's PEFT adapter loads with peft onto the base and gives the merged
export's logits. Nothing the PS logs or keeps names a site's data or quotes it.
"""

from __future__ import annotations

import json
import random
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cleave.api import state
from cleave.api.fleet import LocalFleet
from cleave.train.job import JobConfig
from tests.integration.test_export import export

transformers = peft = None  # imported by the tests that run (`world`): importing peft takes ~4 s, too much to
# spend collecting tests that the default run leaves out
pytestmark = [pytest.mark.slow,  # two fine-tuning jobs on a real stack (~2 min)
              pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SEQ = 64
CALM = {"CLEAVE_SCHEDULER_LIVENESS_S": "5"}  # runs compared member for member: a loaded machine's late
# heartbeats must not drop a worker from a round (the default 1 s does, with several test stacks on 2 cores)


def notes(seed: int, n: int) -> str:
    """Site A's private lab notes (synthetic, fixed by the seed)."""
    rng = random.Random(seed)
    things = ["sample", "culture", "assay", "buffer", "slide", "plate"]
    return "".join(f"{rng.choice(things).capitalize()} {rng.randint(1, 99)} was kept at {rng.randint(2, 8)} degrees "
                   f"for {rng.randint(1, 48)} hours; the reading was 0.{rng.randint(10, 99)}.\n" for _ in range(n))


def chats(seed: int, n: int) -> list[dict]:
    """Site B's private conversations (synthetic)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(2, 30), rng.randint(2, 30)
        rows.append({"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                                  {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]})
    return rows


def base_model(path: Path, corpus: str) -> None:
    """A tiny GPT-2 and its own byte-level BPE tokenizer, trained and saved offline by transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus.splitlines(), trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                                bos_token="<|endoftext|>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=len(fast), n_positions=SEQ, n_embd=64, n_layer=2, n_head=2,
                                  bos_token_id=fast.eos_token_id, eos_token_id=fast.eos_token_id)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(path)


def hidden(paths: list[Path], argv: list[str]) -> list[str]:
    """`argv` in a mount namespace where each of `paths` is an empty directory."""
    mounts = " && ".join(f"mount -t tmpfs none {shlex.quote(str(p))}" for p in paths)
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", f"{mounts} && exec {shlex.join(argv)}"]


def lm_loss(model, ids: list[int]) -> float:
    """Mean next-token loss of a transformers model over `ids`, in windows of SEQ tokens."""
    chunks = [ids[i : i + SEQ] for i in range(0, len(ids) - 1, SEQ) if len(ids[i : i + SEQ]) > 1]
    losses = []
    with torch.no_grad():
        for c in chunks:
            x = torch.tensor([c])
            losses.append(model(x, labels=x).loss.item())
    return sum(losses) / len(losses)


def site_loss(model_dir: Path, tokenizer_dir: Path, site_a: str, site_b: list[dict]) -> float:
    """A model's loss on both sites' text, tokenized by transformers with the job's tokenizer."""
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    conv = "".join(tok.apply_chat_template(r["messages"], tokenize=False) for r in site_b)
    return (lm_loss(model, tok(site_a)["input_ids"]) + lm_loss(model, tok(conv)["input_ids"])) / 2


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    global transformers, peft
    transformers, peft = pytest.importorskip("transformers"), pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("finetune")
    probe = subprocess.run(hidden([root], ["ls", "-A", str(root)]), capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot hide directories from the workers here (unshare/mount: {probe.stderr.strip()})")
    dirs = {k: root / k for k in ("base", "site-a", "site-b", "ps")}
    for d in dirs.values():
        d.mkdir()
    (dirs["site-a"] / "notes.txt").write_text(notes(1, 700))
    (dirs["site-b"] / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats(2, 400)))
    (dirs["ps"] / "val.txt").write_text(notes(3, 400))  # the PS's own held-out text (its validation loss)
    generic = notes(9, 300) + "".join(f"What is {a} plus {b}? {a} plus {b} is {a + b}.\n" for a in range(5) for b in range(9))
    base_model(dirs["base"], generic)
    return root, dirs


def finetune(world, name: str, **job: object) -> tuple[Path, list[dict]]:
    """One fine-tuning job on the two sites; the run dir and its metrics."""
    root, d = world
    run_dir = root / name
    fleet = LocalFleet(run_dir, 0, scheduler_env=CALM)
    try:
        fleet.start()
        for site, data, other in (("site-a", d["site-a"] / "notes.txt", d["site-b"]),
                                  ("site-b", d["site-b"] / "chats.jsonl", d["site-a"])):
            argv = [sys.executable, "-m", "cleave_cli", "worker", "--nats", fleet.stack.nats_url, "--worker-id", site,
                    "--data", str(data)]
            fleet.stack.spawn(site, "worker", hidden([d["base"], other, d["ps"]], argv),
                              env={"CLEAVE_WORKER_MODEL_CACHE": str(root / f"cache-{site}")}, restart=False)
        spec = JobConfig(job_id=name, method="fedavg", init_from=str(d["base"]), tokenizer=str(d["base"]),
                         data=str(d["ps"] / "val.txt"), own_data=True, sampling="epochs", seq_len=SEQ, batch_size=8,
                         warmup_steps=2, round_timeout_s=120, val_every=2, **job)
        fleet.start_ps(spec, run_dir / "m.jsonl")
        return run_dir, fleet.wait_ps(run_dir / "m.jsonl", timeout_s=300)
    finally:
        fleet.stop()


def test_fine_tune_the_whole_model_across_two_private_sites(world):
    root, d = world
    run_dir, lines = finetune(world, "ft-full", steps=4, local_steps=5, lr=3e-3)
    assert [m["workers"] for m in lines] == [2] * 4
    assert lines[-1]["val_loss"] < lines[1]["val_loss"]
    export(run_dir, root / "ft-full-hf")
    site_a = (d["site-a"] / "notes.txt").read_text()
    site_b = chats(2, 400)
    base, tuned = site_loss(d["base"], d["base"], site_a, site_b), site_loss(root / "ft-full-hf", root / "ft-full-hf",
                                                                             site_a, site_b)
    print(f"sites' loss by transformers: base {base:.3f}, fine-tuned {tuned:.3f}; val {lines[1]['val_loss']:.3f} -> "
          f"{lines[-1]['val_loss']:.3f}")
    assert tuned < base - 0.5, (tuned, base)
    logs = run_dir / "logs"
    for site in ("site-a", "site-b"):  # the workers could not read the base: they fetched it
        text = (logs / f"{site}.log").read_text()
        assert "bundle_fetched" in text and "data_declared" in text
    ps = (logs / "ps.log").read_text() + (run_dir / "m.jsonl").read_text() + (run_dir / "job.json").read_text()
    for secret in ("notes.txt", "chats.jsonl", "site-a/", "site-b/", site_a.splitlines()[0], "plus 13 is"):
        assert secret not in ps


def test_fine_tune_lora_and_its_peft_adapter(world):
    root, d = world
    run_dir, lines = finetune(world, "ft-lora", steps=4, local_steps=5, lr=1e-2, lora_rank=8, lora_alpha=16.0)
    assert [m["workers"] for m in lines] == [2] * 4
    out = root / "ft-lora-hf"
    export(run_dir, out)
    adapter = out / "adapter"
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    assert len({p.stat().st_mode for p in (*out.iterdir(), *adapter.iterdir()) if p.is_file()}) == 1  # (0600 weights)
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(d["base"])
    ids = transformers.AutoTokenizer.from_pretrained(out)(notes(5, 3))["input_ids"][:SEQ]
    x = torch.tensor([ids])
    merged = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    adapted = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(d["base"]), adapter)
    with torch.no_grad():
        torch.testing.assert_close(adapted.eval()(x).logits, merged(x).logits, rtol=0, atol=1e-4)
        _, _, _, ours = _ps_model(run_dir, "ft-lora")
        torch.testing.assert_close(merged(x).logits, ours(x), rtol=0, atol=1e-4)  # the PS's model
    site_a, site_b = (d["site-a"] / "notes.txt").read_text(), chats(2, 400)
    base, tuned = site_loss(d["base"], d["base"], site_a, site_b), site_loss(out, out, site_a, site_b)
    print(f"sites' loss by transformers: base {base:.3f}, LoRA fine-tuned {tuned:.3f}")
    assert tuned < base - 0.3, (tuned, base)


def _ps_model(run_dir: Path, job_id: str):
    import asyncio

    with state.state_server(run_dir) as url:
        return asyncio.run(state.read_state(url, job_id))
