"""Hugging Face interop: config and state-dict adapters for GPT-2 and Llama, export and import of model dirs.

Our GPT-2 keys follow nanoGPT and so match `GPT2LMHeadModel`'s, except that HF keeps the weights of its
Conv1D layers (c_attn, c_proj, c_fc) transposed. Our Llama keys are `LlamaForCausalLM`'s without the
`model.` prefix. Every conversion checks the whole key set and every shape before it copies anything.
Reading and writing model directories needs torch and `safetensors`, never `transformers`.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from cleave.errors import CleaveError, ConfigError
from cleave.models.config import ModelConfig, RopeScaling
from cleave.models.hub import cached_snapshot
from cleave.models.tokenizer import (
    DEFAULT_TOKENIZER,
    TOKENIZER_RECORD,
    ByteTokenizer,
    load_tokenizer,
    recorded_spec,
    recorded_tokenizer,
    tokenizer_files,
)

if TYPE_CHECKING:  # (torch is imported where weights are read or written: reading a config needs none)
    import torch
    from torch import nn

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"  # sharded checkpoints: {"weight_map": {key: shard file}}
MAX_LISTED = 5  # mismatching keys named in an error before "... and N more"
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# buffers that some published checkpoints carry; they are recomputed, never loaded
_IGNORED = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")

StateDict = dict[str, "torch.Tensor"]


# ---------------------------------------------------------------- configs


def to_hf_config(
    cfg: ModelConfig, dtype: torch.dtype | None = None, eos_id: int | None = None, bos_id: int | None = None
) -> dict:
    """The config.json of the equivalent `GPT2LMHeadModel` or `LlamaForCausalLM` (weights of `dtype`,
    float32 by default)."""
    common: dict[str, Any] = {
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "dtype": str(dtype).removeprefix("torch.") if dtype is not None else "float32",
    }
    if cfg.family == "gpt2":
        if cfg.kv_heads != cfg.n_head:
            raise ConfigError("gpt2 has no grouped-query attention: set n_kv_head to None")
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            **common,
            "n_positions": cfg.block_size,
            "n_embd": cfg.n_embd,
            "n_layer": cfg.n_layer,
            "n_head": cfg.n_head,
            "n_inner": cfg.intermediate_size,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": cfg.norm_eps,
            "resid_pdrop": 0.0,  # our models have no dropout
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
        }
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **common,
        "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.mlp_width,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.block_size,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
    }
    if cfg.rope_scaling is not None:
        hf["rope_scaling"] = {"rope_type": "llama3", **cfg.rope_scaling.model_dump()}
    return hf


def from_hf_config(hf: Mapping[str, Any] | Any) -> ModelConfig:
    """Our config from a config.json dict or a `transformers` config object; unknown fields are ignored."""
    d = dict(hf) if isinstance(hf, Mapping) else hf.to_dict()
    kind = d.get("model_type")
    try:
        if kind == "gpt2":
            return _gpt2_config(d)
        if kind == "llama":
            return _llama_config(d)
    except ValidationError as e:
        raise ConfigError(f"config describes an invalid {kind} model: {e.errors()[0]['msg']}") from None
    raise ConfigError(f"unsupported model_type {kind!r}: cleave supports 'gpt2' and 'llama'")


def _require(d: Mapping[str, Any], key: str, allowed: tuple, default: Any) -> None:
    if d.get(key, default) not in allowed:
        raise ConfigError(f"{key}={d.get(key)!r} is not supported; cleave needs one of {allowed}")


def _gpt2_config(d: Mapping[str, Any]) -> ModelConfig:
    _require(d, "activation_function", ("gelu_new", "gelu_pytorch_tanh"), "gelu_new")
    _require(d, "scale_attn_weights", (True,), True)
    _require(d, "scale_attn_by_inverse_layer_idx", (False,), False)
    _require(d, "add_cross_attention", (False,), False)
    return ModelConfig(  # defaults are GPT2Config's
        family="gpt2",
        vocab_size=d.get("vocab_size", 50257),
        block_size=d.get("n_positions", 1024),
        n_layer=d.get("n_layer", 12),
        n_head=d.get("n_head", 12),
        n_embd=d.get("n_embd", 768),
        intermediate_size=d.get("n_inner"),
        bias=True,  # HF's GPT-2 always has biases
        tie_embeddings=d.get("tie_word_embeddings", True),
        norm_eps=d.get("layer_norm_epsilon", 1e-5),
    )


def _llama_config(d: Mapping[str, Any]) -> ModelConfig:
    _require(d, "hidden_act", ("silu",), "silu")
    _require(d, "attention_bias", (False,), False)
    _require(d, "mlp_bias", (False,), False)
    n_embd, n_head = d.get("hidden_size", 4096), d.get("num_attention_heads", 32)
    if d.get("head_dim") not in (None, n_embd // n_head):
        raise ConfigError(
            f"head_dim={d['head_dim']} differs from hidden_size / num_attention_heads = {n_embd // n_head}; "
            "cleave's llama needs them equal"
        )
    kv = d.get("num_key_value_heads")
    rope_theta, rope_scaling = _hf_rope(d)
    return ModelConfig(  # defaults are LlamaConfig's
        family="llama",
        vocab_size=d.get("vocab_size", 32000),
        block_size=d.get("max_position_embeddings", 2048),
        n_layer=d.get("num_hidden_layers", 32),
        n_head=n_head,
        n_kv_head=None if kv in (None, n_head) else kv,
        n_embd=n_embd,
        intermediate_size=d.get("intermediate_size", 11008),
        bias=False,
        tie_embeddings=d.get("tie_word_embeddings", False),
        norm_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
    )


def _hf_rope(d: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """RoPE from transformers 5's `rope_parameters` or the older `rope_theta` + `rope_scaling`."""
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ConfigError(f"rope_type {kind!r} is not supported; cleave's llama has 'default' and 'llama3'")
    fields = {k: params[k] for k in RopeScaling.model_fields if k in params}
    try:
        return theta, RopeScaling(**fields)
    except ValidationError as e:
        raise ConfigError(f"invalid llama3 rope scaling {params}: {e.errors()[0]['msg']}") from None


