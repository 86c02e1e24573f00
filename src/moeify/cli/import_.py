"""``moeify import``: a Hugging Face checkpoint directory becomes a moeify run directory."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser(
        "import", help="import a Hugging Face checkpoint (GPT-2, Llama, Mistral, Qwen2) as a run",
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
    return 0
