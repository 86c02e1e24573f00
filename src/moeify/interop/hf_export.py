"""Export a moeify run as a Hugging Face model directory (``moeify export``), in one of two
formats:

    moeify  (the default) every moeify model, loaded through remote code that imports moeify:
    native  (``--format native``) a model that is exactly one of transformers' own architectures
            (GPT-2, Llama, Mistral, Qwen2, Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE: imported
            checkpoints, and models trained or fine-tuned from them without changing their
            structure) as that ``model_type``, loadable by plain transformers without moeify;
            any other model is refused in one line naming the difference
            (moeify.interop.hf_native).

The moeify format:

    out/ config.json              model_type "moeify", auto_map, the moeify ModelConfig
         configuration_moeify.py  the transformers config class   } loaded with
         modeling_moeify.py       the transformers model class    } trust_remote_code=True
         model.safetensors        the run's latest checkpoint weights (its dtype, "model." prefix)
         tokenizer.json           the run's tokenizer for transformers (when it has a
         tokenizer_config.json    Hugging Face form: imported, byte, byte256 and gpt2 kinds)
         README.md

The modeling code imports moeify (every family runs moeify's own layers), so the directory needs
moeify installed (from its source checkout) wherever it is loaded; config.json and the README say so. What is
preserved: the weights exactly, hence the logits (tests hold transformers' logits to moeify's
within 1e-5 for every family) and greedy generation. Routing statistics buffers are not
exported (they are not part of a checkpoint either).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from moeify.data.cache import atomic_directory, default_file_mode, sweep_stale_directories
from moeify.data.gpt2_bpe import bytes_to_unicode
from moeify.data.hf_tokenizer import import_tokenizers
from moeify.errors import MoeifyError, install_hint, os_error_of
from moeify.interop.hf_import import HF_CONFIG_COPY, HF_TOKENIZER_CONFIG_COPY, offline
from moeify.interop.hf_mapping import ARCHITECTURES
from moeify.interop.hf_native import native_export, state_dtype_name
from moeify.layers.mosa import MoSAConfig
from moeify.rundir import load_trained
from moeify.rundir.files import model_config_dict

REMOTE_DIR = Path(__file__).with_name("hf_remote")
REMOTE_FILES = ("configuration_moeify.py", "modeling_moeify.py")
REQUIRES = f"the modeling code imports moeify: {install_hint(here=False)} (trust_remote_code=True)"


def hf_config(model_cfg, hf_source: dict | None, dtype: str = "float32") -> dict:
    """config.json of the exported directory (``dtype``: the weights' dtype)."""
    if any(isinstance(a, MoSAConfig) for a in model_cfg.attention):
        # Its decoding state (every token's router scores plus the hybrid's dense cache) is not
        # a KVCache, which the exported cache layer (hf_remote/modeling_moeify.py) wraps and
        # reorders for beam search; MoEUT models export (one KVCache per layer application).
        raise MoeifyError("Hugging Face export does not apply to MoSA attention: its prefix-"
                          "routing decoding cache is not a transformers cache layer; use the "
                          "run directory with moeify's own generate")

    if getattr(model_cfg, "recursion", None) is not None:
        raise MoeifyError("Hugging Face export does not apply to Mixture-of-Recursions: its "
                          "recursion-wise cache (one KV cache per recursion step and shared "
                          "block) is not a transformers cache layer; use the run directory "
                          "with moeify's own generate")
    src = hf_source or {}
    cfg = {"model_type": "moeify", "architectures": ["MoeifyForCausalLM"],
           "auto_map": {"AutoConfig": "configuration_moeify.MoeifyConfig",
                        "AutoModelForCausalLM": "modeling_moeify.MoeifyForCausalLM"},
           "moeify_requires": REQUIRES, "moeify_config": model_config_dict(model_cfg),
           "vocab_size": model_cfg.vocab_size, "hidden_size": model_cfg.d_model,
           "num_hidden_layers": model_cfg.n_layers,
           "max_position_embeddings": model_cfg.max_positions or model_cfg.context_length,
           "tie_word_embeddings": model_cfg.tie_embeddings, "use_cache": True,
           "dtype": dtype}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if src.get(key) is not None:
            cfg[key] = src[key]
    return cfg


def byte_level_tokenizer_json(values, unk: bool) -> bytes:
    """A ``tokenizers`` byte-level BPE without merges whose ids are moeify's byte ids:
    id i = byte ``values[i]`` (GPT-2's byte-to-character map), the last id the unknown byte."""

    tk = import_tokenizers()
    b2u = bytes_to_unicode()
    vocab = {b2u[int(v)]: i for i, v in enumerate(values)}
    if unk:
        vocab["<unk>"] = len(vocab)
    tok = tk.Tokenizer(tk.models.BPE(vocab, [], unk_token="<unk>" if unk else None))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tk.decoders.ByteLevel()
    return tok.to_str().encode()


def tokenizer_json(tokenizer) -> bytes | None:
    """The run's tokenizer as a tokenizer.json, or None when it has no Hugging Face form."""
    if tokenizer.name == "hf":
        return tokenizer.json_bytes
    if tokenizer.name in ("byte", "byte256"):
        return byte_level_tokenizer_json(tokenizer.values, tokenizer.has_unk)
    if tokenizer.name == "gpt2":
    
        tk = import_tokenizers()
        merges = sorted(tokenizer.bpe_ranks, key=tokenizer.bpe_ranks.get)
        tok = tk.Tokenizer(tk.models.BPE(dict(tokenizer.encoder), merges))
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tk.decoders.ByteLevel()
        return tok.to_str().encode()
    return None


def _readme(run_dir: Path, model_cfg, has_tokenizer: bool) -> str:
    tok = ("tokenizer.json (AutoTokenizer.from_pretrained(DIR)) is the run's tokenizer."
           if has_tokenizer else "The run's tokenizer (SentencePiece) has no Hugging Face form "
           "here: its moeify files are in moeify_tokenizer/ (moeify.data.tokenizers."
           "load_tokenizer).")
    return (f"# moeify model\n\nExported by `moeify export` from the run {run_dir.name} "
            f"({model_cfg.n_layers} layers, d_model {model_cfg.d_model}, vocabulary "
            f"{model_cfg.vocab_size}).\n\n**Requires moeify**: {REQUIRES}.\n\n"
            "```python\nfrom transformers import AutoModelForCausalLM\n"
            "model = AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)\n```\n\n"
            f"{tok}\n")


def _tokenizer_config(tm) -> dict:
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast",
           "model_max_length": tm.model_config.context_length}
    kept = tm.run_dir / HF_TOKENIZER_CONFIG_COPY  # an imported checkpoint's special tokens
    if kept.is_file():
        cfg.update(json.loads(kept.read_text()))
    return cfg