# ---------------------------------------------------------------- state dicts


def _hf_key(cfg: ModelConfig, key: str) -> str:
    return key if cfg.family == "gpt2" or key == "lm_head.weight" else f"model.{key}"


def _is_conv1d(cfg: ModelConfig, key: str) -> bool:
    return cfg.family == "gpt2" and key.endswith(_CONV1D)


def _embedding_key(cfg: ModelConfig) -> str:
    return "transformer.wte.weight" if cfg.family == "gpt2" else "embed_tokens.weight"


def our_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every key of our model's state dict and its shape (read off a model on the meta device)."""
    from cleave.models.build import build_model  # noqa: PLC0415 - (torch: see the imports)
    return {k: tuple(v.shape) for k, v in build_model(cfg, device="meta").state_dict().items()}


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every key of the equivalent HF model's state dict (tied lm_head included) and its shape."""
    full = cfg.model_copy(update={"bias": True}) if cfg.family == "gpt2" else cfg  # HF GPT-2 has biases
    return {_hf_key(cfg, k): s[::-1] if _is_conv1d(cfg, k) else s for k, s in our_shapes(full).items()}


def _listed(keys: list[str]) -> str:
    more = f" ... and {len(keys) - MAX_LISTED} more" if len(keys) > MAX_LISTED else ""
    return ", ".join(keys[:MAX_LISTED]) + more


def check_state_dict(
    expected: Mapping[str, tuple[int, ...]], got: Mapping[str, torch.Tensor], what: str
) -> None:
    """Raise ConfigError naming every missing, unexpected and mis-shaped key; copy nothing."""
    missing = sorted(expected.keys() - got.keys())
    unexpected = sorted(got.keys() - expected.keys())
    shapes = [
        f"{k} expected {list(expected[k])} got {list(got[k].shape)}"
        for k in sorted(expected.keys() & got.keys())
        if tuple(got[k].shape) != tuple(expected[k])
    ]
    problems = [
        f"{label}: {_listed(keys)}"
        for label, keys in (
            ("missing keys", missing),
            ("unexpected keys", unexpected),
            ("shape mismatch", shapes),
        )
        if keys
    ]
    if problems:
        raise ConfigError(f"{what} does not match the model config; " + "; ".join(problems))


def to_hf_state_dict(cfg: ModelConfig, sd: Mapping[str, torch.Tensor]) -> StateDict:
    """Our state dict -> the HF model's (Conv1D weights transposed; GPT-2 without biases gets zero ones)."""
    check_state_dict(our_shapes(cfg), sd, "state dict")
    full = cfg.model_copy(update={"bias": True}) if cfg.family == "gpt2" else cfg
    like = sd[_embedding_key(cfg)]
    out: StateDict = {}
    for key, shape in our_shapes(full).items():
        t = sd[key].detach() if key in sd else like.new_zeros(shape)
        out[_hf_key(cfg, key)] = t.t().contiguous() if _is_conv1d(cfg, key) else t
    return out


