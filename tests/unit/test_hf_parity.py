"""Our GPT-2 and Llama against transformers' models: same weights, same logits; export and import round trips.

Small random configs built here; nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from cleave.errors import ConfigError
from cleave.models import PRESETS, ModelConfig, RopeScaling, build_model
from cleave.models.hf import (
    export_hf,
    from_hf_config,
    from_hf_state_dict,
    load_hf,
    load_hf_model,
    to_hf_config,
    to_hf_state_dict,
)
from cleave.models.llama import rope_frequencies
from cleave.models.tokenizer import TOKENIZER_RECORD, ByteTokenizer, load_tokenizer
from cleave.train.job import JobConfig

TOL = 1e-5  # float32
SMALL = dict(vocab_size=256, block_size=32, n_layer=2, n_embd=32)
CONFIGS = {
    "gpt2-tied": ModelConfig(family="gpt2", n_head=2, **SMALL),
    "gpt2-untied-nobias": ModelConfig(
        family="gpt2", n_head=4, intermediate_size=48, bias=False, tie_embeddings=False, **SMALL
    ),
    "llama-gqa-tied": ModelConfig(family="llama", n_head=4, n_kv_head=2, intermediate_size=48, bias=False, **SMALL),
    "llama-untied": ModelConfig(
        family="llama", n_head=2, intermediate_size=48, bias=False, tie_embeddings=False, **SMALL
    ),
    # head_dim 16, original context 32: RoPE wavelengths fall in all three bands of the llama3 scaling
    "llama3-rope": ModelConfig(
        family="llama", vocab_size=256, block_size=64, n_layer=2, n_head=4, n_kv_head=1, n_embd=64,
        intermediate_size=80, bias=False, rope_scaling=RopeScaling(factor=8.0, original_max_position_embeddings=32),
    ),
}  # fmt: skip
params = pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS.keys())


def _tokens(cfg: ModelConfig) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (2, cfg.block_size), generator=torch.Generator().manual_seed(1))


def _randomize(model: nn.Module, cfg: ModelConfig) -> nn.Module:
    """Weights of unit scale, not the 0.02 of training init: sharp attention and O(1) logits, so that any
    mapping or numerics error (a RoPE band, the GELU variant, a norm's bias) moves the logits past TOL."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # tied weights once
            noise = torch.randn(p.shape, generator=g)
            p.copy_(noise / cfg.n_embd**0.5 if p.ndim == 2 else p + 0.1 * noise)  # norms ~1, biases ~0.1
    return model.eval()


def _ours(cfg: ModelConfig) -> nn.Module:
    return _randomize(build_model(cfg), cfg)


def _hf(cfg: ModelConfig) -> nn.Module:
    torch.manual_seed(0)
    return _randomize(AutoModelForCausalLM.from_config(AutoConfig.for_model(**to_hf_config(cfg))), cfg)


def _assert_same_logits(ours: nn.Module, hf: nn.Module, cfg: ModelConfig) -> None:
    x = _tokens(cfg)
    with torch.no_grad():
        a, b = ours(x), hf(x).logits
    assert a.shape == b.shape == (2, cfg.block_size, cfg.vocab_size)
    assert a.std() > 0.5  # O(1) logits: a small absolute TOL is also a small relative one
    assert (a - b).abs().max().item() < TOL


@params
def test_our_weights_in_transformers_give_our_logits(cfg: ModelConfig) -> None:
    ours, hf = _ours(cfg), _hf(cfg)
    hf.load_state_dict(to_hf_state_dict(cfg, ours.state_dict()), strict=True)
    _assert_same_logits(ours, hf, cfg)


@params
def test_transformers_weights_in_ours_give_its_logits(cfg: ModelConfig) -> None:
    hf = _hf(cfg)
    ours_cfg = from_hf_config(hf.config)
    ours = build_model(ours_cfg).eval()
    ours.load_state_dict(from_hf_state_dict(ours_cfg, hf.state_dict()), strict=True)
    _assert_same_logits(ours, hf, cfg)


@params
def test_export_loads_in_transformers_and_back(cfg: ModelConfig, tmp_path: Path) -> None:
    ours = _ours(cfg)
    out = export_hf(ours, cfg, tmp_path / "export")
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", TOKENIZER_RECORD, "tokenizer.json",
                                               "tokenizer_config.json"}  # (the byte tokenizer's, for transformers)
    assert ("lm_head.weight" in load_file(out / "model.safetensors")) == (not cfg.tie_embeddings)
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    _assert_same_logits(ours, hf, cfg)
    assert (hf.lm_head.weight is hf.get_input_embeddings().weight) == cfg.tie_embeddings

    loaded_cfg, back = load_hf_model(out)
    _assert_same_logits(back.eval(), hf, cfg)
    tied = (
        back.lm_head.weight
        is back.get_submodule("transformer.wte" if cfg.family == "gpt2" else "embed_tokens").weight
    )
    assert tied == cfg.tie_embeddings
    assert loaded_cfg.model_copy(update={"bias": cfg.bias, "intermediate_size": cfg.intermediate_size}) == cfg