def _native_readme(run_dir: Path, kind: str, model_cfg, has_tokenizer: bool) -> str:
    tok = ("tokenizer.json (AutoTokenizer.from_pretrained(DIR)) is the run's tokenizer.\n"
           if has_tokenizer else "The run's tokenizer (SentencePiece) has no Hugging Face form "
           "here: its moeify files are in moeify_tokenizer/.\n")
    return (f"# {ARCHITECTURES[kind]}\n\nExported by `moeify export --format native` from the run "
            f"{run_dir.name} ({model_cfg.n_layers} layers, d_model {model_cfg.d_model}, "
            f"vocabulary {model_cfg.vocab_size}) as transformers' own model_type `{kind}`: it "
            "loads without moeify.\n\n```python\nfrom transformers import AutoModelForCausalLM"
            "\nmodel = AutoModelForCausalLM.from_pretrained(DIR)\n```\n\n" + tok)


def _write_tokenizer(tmp: Path, tm) -> bool:
    tok = tokenizer_json(tm.tokenizer)
    if tok is not None:
        (tmp / "tokenizer.json").write_bytes(tok)
        (tmp / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(tm), indent=2)
                                                    + "\n")
    else:
        tm.tokenizer.save(tmp / "moeify_tokenizer")
    return tok is not None


def _save_weights(state: dict, tmp: Path, out: Path | None) -> None:
    """model.safetensors in ``tmp``; a full disk (or another OS error, which safetensors reports
    as its own error type) as the OSError of the file the user asked for, under ``out``."""
    # Looked up when called: tests replace safetensors.torch.save_file to fill the disk.
    from safetensors.torch import save_file

    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        # safetensors creates its file 0600: give it the mode of the export's other files.
        os.chmod(tmp / "model.safetensors", default_file_mode())
    except Exception as e:  # safetensors' own error type, also for a full disk
        os_error = os_error_of(e, (out or tmp) / "model.safetensors")
        if os_error is None:
            raise
        raise os_error from None


def _write_native(tmp: Path, tm, native, out: Path | None = None) -> None:
    kind, config, state = native
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    _save_weights(state, tmp, out)
    has_tok = _write_tokenizer(tmp, tm)
    (tmp / "README.md").write_text(_native_readme(tm.run_dir, kind, tm.model_config, has_tok))


def _write(tmp: Path, tm, hf_source: dict | None, out: Path | None = None) -> None:
    tmp.mkdir(parents=True)
    for name in REMOTE_FILES:
        shutil.copyfile(REMOTE_DIR / name, tmp / name)
    state = {f"model.{k}": v.detach().cpu().contiguous()
             for k, v in tm.model.state_dict().items()}
    config = hf_config(tm.model_config, hf_source, state_dtype_name(state))
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _save_weights(state, tmp, out)
    has_tok = _write_tokenizer(tmp, tm)
    (tmp / "README.md").write_text(_readme(tm.run_dir, tm.model_config, has_tok))


EXPORT_FORMATS = ("moeify", "native")


def export_hf(run: str | Path, out: str | Path, *, format: str = "moeify") -> Path:
    """Write the Hugging Face directory ``out`` (new or empty) from the run (or checkpoint)
    ``run``, in ``format`` "moeify" (remote code) or "native" (transformers' own model_type;
    module docstring). The directory appears complete or not at all (written beside it, then
    renamed); a model without a native form is refused before anything is written."""
    offline()
    if format not in EXPORT_FORMATS:
        raise MoeifyError(f"unknown export format {format!r}; choose one of "
                          f"{', '.join(EXPORT_FORMATS)}")
    out = Path(out)
    sweep_stale_directories(out)  # what killed exports into --out left beside it
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MoeifyError(f"{out} already exists and is not an empty directory; choose a new "
                          "--out for the exported model")
    tm = load_trained(run)
    src = tm.run_dir / HF_CONFIG_COPY
    hf_source = json.loads(src.read_text()) if src.is_file() else None
    if format == "native":
        native = native_export(tm.model_config, tm.model.state_dict(), hf_source)
        with atomic_directory(out, "export") as tmp:
            _write_native(tmp, tm, native, out=out)
        return out
    with atomic_directory(out, "export") as tmp:
        _write(tmp, tm, hf_source, out=out)
    return out
