"""TrainConfig: typed --set overrides, model overrides, JSON round trip, resume rules, the paper
recipe, and the warm-up + cosine schedule against its formula."""

import math

import pytest
import torch

from moeify.train.config import (TrainConfig, check_resume_compatible, paper_recipe,
                                 resolve_model_config)
from moeify.train.schedule import make_scheduler


def test_overrides_are_parsed_to_the_field_types():
    cfg = TrainConfig().with_overrides(["lr=2e-4", "steps=1e3", "betas=0.9, 0.98",
                                        "tensorboard=yes", "cosine_steps=none", "amp=bf16"])
    assert cfg.lr == 2e-4 and cfg.steps == 1000 and cfg.betas == (0.9, 0.98)
    assert cfg.tensorboard is True and cfg.cosine_steps is None and cfg.amp == "bf16"
    assert TrainConfig().with_overrides(["cosine_steps=50"]).cosine_steps == 50


@pytest.mark.parametrize("item, msg", [
    ("lr=abc", "expected a number"), ("steps=2.5", "expected an integer"),
    ("tensorboard=maybe", "true or false"), ("betas=0.9", "2 comma-separated"),
    ("nope=1", "unknown setting 'nope'"), ("lr", "key=value"), ("=3", "key before"),
    ("steps=0", "positive integer"), ("amp=fp8", "amp must be one of"),
    ("betas=0.9,1.5", "betas must be"), ("model.d_model=big", "expected an integer"),
    ("model.attention.nope=1", "has no field 'nope'"), ("model.nope=1", "no settable field"),
    ("model.n_layers=0", "positive integer"),
    ("model.norm=rmsnorm", "model.norm is a NormConfig: set its fields"),
    ("model.norm.kind=rmsnorm", "RMSNorm has no bias; set bias=False"),
    ("model.norm.nope=1", "NormConfig has no field 'nope'"),
])
def test_bad_overrides_name_the_problem(item, msg):
    with pytest.raises(ValueError, match=msg):
        TrainConfig().with_overrides([item])


@pytest.mark.parametrize("order", [0, 1])
def test_model_norm_fields_are_settable_in_any_order(order):
    """Fields that must agree are checked together: kind=rmsnorm before bias=false was refused
    (the first change alone made an RMSNorm with a bias)."""
    items = ["model.norm.bias=false", "model.norm.kind=rmsnorm", "model.norm.eps=1e-6"]
    cfg = TrainConfig().with_overrides(items if order == 0 else items[::-1])
    norm = resolve_model_config(cfg, vocab_size=100).norm
    assert (norm.kind, norm.bias, norm.eps) == ("rmsnorm", False, 1e-6)
    with pytest.raises(ValueError, match="--set model.norm.kind=rmsnorm --set model.d_model=8: "
                                         ".*RMSNorm has no bias; set bias=False"):
        TrainConfig().with_overrides(["model.norm.kind=rmsnorm", "model.d_model=8"])


def test_model_overrides_reach_every_layer_config():
    cfg = TrainConfig().with_overrides(["model.d_model=48", "model.n_layers=3",
                                        "model.attention.n_experts=6",
                                        "model.attention.experts=k,o"])
    m = resolve_model_config(cfg, vocab_size=100)
    assert (m.d_model, m.n_layers, m.vocab_size) == (48, 3, 100)
    for layer in (*m.attention, *m.feedforward):
        assert layer.d_model == 48 and layer.n_layers == 3
    assert m.attention[0].n_experts == 6 and m.attention[0].experts == frozenset("ko")
    assert cfg.model_overrides[-1] == "model.attention.experts=k,o"


def test_unknown_setting_lists_only_what_set_accepts():
    with pytest.raises(ValueError, match="unknown setting") as err:
        TrainConfig().with_overrides(["nope=1"])
    listed = str(err.value).split("train settings are ")[1].split(", model settings")[0]
    names = listed.split(", ")
    assert "lr" in names and "expert_parallel" in names
    for refused in ("model", "model_overrides", "lr_extensions", "init_from"):
        assert refused not in names  # --set refuses these: offering them misleads
        with pytest.raises(ValueError):
            TrainConfig().with_overrides([f"{refused}=x"])


def test_settable_model_fields_listed_exclude_norm():
    with pytest.raises(ValueError, match="no settable field") as err:
        TrainConfig().with_overrides(["model.nope=1"])
    assert "norm" not in str(err.value).split("choose one of ")[1].split(" or model.")[0]


def test_json_round_trip():
    cfg = TrainConfig(preset="tiny-dense", betas=(0.8, 0.9), model_overrides=("model.d_model=8",),
                      cosine_steps=7)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown TrainConfig fields"):
        TrainConfig.from_dict({"learning_rate": 1})


def test_resume_rules():
    saved = TrainConfig()
    check_resume_compatible(saved, TrainConfig(steps=900, eval_every=5))
    with pytest.raises(ValueError, match="another preset"):
        check_resume_compatible(saved, TrainConfig(preset="tiny-dense"))
    with pytest.raises(ValueError, match="another preset"):
        check_resume_compatible(saved, TrainConfig(model_overrides=("model.d_model=8",)))
    with pytest.raises(ValueError, match="cannot change batch_size, lr"):
        check_resume_compatible(saved, TrainConfig(lr=1.0, batch_size=2))


def test_paper_recipe_follows_section_3():
    small = paper_recipe("wt103-47m-switchhead")
    assert (small.lr, small.betas, small.weight_decay) == (2.5e-4, (0.9, 0.999), 0.0)
    assert (small.grad_clip, small.warmup_steps, small.batch_size) == (0.1, 0, 64)
    assert (small.steps, small.cosine_steps, small.amp) == (100_000, 100_000, "fp16")
    big = paper_recipe("c4-262m-switchhead")
    assert (big.grad_clip, big.warmup_steps, big.data) == (0.25, 4000, "c4")
    e8 = paper_recipe("enwik8-41m-switchhead")
    assert (e8.grad_clip, e8.batch_size, e8.data) == (0.25, 32, "enwik8")
    assert paper_recipe("wt103-47m-switchall").grad_clip == 0.25


def test_schedule_is_linear_warmup_then_cosine():
    W, T, lr, floor = 3, 5, 0.2, 0.1
    cfg = TrainConfig(lr=lr, warmup_steps=W, cosine_steps=T, min_lr_ratio=floor, steps=20)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=lr)
    sched = make_scheduler(opt, cfg)
    got = []
    for _ in range(10):
        got.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    expect = [lr * 1 / 3, lr * 2 / 3, lr * 3 / 3]
    for t in range(7):  # cosine over T = 5 updates, then held at the floor
        c = 0.5 * (1 + math.cos(math.pi * min(t, T) / T))
        expect.append(lr * (floor + (1 - floor) * c))
    assert got == pytest.approx(expect, rel=1e-12)
    assert got[3] == pytest.approx(lr) and got[-1] == pytest.approx(lr * floor)


def test_cpu_threads_leave_busy_cores_alone():
    from moeify.train.distributed import cpu_threads_for_load

    assert [cpu_threads_for_load(2, load) for load in (0.0, 0.9, 1.0, 7.5)] == [2, 2, 1, 1]
    assert cpu_threads_for_load(16, 3.2) == 13