def test_sharded_save_pretrained_imports(tmp_path: Path) -> None:
    cfg = CONFIGS["llama-gqa-tied"]
    hf = _hf(cfg)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    loaded_cfg, ours = load_hf_model(tmp_path)
    assert loaded_cfg == cfg
    _assert_same_logits(ours.eval(), hf, cfg)


def test_original_gpt2_checkpoint_layout_imports(tmp_path: Path) -> None:
    """OpenAI's GPT-2 files: keys without `transformer.`, causal-mask buffers, no lm_head."""
    cfg = CONFIGS["gpt2-tied"]
    ours = _ours(cfg)
    hf_sd = to_hf_state_dict(cfg, ours.state_dict())
    del hf_sd["lm_head.weight"]
    sd = {k.removeprefix("transformer."): v.clone() for k, v in hf_sd.items()}
    for i in range(cfg.n_layer):
        sd[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, cfg.block_size, cfg.block_size))
    save_file(sd, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(to_hf_config(cfg)))
    _, back = load_hf_model(tmp_path)
    x = _tokens(cfg)
    with torch.no_grad():
        assert torch.equal(back.eval()(x), ours(x))


def test_llama3_rope_matches_transformers() -> None:
    cfg = PRESETS["llama3-1b"]
    hf_inv_freq = LlamaRotaryEmbedding(LlamaConfig(**to_hf_config(cfg))).inv_freq
    ours = rope_frequencies(cfg)
    assert torch.allclose(ours, hf_inv_freq, rtol=1e-6, atol=0)
    plain = rope_frequencies(cfg.model_copy(update={"rope_scaling": None}))
    assert not torch.allclose(ours, plain)  # the scaling is really applied


@pytest.mark.parametrize("name", PRESETS)
def test_preset_configs_round_trip(name: str) -> None:
    cfg = PRESETS[name]
    expected = cfg.model_copy(update={"bias": True}) if cfg.family == "gpt2" else cfg
    expected = expected.model_copy(update={"intermediate_size": cfg.intermediate_size or None})
    assert from_hf_config(to_hf_config(cfg)) == expected
    assert from_hf_config(AutoConfig.for_model(**to_hf_config(cfg))) == expected  # transformers' own format


def test_published_configs_map_to_our_presets() -> None:
    llama32_1b = {  # meta-llama/Llama-3.2-1B config.json, as published
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
        "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
        "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
        "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": True,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 128256,
    }  # fmt: skip
    assert from_hf_config(llama32_1b).model_copy(update={"block_size": 8192}) == PRESETS["llama3-1b"]
    gpt2_medium = {  # openai-community/gpt2-medium, the fields that shape the model
        "model_type": "gpt2", "activation_function": "gelu_new", "n_ctx": 1024, "n_embd": 1024, "n_head": 16,
        "n_layer": 24, "n_positions": 1024, "layer_norm_epsilon": 1e-05, "vocab_size": 50257,
    }  # fmt: skip
    assert from_hf_config(gpt2_medium) == PRESETS["gpt2-medium"]


