"""``moeify import``: a Hugging Face checkpoint directory becomes a moeify run directory."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser(
        "import", help="import a Hugging Face checkpoint (GPT-2, Llama, Mistral, Qwen2, Mixtral, "
        "Qwen2-MoE, Qwen3-MoE, OLMoE) as a run",
        description="Convert a local Hugging Face checkpoint directory (written by "
        "save_pretrained: config.json, model.safetensors, tokenizer.json) into a moeify run "
        "directory that eval, generate, plot, count and train --resume accept. Nothing is "
        "downloaded. Needs pip install -e '.[hf]' in the moeify checkout.")
    p.add_argument("--hf", required=True, metavar="DIR", help="the checkpoint directory")
    p.add_argument("--out", required=True, metavar="RUN", help="the new run directory")
    p.set_defaults(func=run)


def run(args) -> int:
    from moeify.interop.hf_import import import_hf

    out = import_hf(args.hf, args.out)
    print(f"imported {args.hf} into {out}")
    note = context_note(out)
    if note:
        print(f"note: {note}")
    return 0


def context_note(run_dir) -> str | None:
    """A sentence when the run's context (training chunk, generation window) is shorter than
    the checkpoint's positions: moeify caps it at a sliding window, where windowed and full
    attention agree (moeify.interop.hf_import); otherwise it is the source's own."""
    import json
    from pathlib import Path

    from moeify.interop.hf_import import HF_CONFIG_COPY
    from moeify.rundir.files import read_model_config

    hf = json.loads((Path(run_dir) / HF_CONFIG_COPY).read_text())
    positions = hf.get("max_position_embeddings") or hf.get("n_positions")
    T = read_model_config(run_dir).context_length
    if not positions or int(positions) <= T:
        return None
    return (f"the checkpoint has {int(positions)} positions; moeify trains and generates over "
            f"{T} tokens (its context_length: the checkpoint's sliding window, which moeify "
            "does not apply); the weights are imported whole")