def _normalize_hf_keys(cfg: ModelConfig, hf_sd: Mapping[str, torch.Tensor]) -> StateDict:
    """Drop recomputed buffers; restore the prefix of checkpoints saved from the bare base model."""
    prefix = "transformer." if cfg.family == "gpt2" else "model."
    out: StateDict = {}
    for key, t in hf_sd.items():
        if key.endswith(_IGNORED):
            continue
        out[key if key.startswith((prefix, "lm_head.")) else prefix + key] = t
    return out


def from_hf_state_dict(
    cfg: ModelConfig, hf_sd: Mapping[str, torch.Tensor], source: str = "checkpoint"
) -> StateDict:
    """The HF model's state dict -> ours, after checking every key and shape against `cfg`."""
    sd = _normalize_hf_keys(cfg, hf_sd)
    expected = hf_shapes(cfg)
    if cfg.tie_embeddings:  # HF omits or duplicates the tied head; ours is re-tied below
        expected.pop("lm_head.weight")
        sd.pop("lm_head.weight", None)
    check_state_dict(expected, sd, source)
    ours: StateDict = {}
    for key in our_shapes(cfg):
        t = sd.pop(_hf_key(cfg, key)) if key != "lm_head.weight" or not cfg.tie_embeddings else None
        if t is not None:
            ours[key] = t.t().contiguous() if _is_conv1d(cfg, key) else t
    nonzero = [k for k, t in sd.items() if t.count_nonzero()]  # biases HF has and a bias=False gpt2 lacks
    if nonzero:
        raise ConfigError(f"{source} has non-zero biases ({_listed(nonzero)}) but the config has bias=False")
    if cfg.tie_embeddings:
        ours["lm_head.weight"] = ours[_embedding_key(cfg)]
    return ours


# ---------------------------------------------------------------- model directories


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError:
        raise ConfigError(
            "Hugging Face checkpoints need the `safetensors` package: pip install safetensors"
        ) from None
    return safetensors.torch


def resolve_model_dir(path: str | Path) -> Path:
    """A local model directory, or the cached snapshot of a Hugging Face repo id."""
    directory = Path(path).expanduser()
    if directory.is_dir():
        return directory
    snapshot = cached_snapshot(str(path))
    if snapshot is None:
        raise ConfigError(f"{path} is not a directory nor a repo in the local Hugging Face cache")
    return snapshot


def own_tokenizer(path: str | Path) -> str | None:
    """The tokenizer a model directory comes with, as a `load_tokenizer` spec: "bytes" where its export record
    says so, else the directory itself where it holds any tokenizer files (loading it then tells what is wrong
    with them, a sentencepiece model that needs converting); None where it has none (or is not here)."""
    try:
        directory = resolve_model_dir(path)
    except ConfigError:
        return None
    kind = tokenizer_files(directory)
    if kind == "record":
        return DEFAULT_TOKENIZER if recorded_tokenizer(directory) == DEFAULT_TOKENIZER else str(path)
    return None if kind is None else str(path)


