"""``moeify generate``: sample text from a trained run with its KV cache."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser(
        "generate", help="sample a continuation of a prompt from a trained run",
        description="Continue --prompt with tokens sampled from the run's latest checkpoint, "
        "decoding with the KV cache (Mixture-of-Depths models use their causal router). "
        "temperature 0 is greedy decoding. Generation ends at the tokenizer's end-of-sequence "
        "token (an imported model's eos_token_id, as transformers' generate; <|endoftext|> for "
        "the GPT-2 tokenizer), at a --stop string, or after --max-new-tokens.")
    p.add_argument("--run", required=True, help="run directory (or one of its checkpoints)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text to continue; \"\" samples unconditionally, after the "
                     "tokenizer's start-of-text token (or a newline)")
    src.add_argument("--prompt-file", metavar="PATH", help="read the text to continue from a "
                     "UTF-8 file, or from standard input with '-' (for prompts longer than a "
                     "command-line argument may be: 128 KiB on Linux)")
    p.add_argument("--max-new-tokens", type=int, default=200,
                   help="tokens to sample (at most 10000); the text is printed as it comes")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="sampling temperature; 0 = greedy decoding")
    p.add_argument("--top-k", type=int, default=None,
                   help="sample among the k most likely tokens only (default: all)")
    p.add_argument("--top-p", type=float, default=None,
                   help="sample among the most likely tokens whose probabilities add up to p "
                   "(nucleus sampling; default: all)")
    p.add_argument("--seed", type=int, default=None, help="make the sample reproducible")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end once the continuation contains TEXT (printed, as transformers' "
                   "stop_strings keep it); repeat for several")
    p.add_argument("--no-eos", action="store_true",
                   help="do not end at the end-of-sequence token: always sample "
                   "--max-new-tokens (unless a --stop string comes)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps (default "
                   "auto: CUDA when available, else CPU)")
    p.set_defaults(func=run)


def run(args) -> int:
    import sys

    from moeify.eval.generate import check_sampling_args, iter_generate, start_ids
    from moeify.train.distributed import DistEnv, pick_device
    from moeify.rundir import load_trained

    check_sampling_args(args.max_new_tokens, args.temperature, args.top_k, args.top_p)
    prompt = read_prompt(args.prompt, args.prompt_file)
    device = pick_device(args.device, DistEnv())
    if device.type == "cpu":
        from moeify.train.distributed import configure_cpu_threads

        configure_cpu_threads()
    tm = load_trained(args.run, device)
    ids = tm.tokenizer.encode(prompt) if prompt else start_ids(tm.tokenizer)
    if not ids:
        raise ValueError(f"the prompt {prompt[:80]!r} encodes to no tokens")
    mc = tm.model_config
    # The span the model was trained to attend over: its chunk, plus one chunk of XL memory.
    window = mc.context_length * (2 if mc.xl_memory else 1)
    if any(not s for s in args.stop):
        raise ValueError("--stop needs a non-empty text")
    eos = set() if args.no_eos else set(end_of_sequence_ids(tm.tokenizer, tm.run_dir))
    stops, decode = tuple(args.stop), tm.tokenizer.decode
    tokens = iter_generate(tm.model, ids, max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                           seed=args.seed, window=window, stop_ids=sorted(eos),
                           should_stop=(lambda new: any(s in decode(new) for s in stops))
                           if stops else None)
    stream_text(prompt, (t for t in tokens if t not in eos), decode, sys.stdout)
    return 0


def end_of_sequence_ids(tokenizer, run_dir) -> list[int]:
    """The ids generation ends at: an imported model's own (moeify.interop.hf_import's
    ``source_eos_ids``: generation_config.json, else config.json, as transformers' generate
    reads them), else the GPT-2 tokenizer's <|endoftext|>; none for byte-level and
    SentencePiece tokenizers, whose corpora separate documents by lines."""
    from moeify.interop.hf_import import source_eos_ids

    ids = source_eos_ids(run_dir)
    if ids is None and tokenizer.name == "gpt2":
        eot = tokenizer.encoder.get("<|endoftext|>")
        ids = [] if eot is None else [int(eot)]
    return [i for i in ids or [] if 0 <= i < tokenizer.vocab_size]


def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    """The prompt text from --prompt or --prompt-file (``-``: standard input; empty: sample
    unconditionally), checked to be UTF-8: a command-line argument in another encoding reaches Python as lone surrogates,
    which no tokenizer can encode."""
    import sys

    from moeify.errors import decode_error

    if prompt_file is not None:
        where = "standard input" if prompt_file == "-" else prompt_file
        data = sys.stdin.buffer.read() if prompt_file == "-" else open(prompt_file, "rb").read()
        try:
            prompt = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise decode_error(where, e) from None
        return prompt  # empty: unconditional sampling, as --prompt ""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raw = prompt[e.start].encode("utf-8", "surrogateescape")
        raise ValueError(f"--prompt is not UTF-8 text (byte 0x{raw.hex()} at character "
                         f"{e.start}): give UTF-8 text, e.g. convert it with iconv and pass "
                         "it with --prompt-file") from None
    return prompt


def stream_text(prompt: str, tokens, decode, out) -> None:
    """Write the prompt, then the continuation as it is sampled. The text is decoded from all
    new tokens each time and only its settled part is written: a character split over several
    tokens (a multi-byte UTF-8 sequence) appears once complete."""
    out.write(prompt)
    out.flush()
    new: list[int] = []
    shown = ""
    for tok in tokens:
        new.append(tok)
        text = decode(new)
        settled = text.rstrip("\ufffd")
        if len(settled) > len(shown) and settled.startswith(shown):
            out.write(settled[len(shown):])
            out.flush()
            shown = settled
    text = decode(new)
    out.write((text[len(shown):] if text.startswith(shown) else "") + "\n")
    out.flush()
