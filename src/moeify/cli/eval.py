"""``moeify eval``: score a trained run on perplexity / bpc or a zero-shot task."""

from __future__ import annotations

TASK_NAMES = ("ppl", "lambada", "blimp", "cbt")  # TASKS below maps each to its scorer


def register(sub) -> None:
    p = sub.add_parser(
        "eval", help="evaluate a run: perplexity/bpc, LAMBADA, BLiMP or CBT",
        description="Evaluate the latest checkpoint of a run (or a given checkpoint) as the "
        "SwitchHead authors scored each task (their code). ppl: perplexity, and bits per "
        "character for byte-level models, over a split of the run's corpus with XL memory "
        "carried. lambada / blimp / cbt: zero-shot, every item scored on its own; their data is "
        "found under --data-dir or $MOEIFY_DATA_DIR (blimp/, lambada/, cbt/) or at --data.")
    p.add_argument("--run", required=True, help="run directory (or one of its checkpoints)")
    p.add_argument("--task", choices=TASK_NAMES, help="one of moeify's tasks (or --harness below)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--data-dir", help="directory laid out like $MOEIFY_DATA_DIR (overrides it)")
    p.add_argument("--data", help="the task's data itself (ppl: a corpus name or path; blimp: a "
                   "directory or .jsonl file; lambada: the .jsonl file; cbt: the directory)")
    p.add_argument("--split", default="test", choices=("train", "valid", "test"),
                   help="ppl: the corpus split (default test)")
    p.add_argument("--limit", type=int, help="score only the first N items (blimp: per paradigm; "
                   "cbt: per group; ppl: N tokens)")
    p.add_argument("--batch-size", type=int, default=32,
                   help="items (sentences, passages, candidates; ppl: streams) scored side by "
                   "side (default 32)")
    p.add_argument("--quiet", action="store_true", help="no progress line on stderr")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps (default "
                   "auto: CUDA when available, else CPU)")
    from moeify.cli import eval_harness

    eval_harness.add_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    import json
    from pathlib import Path

    import torch

    from moeify.eval.adapters import stateless_logits_fn
    from moeify.eval.scoring import zero_shot_context
    from moeify.train.distributed import DistEnv, pick_device
    from moeify.rundir import load_trained
    from moeify.train.trainer import resolve_amp

    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be a positive integer, got {args.limit}")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be a positive integer, got {args.batch_size}")
    if args.harness is not None:
        from moeify.cli.eval_harness import run_harness

        return run_harness(args)
    if args.task is None:
        raise ValueError("give --task TASK (ppl, lambada, blimp, cbt) or --harness TASK[,TASK]")
    if args.harness_include or args.harness_out:
        raise ValueError("--harness-include and --harness-out go with --harness TASK[,TASK]")
    device = pick_device(args.device, DistEnv())
    if device.type == "cpu":
        from moeify.train.distributed import configure_cpu_threads

        configure_cpu_threads()
    amp_dtype = resolve_amp("auto", device)[0]
    data_path = args.data
    if data_path is None and args.data_dir is not None and args.task != "ppl":
        from moeify.eval.paths import TASK_DATA

        data_path = str(Path(args.data_dir) / TASK_DATA[args.task][0])
    if data_path is not None and args.task != "ppl" and not Path(data_path).exists():
        raise FileNotFoundError(f"{args.task} data not found at {data_path}")

    tm = load_trained(args.run, device)
    max_len = zero_shot_context(tm.model_config)  # the rule the harness adapter shares
    logits_fn = stateless_logits_fn(tm.model, device, amp_dtype)
    result: dict = {"run": str(tm.run_dir), "checkpoint": tm.checkpoint.path.name,
                    "step": tm.checkpoint.step, "task": args.task}
    task = TASKS[args.task]
    from moeify.train.progress import CountProgress

    progress = CountProgress(f"{args.task} of {tm.run_dir.name}", UNITS[args.task],
                             enabled=not args.quiet)
    try:
        with torch.no_grad():
            result.update(task(args, tm, logits_fn, data_path, max_len, device, amp_dtype,
                               progress))
    finally:
        progress.close()
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    _print_human(result)
    return 0


# One function per task: (args, trained run, logits_fn, data path, max length, device, amp dtype,
# progress callback) -> the task's result fields.
UNITS = {"ppl": "tokens", "lambada": "passages", "blimp": "sentences", "cbt": "candidates"}


def _ppl(args, tm, logits_fn, data_path, max_len, device, amp_dtype, progress) -> dict:
    from moeify.data.corpora import load_corpus
    from moeify.data.stream import tokenize_split
    from moeify.eval.adapters import evaluate_stream

    from moeify.rundir.data import run_corpus_spec

    corpus_spec = data_path or run_corpus_spec((tm.train_config or {}).get("data"), tm.run_dir)
    corpus = load_corpus(corpus_spec)
    tokens = tokenize_split(corpus, tm.tokenizer, args.split)
    res = evaluate_stream(tm.model, tokens, tm.tokenizer, seq_len=tm.model_config.context_length,
                          batch_size=args.batch_size, max_tokens=args.limit or 0,
                          device=device, amp_dtype=amp_dtype, progress=progress)
    out = {"corpus": corpus.name, "split": args.split, **res}
    if "bpc" not in res:
        out["ppl"] = res["ppl"]
    return out


def _lambada(args, tm, logits_fn, data_path, max_len, device, amp_dtype, progress) -> dict:
    from moeify.eval.lambada import lambada_accuracy, load_lambada

    texts = load_lambada(data_path, limit=args.limit)
    return lambada_accuracy(logits_fn, tm.tokenizer, texts, batch_size=args.batch_size,
                            max_len=max_len, progress=progress)


def _blimp(args, tm, logits_fn, data_path, max_len, device, amp_dtype, progress) -> dict:
    from moeify.eval.blimp import blimp_accuracy, load_blimp

    pairs = load_blimp(data_path, limit_per_paradigm=args.limit)
    # Whole sentences: a truncated sentence would not have the score the task defines.
    return blimp_accuracy(logits_fn, tm.tokenizer, pairs, batch_size=args.batch_size,
                          progress=progress)


def _cbt(args, tm, logits_fn, data_path, max_len, device, amp_dtype, progress) -> dict:
    from moeify.eval.cbt import cbt_accuracy, load_cbt

    examples = load_cbt(data_path, limit=args.limit)
    return cbt_accuracy(logits_fn, tm.tokenizer, examples, batch_size=args.batch_size,
                        max_len=max_len, progress=progress)


TASKS = {"ppl": _ppl, "lambada": _lambada, "blimp": _blimp, "cbt": _cbt}


def _print_human(r: dict) -> None:
    head = f"{r['task']} of {r['run']} ({r['checkpoint']})"
    if r["task"] == "ppl":
        parts = [f"loss {r['loss']:.4f}"]
        if "bpc" in r:
            parts.append(f"bpc {r['bpc']:.4f}")
        else:
            parts.append(f"perplexity {r['ppl']:.2f}")
        print(f"{head}: {', '.join(parts)} over {r['tokens']} tokens of {r['corpus']}/{r['split']}")
        return
    n = r.get("n", r.get("pairs"))
    print(f"{head}: accuracy {100 * r['accuracy']:.2f}% ({n} items)")
    for key in ("fields", "groups"):
        for name, acc in (r.get(key) or {}).items():
            print(f"  {name:<24} {100 * acc:.2f}%")
