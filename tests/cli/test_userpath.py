"""What a new user reaches for first (issue 33): resuming with a new length says what the
schedule does, --init-from, devices this machine lacks, --list-settings, --version."""

import json
import os
import random
import shutil
import subprocess

import pytest
import torch

from moeify.cli.main import main
from moeify.rundir import checkpoints as ckr

TINY = ["--set", "tokenizer=byte256", "--set", "model.d_model=16", "--set", "model.n_layers=1",
        "--set", "model.context_length=8", "--set", "model.feedforward.d_ff=32",
        "--set", "batch_size=2", "--set", "warmup_steps=0", "--set", "eval_tokens=64",
        "--set", "eval_batch_size=2", "--set", "eval_every=0", "--quiet"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("userpath")
    rng = random.Random(0)
    words = ["the cat", "a dog", "sees", "likes", "the ball", "runs", "home"]
    path = tmp / "corpus.txt"
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(6)) + "."
                              for _ in range(300)) + "\n")
    (tmp / "other.txt").write_text("the dog runs home. " * 400)
    return path


@pytest.fixture(autouse=True)
def _env(corpus, monkeypatch):
    monkeypatch.setenv("MOEIFY_CACHE_DIR", str(corpus.parent / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("MOEIFY_DEBUG", raising=False)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def error(capsys, command="train") -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith(f"moeify {command}: error: "), err
    assert "Traceback" not in "\n".join(err)
    return err[-1]


def test_resume_with_new_steps_is_refused_without_a_schedule_choice(corpus, tmp_path, capsys):
    run = tmp_path / "r"
    assert main(["train", "--data", str(corpus), "--steps", "4", "--out", str(run), *TINY,
                 "--set", "checkpoint_every=2"]) == 0
    # Resume from step 2 (as if interrupted): the decay has begun, so 4 -> 6 needs a choice.
    step2 = run / "checkpoints" / "step-00000002"
    assert main(["train", "--resume", str(step2), "--steps", "6", "--quiet"]) == 2
    msg = error(capsys)
    assert "--schedule keep" in msg and "--schedule extend" in msg and "--init-from" in msg
    assert main(["train", "--data", str(corpus), "--schedule", "keep", *TINY]) == 2
    assert "--schedule goes with --resume" in error(capsys)
    assert main(["train", "--resume", str(step2), "--steps", "6", "--schedule", "extend"]) == 0
    assert "extend, the decay continues from the current rate" in capsys.readouterr().err
    assert ckr.load_checkpoint(run).step == 6


def test_init_from_starts_a_new_run_from_another_runs_weights(corpus, tmp_path, capsys):
    src, new = tmp_path / "src", tmp_path / "new"
    assert main(["train", "--data", str(corpus), "--steps", "3", "--out", str(src), *TINY]) == 0
    other = corpus.parent / "other.txt"
    assert main(["train", "--init-from", str(src), "--data", str(other), "--steps", "2",
                 "--set", "lr=1e-3", "--out", str(new), "--quiet"]) == 0
    cfg = json.loads((new / "config.json").read_text())
    assert cfg["lr"] == 1e-3 and cfg["data"] == str(other) and cfg["steps"] == 2
    assert cfg["init_from"].endswith("step-00000003") and cfg["batch_size"] == 2  # RUN's own
    # Fine-tuning defaults for what --set does not give (RUN trained with warmup_steps=0 and
    # the from-scratch clipping 0.25): warm-up 3% of the steps (at least 1), clipping 1.0.
    assert (cfg["warmup_steps"], cfg["grad_clip"], cfg["weight_decay"]) == (1, 1.0, 0.0)
    tuned = tmp_path / "tuned"
    capsys.readouterr()
    assert main(["train", "--init-from", str(src), "--steps", "2", "--out", str(tuned)]) == 0
    assert json.loads((tuned / "config.json").read_text())["lr"] == 5e-5  # not RUN's 5e-3
    assert "fine-tuning defaults (the weights are pretrained): lr 5e-05, warm-up 1 steps (3% " \
        "of 2), grad_clip 1, weight_decay 0; sequences of 8 tokens" in capsys.readouterr().err
    start = ckr.load_checkpoint(new / "checkpoints" / "step-00000000").model_state
    trained = ckr.load_checkpoint(src).model_state
    assert all(torch.equal(start[k], trained[k]) for k in trained)
    assert ckr.load_checkpoint(new).step == 2
    # The model is RUN's: --preset is refused, and so is a change of a weight's shape.
    assert main(["train", "--init-from", str(src), "--preset", "tiny-dense"]) == 2
    assert "does not go with --resume or --preset" in error(capsys)
    assert main(["train", "--init-from", str(src), "--set", "model.d_model=32",
                 "--out", str(tmp_path / "bad"), "--quiet"]) == 2
    assert "do not fit the model" in error(capsys)
    assert not (tmp_path / "bad").exists()


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has MPS")
def test_a_device_this_machine_lacks_is_one_line_and_leaves_no_run_directory(corpus, tmp_path,
                                                                           capsys):
    for device in ("mps", "gpu", "cuda"):
        if device == "cuda" and torch.cuda.is_available():
            continue
        out = tmp_path / "runs" / device  # runs/ is made by the start too
        assert main(["train", "--data", str(corpus), "--steps", "1", "--out", str(out),
                     *TINY, "--set", f"device={device}"]) == 2
        msg = error(capsys)
        assert f"device={device}" in msg or f"device {device!r}" in msg, msg
        assert not out.exists() and not (tmp_path / "runs").exists()
    assert main(["train", "--data", str(corpus), "--out", str(tmp_path / "m"), *TINY,
                 "--set", "device=mps"]) == 2
    assert "no usable MPS backend" in error(capsys)
    # A refused start late in the setup (fp16 needs CUDA) leaves nothing either.
    assert main(["train", "--data", str(corpus), "--steps", "1", "--out", str(tmp_path / "f"),
                 *TINY, "--set", "amp=fp16", "--set", "device=cpu"]) == 2
    assert "fp16 needs a CUDA device" in error(capsys)
    assert not (tmp_path / "f").exists()


def test_list_settings_lists_model_keys_with_values_and_meanings(capsys):
    assert main(["train", "--list-settings"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines()}
    assert "auto|fp32|bf16|fp16" in lines["amp"]
    assert "model.d_model" in lines and "residual width" in lines["model.d_model"]
    assert "model.attention.n_experts" in lines and "lr_extensions" not in lines
    assert "model.norm" not in lines and "'layernorm'" in lines["model.norm.kind"]
    for key, line in lines.items():  # a meaning cut short keeps its parentheses balanced
        assert line.count("(") == line.count(")"), line
    assert main(["train", "--list-settings", "--preset", "tiny-dense"]) == 0
    assert "model.attention.n_heads" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    # The default run is named; its duration is not (it depends on the machine: the training
    # guide states measured times with the machine they were measured on).
    assert "default: tiny-switchhead, 1M parameters, 300 steps on wiki-excerpt" in text
    assert "minute" not in text


def test_install_hints_name_the_checkout_install_the_readme_uses():
    from moeify.errors import install_hint, source_checkout

    assert install_hint("hf").startswith("pip install -e '.[hf]' in the moeify checkout")
    root = source_checkout()
    assert root is not None and (root / "pyproject.toml").is_file()
    readme = (root / "README.md").read_text()
    assert 'pip install -e ".[dev,plot,tokenizers,hf,harness,triton,docs]"` in the checkout' in readme
    # No message or help names a package that is not on any index.
    for path in (root / "src" / "moeify").rglob("*.py"):
        text = path.read_text()
        assert "pip install moeify" not in text and "pip install 'moeify[" not in text, path
    assert "pip install 'moeify[" not in readme and "pip install moeify" not in readme
    # Nor the skip reasons make test lists (-rfEs), nor the docs' scripts.
    for path in [*(root / "tests").rglob("*.py"), *(root / "docs").rglob("*.py")]:
        if path.name != "test_userpath.py":
            assert "'moeify[" not in path.read_text(), path


def test_version_and_py_typed(capsys):
    import tomllib

    from moeify.errors import source_checkout

    root = source_checkout()
    project = tomllib.loads((root / "pyproject.toml").read_text())
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"moeify {project['project']['version']}"
    assert (root / "src" / "moeify" / "py.typed").is_file()
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["moeify"]


def test_long_work_reports_progress(corpus, tmp_path, capsys, monkeypatch):
    import io

    from moeify.train.progress import CountProgress, Progress

    run = tmp_path / "r"
    assert main(["train", "--data", str(corpus), "--steps", "2", "--out", str(run), *TINY]) == 0
    blimp = tmp_path / "blimp.jsonl"
    blimp.write_text("\n".join(json.dumps({"sentence_good": g, "sentence_bad": b, "UID": "toy",
                                           "field": "syntax"})
                               for g, b in [("the cat sees.", "the cat see."),
                                            ("a dog runs.", "dog a runs.")]) + "\n")
    capsys.readouterr()
    assert main(["eval", "--run", str(run), "--task", "blimp", "--data", str(blimp),
                 "--batch-size", "2"]) == 0
    err = capsys.readouterr().err
    assert "blimp of r: 4/4 sentences (100%)" in err and "ETA" in err
    assert main(["eval", "--run", str(run), "--task", "blimp", "--data", str(blimp),
                 "--quiet"]) == 0
    assert "sentences" not in capsys.readouterr().err

    # Compiling: said before the first step, and the ETA counts from the step after it.
    p = Progress(10, 0, stream=io.StringIO())
    p.t0 -= 100.0                       # the first step took 100 s (compiling)
    p.restart(1)
    assert p.eta(2) < 5.0
    import moeify.train.plans as plans

    monkeypatch.setattr(plans, "compile_blocks", lambda model, **k: model)  # no compiler
    from moeify.train.config import TrainConfig
    from moeify.train.trainer import train

    out = io.StringIO()
    train(TrainConfig(data=str(corpus), tokenizer="byte256", steps=2, batch_size=2,
                      eval_every=0, eval_tokens=64, eval_batch_size=2, compile=True,
                      model_overrides=("model.d_model=16", "model.n_layers=1",
                                       "model.context_length=8", "model.feedforward.d_ff=32")),
          tmp_path / "c", stream=out)
    text = out.getvalue()
    assert "compiling the model's blocks (torch.compile)" in text
    assert "compiled: the first step took" in text
    assert text.index("compiling") < text.index("compiled:") < text.index("step 2/2")

    c = CountProgress("x", "items", stream=io.StringIO())
    c(1, 3), c(2, 3), c(3, 3)           # not a terminal: the first line, then the last
    assert c.stream.getvalue().splitlines()[-1].startswith("x: 3/3 items (100%)")


def test_setup_and_make_test_say_what_they_do():
    from moeify.errors import source_checkout

    root = source_checkout()
    setup = (root / "scripts" / "setup_env.sh").read_text()
    installs = [line for line in setup.splitlines() if "pip install" in line]
    assert installs and not any(" -q" in line for line in installs)  # pip shows its progress
    report = (root / "pyproject.toml").read_text().split("addopts")[1].splitlines()[0]
    assert "-rfEs" in report  # failures and errors summarised too, not only the skips


def test_generate_samples_unconditionally_from_an_empty_prompt(corpus, tmp_path, capsys):
    from moeify.data.tokenizers import ByteTokenizer
    from moeify.eval.generate import start_ids

    run = tmp_path / "r"
    assert main(["train", "--data", str(corpus), "--steps", "1", "--out", str(run), *TINY]) == 0
    capsys.readouterr()
    assert main(["generate", "--run", str(run), "--prompt", "", "--max-new-tokens", "12",
                 "--seed", "1"]) == 0
    text = capsys.readouterr().out
    assert len(text.rstrip("\n")) > 0
    byte = ByteTokenizer(sorted(set(b"ab\ncd")))
    assert start_ids(byte) == byte.encode("\n")
    gpt2 = type("GPT2", (), {"encoder": {"<|endoftext|>": 50256}, "vocab_size": 50257,
                             "name": "gpt2"})()
    assert start_ids(gpt2) == [50256]
    if not torch.backends.mps.is_available():
        assert main(["generate", "--run", str(run), "--prompt", "x", "--device", "mps"]) == 2
        assert "no usable MPS backend" in error(capsys, "generate")


def test_blimp_reports_one_syntax_semantics_field(tmp_path):
    from moeify.eval.blimp import load_blimp

    for uid, field in (("a", "syntax/semantics"), ("b", "syntax_semantics"), ("c", "syntax")):
        (tmp_path / f"{uid}.jsonl").write_text(json.dumps(
            {"sentence_good": "x y", "sentence_bad": "y x", "UID": uid, "field": field}) + "\n")
    assert sorted({p.field for p in load_blimp(tmp_path)}) == ["syntax", "syntax_semantics"]


def test_every_option_has_help_and_the_reported_ones_show_their_defaults(capsys):
    import argparse

    from moeify.cli.main import build_parser

    missing = []

    def walk(parser, name):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    if not sub.description:
                        missing.append(f"{name} {sub_name}: no description")
                    walk(sub, f"{name} {sub_name}")
            elif action.option_strings and not action.help:
                missing.append(f"{name} {action.option_strings[0]}")

    walk(build_parser(), "moeify")
    assert not missing, missing
    for argv, needle in ((["demo"], "experts chosen per row (default: 2)"),
                         (["match"], "(default: switchhead)"),
                         (["eval"], "side by side (default 32)"),
                         (["generate"], "0 = greedy decoding (default: 0.8)"),
                         (["bench", "step"], "sequences per training step (default: 4)"),
                         (["bench", "ff"], "tokens per batch (default: 4096)"),
                         (["plot", "experts"], "routes (default: valid)")):
        with pytest.raises(SystemExit):
            main([*argv, "--help"])
        help_text = " ".join(capsys.readouterr().out.split())
        assert needle in help_text, (argv, needle)


def test_count_upcycle_compare_and_sweep_output_say_what_they_mean(corpus, tmp_path, capsys):
    from moeify.analysis.compare import valid_text
    from moeify.analysis.sweep import main_table

    assert main(["count", "--preset", "wt103-47m-switchhead"]) == 0
    assert "0.8M values   2.9 MiB" in capsys.readouterr().out
    assert valid_text({"loss": 3.0, "tokens": 502, "bpc": 4.328}) == \
        "valid bpc 4.3280 (loss 3.0000 over 502 tokens)"
    md = "# moeify sweep\n\nSettings: ...\n\n| a |\n|---|\n| 1 |\n\nPer-seed values:\n- x\n"
    assert main_table(md) == ("# moeify sweep\n\n| a |\n|---|\n| 1 |\n\n(settings, per-seed "
                              "values and routing: results.md)")
    run, up = tmp_path / "dense", tmp_path / "up"
    assert main(["train", "--preset", "tiny-dense", "--data", str(corpus), "--steps", "1",
                 "--out", str(run), *TINY]) == 0
    capsys.readouterr()
    assert main(["upcycle", "--run", str(run), "--out", str(up), "--ff", "switch:E=2",
                 "--no-validate"]) == 0
    assert f"continue with: moeify train --resume {up}\n" in capsys.readouterr().out


def test_tensorboard_says_where_its_logs_go(corpus, tmp_path, capsys, monkeypatch):
    import moeify.train.metrics as metrics

    class Writer:  # stands in for TensorBoard's SummaryWriter (an optional extra)
        def __init__(self, log_dir):
            log_dir.mkdir(parents=True)

        def __getattr__(self, name):
            return lambda *a, **k: None

    monkeypatch.setattr(metrics, "_summary_writer", Writer)
    run = tmp_path / "tb"
    argv = [a for a in TINY if a != "--quiet"]
    assert main(["train", "--data", str(corpus), "--steps", "1", "--out", str(run), *argv,
                 "--set", "tensorboard=true"]) == 0
    assert f"TensorBoard logs go to {run / 'tensorboard'}" in capsys.readouterr().err
    assert (run / "tensorboard").is_dir()


def test_float64_angles_are_formed_on_the_cpu_for_mps_only():
    from moeify.ops.positional import angle_device, rope_inv_freq

    assert angle_device("mps") == torch.device("cpu")
    assert angle_device("cpu") == "cpu" and angle_device(None) is None
    assert angle_device(torch.device("cuda", 0)) == torch.device("cuda", 0)
    assert rope_inv_freq(8, device="mps").device.type == "cpu"  # no MPS tensor is made


@pytest.mark.skipif(not shutil.which("bash"), reason="the setup script is bash")
@pytest.mark.parametrize("cuda", [False, True])
def test_setup_installs_triton_only_where_torch_is_a_cuda_build(tmp_path, cuda):
    """About 1 GB of Triton is of no use to a CPU-only `make train`; a CUDA torch gets it, and
    extras that name it keep it (`make test` does, for the Triton-interpreter tests)."""
    from moeify.errors import source_checkout

    root = source_checkout()
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    fake = venv / "bin" / "python"  # answers "is torch a CUDA build?"
    fake.write_text(f"#!/bin/sh\nexit {0 if cuda else 1}\n")
    fake.chmod(0o755)

    def would_install(extras):
        out = subprocess.run(["bash", str(root / "scripts" / "setup_env.sh"), str(venv), extras],
                             cwd=root, capture_output=True, text=True, check=True,
                             env={**os.environ, "MOEIFY_SETUP_DRY_RUN": "1"}).stdout
        return out.strip().removeprefix("[setup] would install moeify[").removesuffix("]")

    assert would_install("dev,plot") == ("dev,plot,triton" if cuda else "dev,plot")
    assert would_install("dev,triton") == "dev,triton"
    if shutil.which("make") and not cuda:
        # without the outer make's variables (under `make test` they add "Entering directory")
        env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
        plan = subprocess.run(["make", "--no-print-directory", "-n", "setup", "setup-test"],
                              cwd=root, capture_output=True, text=True, check=True,
                              env=env).stdout.splitlines()
        assert "triton" not in plan[0] and plan[1].endswith(",triton")
