"""``moeify export``: a run directory becomes a Hugging Face model directory."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser(
        "export", help="export a run as a Hugging Face model directory (model_type moeify with "
        "remote code, or --format native: transformers' own GPT-2, Llama, Mixtral, ...)",
        description="Write the latest checkpoint of a run as a Hugging Face directory: "
        "config.json (model_type moeify, auto_map), modeling code that imports moeify, "
        "model.safetensors and the tokenizer. Load it with AutoModelForCausalLM.from_pretrained"
        "(DIR, trust_remote_code=True); it needs moeify installed wherever it is loaded. "
        "--format native writes a model that is exactly one of transformers' architectures "
        "(GPT-2, Llama, Mistral, Qwen2, Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE: imported "
        "checkpoints, trained or not) as that model_type, loadable without moeify.")
    p.add_argument("--run", required=True, help="run directory (or one of its checkpoints)")
    p.add_argument("--out", required=True, metavar="DIR", help="the new model directory")
    p.add_argument("--format", choices=("moeify", "native"), default="moeify",
                   help="moeify: model_type moeify with remote code, for every model (default); "
                   "native: transformers' own model_type, refused with the reason when the "
                   "model has none")
    p.set_defaults(func=run)


def run(args) -> int:
    from moeify.interop.hf_export import export_hf

    out = export_hf(args.run, args.out, format=args.format)
    print(f"exported {args.run} to {out}")
    return 0