def weight_files(directory: Path) -> list[Path]:
    """The files that hold a model directory's weights: its safetensors shards (as its index lists them), or
    pytorch_model.bin."""
    index = directory / WEIGHTS_INDEX
    if index.is_file():
        files = [directory / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ConfigError(f"{index} lists shard {missing[0]}, which is not in {directory}")
        return files
    files = sorted(directory.glob("*.safetensors")) or [p for p in [directory / "pytorch_model.bin"] if p.is_file()]
    if not files:
        raise ConfigError(f"no weights in {directory}: expected {WEIGHTS_FILE}, {WEIGHTS_INDEX} or pytorch_model.bin")
    return files


def model_files(path: str | Path) -> list[Path]:
    """Every file a model directory needs to be loaded: config.json, the shard index if any, the weights."""
    directory = resolve_model_dir(path)
    index = [directory / WEIGHTS_INDEX] if (directory / WEIGHTS_INDEX).is_file() else []
    return [directory / CONFIG_FILE, *index, *weight_files(directory)]


def _read_weights(directory: Path) -> StateDict:
    import torch  # noqa: PLC0415 - (see the imports)
    files = weight_files(directory)
    st, sd = _safetensors(), {}
    for f in files:
        try:
            sd.update(torch.load(f, map_location="cpu", weights_only=True) if f.suffix == ".bin" else st.load_file(f))
        except Exception as e:  # safetensors' and torch's own errors for a truncated or damaged file
            raise _unreadable(f, e) from None
    return sd


def check_weights(path: str | Path) -> None:
    """The directory has weight files, and each safetensors file is whole (its header covers the file: read
    without the weights themselves)."""
    import safetensors  # noqa: PLC0415 - (`_safetensors` says how to install it)

    _safetensors()
    for f in weight_files(resolve_model_dir(path)):
        if f.suffix == ".safetensors":
            try:
                with safetensors.safe_open(f, "pt"):
                    pass
            except Exception as e:  # safetensors' own error for a truncated or damaged header
                raise _unreadable(f, e) from None


def _unreadable(f: Path, e: Exception) -> ConfigError:
    return ConfigError(f"{f}: cannot read its weights, the file is truncated or damaged ({e}); copy or download it "
                       "again")


def read_hf_config(path: str | Path) -> ModelConfig:
    """Our config from a Hugging Face directory's config.json (GPT-2 or Llama, GQA, Llama 3 rope scaling)."""
    directory = resolve_model_dir(path)
    if not (directory / CONFIG_FILE).is_file():
        raise ConfigError(f"{directory} has no {CONFIG_FILE}")
    try:
        raw = json.loads((directory / CONFIG_FILE).read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{directory / CONFIG_FILE} is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{directory / CONFIG_FILE} is not a JSON object (it holds a {type(raw).__name__}): "
                          "a model's config.json maps names to values")
    return from_hf_config(raw)


def load_hf(path: str | Path) -> tuple[ModelConfig, StateDict]:
    """Read a Hugging Face GPT-2 or Llama directory (config.json + safetensors) into our config and keys."""
    cfg = read_hf_config(path)
    directory = resolve_model_dir(path)
    return cfg, from_hf_state_dict(cfg, _read_weights(directory), source=str(directory))


def load_hf_model(path: str | Path, device: str | torch.device = "cpu") -> tuple[ModelConfig, nn.Module]:
    """`load_hf`, then our model built from it with the weights loaded (cast to the model's float32)."""
    cfg, sd = load_hf(path)
    from cleave.models.build import build_model  # noqa: PLC0415 - (torch: see the imports)
    model = build_model(cfg, device=device)
    model.load_state_dict(sd)
    return cfg, model


def export_hf(
    model: nn.Module,
    cfg: ModelConfig,
    out_dir: str | Path,
    tokenizer_name: str = DEFAULT_TOKENIZER,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write `model` as a directory `transformers.AutoModelForCausalLM.from_pretrained` loads.

    config.json, model.safetensors (a tied lm_head is left out, as HF does), the tokenizer's own files when
    it has any, and cleave_tokenizer.json recording the tokenizer spec.
    """
    tok = load_tokenizer(tokenizer_name)
    if tok.vocab_size > cfg.vocab_size:
        raise ConfigError(
            f"tokenizer {tok.name!r} has {tok.vocab_size} tokens, over vocab_size={cfg.vocab_size}"
        )
    hf_sd = to_hf_state_dict(cfg, model.state_dict())
    if cfg.tie_embeddings:
        del hf_sd["lm_head.weight"]  # safetensors refuses shared tensors; HF re-ties on load
    out_dtype = dtype or hf_sd[_hf_key(cfg, _embedding_key(cfg))].dtype
    tensors = {k: t.detach().to("cpu", out_dtype).contiguous() for k, t in hf_sd.items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:
        _safetensors().save_file(tensors, out / WEIGHTS_FILE, metadata={"format": "pt"})
    except Exception as e:  # safetensors' own error for a full disk or a folder it cannot write
        raise CleaveError(f"{out / WEIGHTS_FILE}: cannot write the weights ({e})") from None
    (out / CONFIG_FILE).write_text(json.dumps(to_hf_config(cfg, out_dtype, tok.eos_id, tok.bos_id), indent=2) + "\n")
    # (safetensors writes its file 0600: readable as the user's other files are, by the umask)
    (out / WEIGHTS_FILE).chmod((out / CONFIG_FILE).stat().st_mode & 0o777)
    for f in getattr(tok, "files", ()):
        if f.resolve() != (out / f.name).resolve():
            shutil.copy2(f, out / f.name)
    if isinstance(tok, ByteTokenizer):  # (no files of its own: written, for transformers' AutoTokenizer)
        tok.write_hf(out)
    record = {"tokenizer": recorded_spec(tok.name), "vocab_size": tok.vocab_size}
    (out / TOKENIZER_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return out
