"""The trainer on a tiny model and a tiny corpus: it learns, one update equals a hand-written
AdamW step, resume is exact, NaN stops cleanly, an interrupted checkpoint write is survivable."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from moeify.errors import MoeifyError
from moeify.rundir import layout
from moeify.rundir import checkpoints as ckr
from moeify.rundir import write as ck
from moeify.train.config import TrainConfig
from moeify.train.metrics import read_metrics
from moeify.train.trainer import NonFiniteLoss, Trainer, train

TINY = ("model.d_model=32", "model.n_layers=2", "model.context_length=16",
        "model.feedforward.d_ff=64")


def tiny_cfg(corpus, **kw):
    base = dict(data=str(corpus), tokenizer="byte256", steps=8, batch_size=4, warmup_steps=0,
                lr=3e-3, log_every=1, eval_every=0, eval_tokens=512, eval_batch_size=4,
                checkpoint_every=4, model_overrides=TINY)
    base.update(kw)
    return TrainConfig(**base)


def test_short_run_lowers_validation_loss(env):
    tmp, corpus = env
    tr = Trainer(tiny_cfg(corpus, steps=40, checkpoint_every=0), tmp / "run", quiet=True)
    before = tr.validate()["loss"]
    res = tr.fit()
    assert abs(before - math.log(256)) < 0.5  # an untrained model is near uniform
    assert res.valid["loss"] < before - 1.0, (before, res.valid)
    assert res.valid["bpc"] == pytest.approx(res.valid["loss"] / math.log(2))
    rec = [r for r in read_metrics(tmp / "run") if r["kind"] == "train"]
    assert [r["step"] for r in rec] == list(range(1, 41))
    assert {"loss", "bpc", "lr", "tokens_per_s", "grad_norm", "aux_loss"} <= set(rec[-1])
    assert any(k.startswith("stats/layers.0.attn") for k in rec[-1])  # routing statistics
    tr.close()


def test_validation_equals_a_hand_written_xl_loop(env):
    tmp, corpus = env
    tr = Trainer(tiny_cfg(corpus), tmp / "run", quiet=True)
    tokens = torch.as_tensor(tr.valid_tokens[:161].astype("int64"))
    got = __import__("moeify.train.validate", fromlist=["x"]).evaluate_stream(
        tr.model, tokens.numpy(), tr.tokenizer, seq_len=16, batch_size=1)
    # One stream, windows of 16 targets, XL memory = the previous window's block inputs.
    tr.model.eval()
    nll, mem = 0.0, None
    with torch.no_grad():
        for s in range(0, 160, 16):
            x, y = tokens[s:s + 16][None], tokens[s + 1:s + 17][None]
            out = tr.model(x, memory=mem)
            mem = out.memory
            nll += F.cross_entropy(out.logits[0].double(), y[0], reduction="sum").item()
    assert got["tokens"] == 160
    assert got["loss"] == pytest.approx(nll / 160, rel=1e-7)
    tr.close()


def test_one_update_equals_a_hand_written_adamw_step(env):
    """tiny-switchall has a sigma-MoE aux loss: it must be added to the LM loss."""
    tmp, corpus = env
    cfg = tiny_cfg(corpus, preset="tiny-switchall", steps=3, grad_clip=0.05, weight_decay=0.1,
                   warmup_steps=2, betas=(0.8, 0.95),
                   model_overrides=TINY[:3] + ("model.feedforward.expert_size=16",
                                                 "model.feedforward.entropy_coef=0.5"))
    tr = Trainer(cfg, tmp / "run", quiet=True)
    ref = tr.model_cfg.build()
    ref.load_state_dict(tr.model.state_dict())
    # Data layout by hand: 4 contiguous streams of len(tokens) // 4 bytes, first window of each.
    data = torch.tensor(list(tr.corpus.read_bytes("train")), dtype=torch.long)
    stream = len(data) // 4
    win = torch.stack([data[b * stream: b * stream + 17] for b in range(4)])
    # Called as the trainer calls it (the fused loss: its gradients equal the logits path's to
    # float rounding, which Adam's first step, ~lr·sign(g), turns into lr-sized differences
    # where a gradient is zero up to rounding).
    out = ref(win[:, :-1], win[:, 1:], return_logits=False)
    assert abs(out.aux_loss.item()) > 0.1
    (out.loss + out.aux_loss).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    decay = [p for p in ref.parameters() if p.dim() >= 2]
    rest = [p for p in ref.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=3e-3 * 0.5, betas=(0.8, 0.95))  # warm-up: (0 + 1) / 2
    opt.step()
    rec = tr.train_step()
    assert rec["loss"] == pytest.approx(out.loss.item(), rel=1e-6)
    assert rec["lr"] == pytest.approx(3e-3 * 0.5)
    for (name, p), q in zip(tr.model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=name)
    tr.close()


def _final_weights(run_dir):
    return ckr.load_checkpoint(run_dir).model_state


def test_resume_reproduces_the_uninterrupted_run_exactly(env, capsys):
    tmp, corpus = env
    cfg = tiny_cfg(corpus, grad_accum=2, warmup_steps=2)  # XL memory, accumulation, warm-up
    full = train(cfg, tmp / "a", quiet=True)
    err = capsys.readouterr().err  # quiet: not even the corpus preparation and tokenising lines
    assert "[moeify]" not in err, err
    first = train(cfg, tmp / "b", quiet=True, stop_after=4)  # "preempted" after step 4
    assert sorted(first.losses) == [1, 2, 3, 4]
    assert layout.latest_checkpoint(tmp / "b").name == "step-00000004"
    resumed = train(cfg, tmp / "b", resume=True, quiet=True)
    assert sorted(resumed.losses) == [5, 6, 7, 8]
    for s in range(1, 9):
        got = first.losses.get(s, resumed.losses.get(s))
        assert got == full.losses[s], (s, got, full.losses[s])  # bit for bit
    wa, wb = _final_weights(tmp / "a"), _final_weights(tmp / "b")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    steps = [r["step"] for r in read_metrics(tmp / "b") if r["kind"] == "train"]
    assert steps == list(range(1, 9))


def test_resume_refuses_changed_settings_and_fresh_run_refuses_existing(env):
    tmp, corpus = env
    cfg = tiny_cfg(corpus, steps=4)
    train(cfg, tmp / "r", quiet=True, stop_after=4)
    with pytest.raises(MoeifyError, match="--resume"):
        train(cfg, tmp / "r", quiet=True)
    with pytest.raises(ValueError, match="another preset"):
        train(tiny_cfg(corpus, steps=4, preset="tiny-dense"), tmp / "r", resume=True, quiet=True)
    with pytest.raises(ValueError, match="cannot change lr"):
        train(tiny_cfg(corpus, steps=4, lr=1.0), tmp / "r", resume=True, quiet=True)


def test_nan_loss_stops_and_leaves_the_last_checkpoint_intact(env):
    tmp, corpus = env
    tr = Trainer(tiny_cfg(corpus, steps=6, checkpoint_every=2), tmp / "run", quiet=True)
    tr.fit(stop_after=2)
    good = tmp / "run" / "checkpoints" / "step-00000002"
    before = {p.name: p.read_bytes() for p in good.iterdir()}
    weights = {k: v.clone() for k, v in tr.model.state_dict().items()}
    with torch.no_grad():
        tr.model.output.bias[3] = float("nan")
    with pytest.raises(NonFiniteLoss, match=r"nan.*step 3.*step-00000002 is intact"):
        tr.fit()
    assert [p.name for p in layout.checkpoint_dirs(tmp / "run")] == ["step-00000002"]
    assert {p.name: p.read_bytes() for p in good.iterdir()} == before
    assert tr.step == 2  # no update was applied
    for k, v in tr.model.state_dict().items():  # only the poisoned bias differs
        if k != "output.bias":
            assert torch.equal(v, weights[k]), k
    tr.close()


def test_run_killed_while_writing_a_checkpoint_resumes_from_the_previous_one(env, monkeypatch):
    tmp, corpus = env
    cfg = tiny_cfg(corpus, steps=4, checkpoint_every=2)
    reference = train(cfg, tmp / "ref", quiet=True)
    real_save = ck.save_state
    calls = []

    def dies_on_second_save(state, path):
        calls.append(path)
        if len(calls) == 2:
            path.write_bytes(b"\x80\x02half a pickle")
            raise OSError("killed")
        real_save(state, path)

    monkeypatch.setattr(ck, "save_state", dies_on_second_save)
    with pytest.raises(MoeifyError, match="step 4.*last good checkpoint .*step-00000002 is intact"):
        train(cfg, tmp / "run", quiet=True)
    monkeypatch.undo()
    assert layout.latest_checkpoint(tmp / "run").name == "step-00000002"
    resumed = train(cfg, tmp / "run", resume=True, quiet=True)
    assert resumed.losses == {3: reference.losses[3], 4: reference.losses[4]}
    assert layout.latest_checkpoint(tmp / "run").name == "step-00000004"
    assert not any(p.name.startswith(".tmp") for p in (tmp / "run" / "checkpoints").iterdir())


def test_run_directory_holds_resolved_configs(env):
    tmp, corpus = env
    train(tiny_cfg(corpus, steps=1, checkpoint_every=0), tmp / "run", quiet=True)
    saved = json.loads((tmp / "run" / "config.json").read_text())
    assert TrainConfig.from_dict(saved) == tiny_cfg(corpus, steps=1, checkpoint_every=0)
    model = json.loads((tmp / "run" / "model.json").read_text())
    assert model["d_model"] == 32 and model["n_layers"] == 2 and model["vocab_size"] == 256
    assert all(a["d_model"] == 32 and a["n_layers"] == 2 for a in model["attention"])
    meta = json.loads((tmp / "run" / "checkpoints" / "step-00000001" / "meta.json").read_text())
    assert meta["model_config"] == model and meta["preset"] == "tiny-switchhead"


def test_bf16_autocast_trains_on_cpu_and_fp16_needs_cuda(env):
    tmp, corpus = env
    res = train(tiny_cfg(corpus, steps=6, amp="bf16", checkpoint_every=0), tmp / "bf16",
                quiet=True)
    assert all(math.isfinite(v) for v in res.losses.values())
    assert res.losses[6] < res.losses[1]
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="fp16 needs a CUDA device"):
            train(tiny_cfg(corpus, amp="fp16"), tmp / "fp16", quiet=True)


def test_tensorboard_without_the_package_names_the_extra(env, monkeypatch):
    import sys

    tmp, corpus = env
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    with pytest.raises(MoeifyError, match=r"pip install -e '\.\[tensorboard\]'"):
        train(tiny_cfg(corpus, steps=1, tensorboard=True), tmp / "tb", quiet=True)