def _exported(tmp_path: Path, name: str = "gpt2-tied") -> Path:
    return export_hf(_ours(CONFIGS[name]), CONFIGS[name], tmp_path / "m")


def _edit_config(out: Path, **changes: object) -> None:
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(cfg | changes))


def test_shape_mismatch_is_named(tmp_path: Path) -> None:
    out = _exported(tmp_path)
    _edit_config(out, n_embd=64)
    with pytest.raises(
        ConfigError, match=r"shape mismatch: transformer.h.0.attn.c_attn.bias expected \[192\] got \[96\]"
    ):
        load_hf(out)


def test_missing_and_unexpected_keys_are_named(tmp_path: Path) -> None:
    out = _exported(tmp_path)
    _edit_config(out, n_layer=3)
    with pytest.raises(ConfigError, match=r"missing keys: transformer.h.2.attn.c_attn.bias, .* and 7 more"):
        load_hf(out)
    _edit_config(out, n_layer=1)
    with pytest.raises(ConfigError, match=r"unexpected keys: transformer.h.1.attn.c_attn.bias"):
        load_hf(out)
    _edit_config(out, n_layer=2, tie_word_embeddings=False)
    with pytest.raises(ConfigError, match=r"missing keys: lm_head.weight$"):
        load_hf(out)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"model_type": "bert"}, "unsupported model_type 'bert'"),
        ({"activation_function": "relu"}, "activation_function='relu' is not supported"),
        ({"n_head": 5}, "invalid gpt2 model: .*n_embd=32 must be divisible by n_head=5"),
    ],
)
def test_unsupported_configs_are_named(tmp_path: Path, changes: dict, match: str) -> None:
    out = _exported(tmp_path)
    _edit_config(out, **changes)
    with pytest.raises(ConfigError, match=match):
        load_hf(out)


def test_unsupported_llama_variants_are_named() -> None:
    base = to_hf_config(CONFIGS["llama-untied"])
    with pytest.raises(ConfigError, match="rope_type 'yarn' is not supported"):
        from_hf_config(base | {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ConfigError, match="head_dim=8 differs"):
        from_hf_config(base | {"head_dim": 8})
    with pytest.raises(ConfigError, match="attention_bias=True"):
        from_hf_config(base | {"attention_bias": True})


def test_wrong_state_dicts_are_refused_before_any_copy() -> None:
    cfg = CONFIGS["gpt2-untied-nobias"]
    with pytest.raises(
        ConfigError, match="state dict does not match.*missing keys: transformer.h.0.attn.c_attn.weight"
    ):
        to_hf_state_dict(cfg, build_model(CONFIGS["llama-untied"]).state_dict())
    hf_sd = to_hf_state_dict(cfg, _ours(cfg).state_dict())
    hf_sd["transformer.h.1.mlp.c_fc.bias"] = torch.ones(48)
    with pytest.raises(ConfigError, match=r"non-zero biases \(transformer.h.1.mlp.c_fc.bias\)"):
        from_hf_state_dict(cfg, hf_sd)


def test_missing_directories_and_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a directory nor a repo in the local Hugging Face cache"):
        load_hf(tmp_path / "absent")
    with pytest.raises(ConfigError, match="has no config.json"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")  # JSON, not an object: a traceback ('list' has no to_dict)
    with pytest.raises(ConfigError, match=r"config.json is not a JSON object \(it holds a list\)"):
        load_hf(tmp_path)
    (tmp_path / "config.json").unlink()
    out = _exported(tmp_path)
    weights = (out / "model.safetensors").read_bytes()
    for damaged in (weights[: len(weights) // 2], b"\xff" * 64 + weights[64:]):  # truncated; its header garbled
        (out / "model.safetensors").write_bytes(damaged)  # (the PS crashed on these, restarted five times)
        with pytest.raises(ConfigError, match=r"model.safetensors: cannot read its weights, the file is truncated"):
            load_hf(out)
    (out / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="no weights in"):
        load_hf(out)


def test_export_records_and_copies_the_tokenizer(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(
        ["hello edge devices"] * 10,
        trainers.BpeTrainer(vocab_size=80, special_tokens=["<|endoftext|>"], show_progress=False),
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = CONFIGS["llama-untied"]
    out = export_hf(_ours(cfg), cfg, tmp_path / "m", tokenizer_name=str(tmp_path))
    assert json.loads((out / TOKENIZER_RECORD).read_text()) == {
        "tokenizer": str(tmp_path),
        "vocab_size": tok.get_vocab_size(),
    }
    config = json.loads((out / "config.json").read_text())
    # both ids, as GPT-2's published config has them (bos was null: generate() had no start token to give)
    assert config["eos_token_id"] == config["bos_token_id"] == tok.token_to_id("<|endoftext|>")
    assert load_tokenizer(out).encode("hello edge") == tok.encode("hello edge").ids
    assert load_tokenizer(_exported(tmp_path / "b")).name == "bytes"
    # a job started from a model takes the model's own tokenizer unless it names one (it trained a BPE model on
    # byte ids, silently)
    assert JobConfig(init_from=str(out)).tokenizer == str(out)
    assert JobConfig(init_from=str(tmp_path / "b" / "m")).tokenizer == "bytes"
    assert JobConfig(init_from=str(out), tokenizer="bytes").tokenizer == "bytes"  # named: kept
    # a model whose tokenizer cannot be read is not trained on byte ids either: loading it says why
    spm = _exported(tmp_path / "spm")
    for name in (TOKENIZER_RECORD, "tokenizer.json", "tokenizer_config.json"):
        (spm / name).unlink()
    (spm / "tokenizer.model").write_bytes(b"sentencepiece")
    assert JobConfig(init_from=str(spm)).tokenizer == str(spm)
    with pytest.raises(ConfigError, match="only a sentencepiece tokenizer.model; convert it"):
        load_tokenizer(spm)
    (spm / "tokenizer.model").unlink()
    (spm / TOKENIZER_RECORD).write_text(json.dumps({"tokenizer": "/gone/bpe", "vocab_size": 80}))
    assert JobConfig(init_from=str(spm)).tokenizer == str(spm)
    with pytest.raises(ConfigError, match="names tokenizer '/gone/bpe' but its files are not in"):
        load_tokenizer(spm)
    (spm / TOKENIZER_RECORD).write_text("{not json")
    with pytest.raises(ConfigError, match="cannot be read"):
        load_tokenizer(spm)
    (spm / TOKENIZER_RECORD).unlink()
    assert JobConfig(init_from=str(spm)).tokenizer == "bytes"  # no tokenizer at all: the default
    small = cfg.model_copy(update={"vocab_size": 96})
    with pytest.raises(ConfigError, match="has 256 tokens, over vocab_size=96"):
        export_hf(build_model(small), small, tmp_path / "x", tokenizer_name="bytes")


@pytest.mark.parametrize("name", ["gpt2-tied", "llama-untied"])
def test_a_byte_tokenizer_export_loads_in_transformers_as_the_byte_tokenizer(tmp_path: Path, name: str) -> None:
    """Its export held only the record: AutoTokenizer gave an empty GPT-2 tokenizer that encoded every text to
    [] (or failed, for a Llama model), with nothing said. It writes a tokenizer.json of the same ids; Cleave
    still reads the folder as "bytes" (its record), so a job started from it is the same job as before."""
    from transformers import AutoTokenizer

    out = _exported(tmp_path, name)
    tok = AutoTokenizer.from_pretrained(out)
    text = "héllo wörld <|endoftext|>\n\t  def  f(x):\r\n 日本語 \x00\x7f"
    assert tok(text).input_ids == list(text.encode()) and tok.decode(list(text.encode())) == text
    assert len(tok) == 256 and tok.decode([0xE6, 0x97]) == "\ufffd"  # (a cut character, as ByteTokenizer's)
    assert isinstance(load_tokenizer(out), ByteTokenizer) and JobConfig(init_from=str(out)).tokenizer == "bytes"
    assert export_hf(_ours(CONFIGS[name]), CONFIGS[name], out) == out  # (over itself: the record still rules)
