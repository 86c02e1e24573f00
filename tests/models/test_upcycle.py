"""Upcycling a trained dense model (moeify.models.upcycle, moeify upcycle): the conversions that
claim to preserve the function reproduce the dense logits; the others stay within a stated loss
bound of the dense model and far below a random initialisation; the result's cost equals the
cost formulas; an upcycled run trains on with `train --resume`, exactly; bad input is a one-line
error and never touches the source run."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch

from moeify.cli.main import main
from moeify.layers.depth import MixtureOfDepths
from moeify.layers.sigma_moe import SigmaMoE
from moeify.layers.switchhead import SwitchHeadAttention
from moeify.models.cost import model_cost
from moeify.models.params import count_module_parameters
from moeify.models.upcycle import Spec, parse_spec, upcycle
from moeify.models.upcycle.feedforward import balanced_clusters
from moeify.train.config import TrainConfig
from moeify.rundir import load_trained
from moeify.train.trainer import train
from references import english_corpus as write_corpus

pytestmark = pytest.mark.usefixtures("single_thread")

# d = 32, 2 layers, 4 heads of 8, d_ff 64, T = 32: trains in a few seconds.
TINY = ("model.d_model=32", "model.n_layers=2", "model.context_length=32",
        "model.feedforward.d_ff=64", "model.attention.d_head=8", "model.attention.n_heads=4")
ROPE = ("model.xl_memory=false", "model.attention.pos=rope")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two tiny dense models trained 60 steps on a small corpus (XL memory, and RoPE without
    memory for depth routing), and a held-out batch of the same language."""
    tmp = tmp_path_factory.mktemp("upcycle")
    mp = pytest.MonkeyPatch()
    mp.setenv("MOEIFY_CACHE_DIR", str(tmp / "cache"))
    corpus = write_corpus(tmp / "corpus.txt", 1500, 0)
    held = write_corpus(tmp / "held.txt", 200, 1).read_text()
    out = {"tmp": tmp, "corpus": corpus}
    for name, extra in (("xl", ()), ("rope", ROPE)):
        cfg = TrainConfig(preset="tiny-dense", data=str(corpus), tokenizer="byte256", steps=60,
                          batch_size=8, warmup_steps=0, lr=3e-3, eval_every=0, eval_tokens=512,
                          eval_batch_size=4, checkpoint_every=0, model_overrides=TINY + extra)
        train(cfg, tmp / name, quiet=True)
        tm = load_trained(tmp / name)
        out[name] = tm.model
        out["batch"] = torch.tensor(tm.tokenizer.encode(held)[:8 * 33]).view(8, 33)
    yield out
    mp.undo()


def loss_of(model, batch) -> float:
    model.eval()
    with torch.no_grad():
        return model(batch[:, :-1], batch[:, 1:]).loss.item()


def logits_of(model, batch) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(batch[:, :-1]).logits


# ------------------------------------------------------------------------- exact conversions

EXACT = [
    ("xl", {"feedforward": "sigma-moe:E=4,router_scale=0"}),
    ("xl", {"feedforward": "sigma-moe:E=8,k=8,split=contiguous,router_scale=0"}),
    ("xl", {"feedforward": "switch:E=4,router_scale=0"}),
    ("xl", {"feedforward": "switch:E=3,k=2,router_scale=0,dropless=true"}),
    ("rope", {"depth": "mod:capacity=1,router_scale=0,blocks=0,1"}),
    ("rope", {"feedforward": "sigma-moe:E=2,router_scale=0", "depth": "mod:capacity=1,"
              "router_scale=0"}),
]


@pytest.mark.parametrize("kind,conversions", EXACT)
def test_exact_conversions_reproduce_the_dense_logits(runs, kind, conversions):
    dense, batch = runs[kind], runs["batch"]
    up = upcycle(dense, **conversions)
    diff = (logits_of(up, batch) - logits_of(dense, batch)).abs().max().item()
    assert diff < 1e-5, f"{conversions}: max |logit difference| {diff:.2e}"
    assert up.config != dense.config  # it really is another model


def test_the_dense_ff_biases_matter_for_exactness(runs):
    """The trained MLP's biases are far from 0: dropping them would not be exact."""
    ff = runs["xl"].blocks[0].feedforward
    assert ff.w1.bias.abs().max() > 1e-2 and ff.w2.bias.abs().max() > 1e-2


# ------------------------------------------------------------------------- approximate ones

# (kind, conversions, bound on loss - dense loss in nats). Measured on this fixture (dense loss
# about 2.07, random init about 6.0): switchhead 0.7-1.05, moa 0.65-0.85, sigma-moe k<E 0.26,
# switch with its default small router < 0.01, noise 0.1 about 0.03, drop-upcycling r=0.5
# about 0.9, MoD capacity 0.5 about 0.38, switchhead + sigma-moe 1.37.
APPROX = [
    ("xl", {"attention": "switchhead:E=2"}, 1.0),
    ("xl", {"attention": "switchhead:E=4,k=2"}, 1.2),
    ("rope", {"attention": "switchhead:E=2,k=1"}, 1.2),
    ("xl", {"attention": "moa:k=4"}, 1.0),
    ("rope", {"attention": "moa:k=2"}, 1.0),
    ("xl", {"feedforward": "sigma-moe:E=4,k=2"}, 0.6),
    ("xl", {"feedforward": "switch:E=4"}, 0.01),
    ("xl", {"feedforward": "switch:E=4,noise=0.1"}, 0.1),
    ("xl", {"feedforward": "switch:E=4,reinit=0.5"}, 1.5),
    ("rope", {"depth": "mod:capacity=0.5"}, 0.8),
    ("xl", {"attention": "switchhead:E=4,k=2", "feedforward": "sigma-moe:E=4,k=2"}, 1.5),
]


@pytest.mark.parametrize("kind,conversions,bound", APPROX)
def test_approximate_conversions_start_near_dense_and_far_below_random(runs, kind, conversions,
                                                                       bound):
    dense, batch = runs[kind], runs["batch"]
    up = upcycle(dense, **conversions)
    torch.manual_seed(0)
    fresh = up.config.build()  # the same MoE model, randomly initialised
    l_dense, l_up, l_rand = loss_of(dense, batch), loss_of(up, batch), loss_of(fresh, batch)
    assert l_up - l_dense < bound, f"{conversions}: {l_up:.3f} vs dense {l_dense:.3f}"
    assert l_up < l_rand - 2.5, f"{conversions}: {l_up:.3f} vs random init {l_rand:.3f}"


def test_router_from_the_keys_beats_a_random_router(runs):
    """sigma-MoE k < E: clustering the units and routing by their mean key keep more of the
    dense function than contiguous slices with a random router."""
    dense, batch = runs["xl"], runs["batch"]
    ours = loss_of(upcycle(dense, feedforward="sigma-moe:E=4,k=2"), batch)
    naive = loss_of(upcycle(dense, feedforward="sigma-moe:E=4,k=2,split=contiguous,"
                                               "router=random"), batch)
    assert ours < naive


def test_switchhead_keeps_the_representative_heads_attention(runs):
    """Kept head h attends exactly as dense head h·E (RoPE: nothing is lost in Q / K)."""
    dense = runs["rope"]
    up = upcycle(dense, attention="switchhead:E=2,k=1")
    x = torch.randn(2, 10, 32)
    p_dense = dense.blocks[0].attention.inspect(x)["probs_BHTS"]
    p_up = up.blocks[0].attention.inspect(x)["probs_BHTS"]
    torch.testing.assert_close(p_up, p_dense[:, ::2], atol=1e-6, rtol=1e-5)


def test_moa_keeps_the_shared_head_exactly(runs):
    """The least-squares fit leaves head kv_head's own projections as they are (the fit of a
    head to itself is the identity), with W_O times the gate compensation E."""
    from moeify.models.upcycle import to_moa

    dense = runs["rope"].blocks[0].attention
    moa = to_moa(dense, k=2, kv_head=2)
    C = dense.config.d_head
    cols = slice(2 * C, 3 * C)
    torch.testing.assert_close(moa.w_q[2], dense.w_q[:, cols], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(moa.w_k, dense.w_k[:, cols])
    torch.testing.assert_close(moa.w_v, dense.w_v[:, cols])
    torch.testing.assert_close(moa.w_o[2], 4 * dense.w_o[cols], atol=1e-5, rtol=1e-4)
    assert not torch.allclose(moa.w_q[0], dense.w_q[:, :C], atol=1e-3)  # the others are fitted


# ------------------------------------------------------------------------- cost

def test_params_and_attention_macs_equal_the_cost_formulas(runs):
    dense = runs["xl"]
    up = upcycle(dense, attention="switchhead:E=2,k=1", feedforward="sigma-moe:E=4,k=2")
    cost = model_cost(up.config)
    assert cost.params == count_module_parameters(up)
    # SwitchHead MACs per layer (moeify.models.cost), written out for d = 32, 2 kept heads (H) of
    # d_h = 8, E = 2 experts, k = 1, V and O as experts, T = 32, XL memory: C = 2.
    d, H, dh, E, k, T, C = 32, 2, 8, 2, 1, 32, 2
    scores_and_values = 2 * H * dh * C * T * T      # Q·Kᵀ and A·V over C·T keys: 65536
    projections = (2 + 2 * k) * d * H * dh * T      # Q, K dense; V, O k experts each: 65536
    expert_mixing = 2 * H * k * T * dh              # gate-weighted sums of V and O: 1024
    selections = 2 * E * d * T * C                  # the V and the O selection: 8192
    xl_positions = 2 * H * d * T * dh               # relative-position projection: 32768
    want = scores_and_values + projections + expert_mixing + selections + xl_positions
    assert want == 173056
    assert [r["macs"] for r in cost.layers] == [want] * 2
    # sigma-MoE with biases: E·D·G keys + E·G·D values + E·D router + E·G + D biases.
    ff = cost.params_by_part["feedforward"]
    assert ff == 2 * (4 * 32 * 16 * 2 + 4 * 32 + 4 * 16 + 32)
    moa = upcycle(dense, attention="moa:k=2")
    assert model_cost(moa.config).params == count_module_parameters(moa)
    # MoA MACs (moeify.models.cost): the dense model's 4 heads become E = 4 experts, H = k = 2
    # selected,
    # one shared K and V projection; the paper's H·k·T·d_h term takes k = 2.
    H, E = 2, 4
    want = (2 * H * dh * C * T * T                  # scores and values: 65536
            + (2 * H + 2) * d * dh * T              # per-head Q and O, shared K and V: 49152
            + H * 2 * T * dh                        # 1024
            + E * d * T                             # the selection over the T queries: 4096
            + 2 * d * T * dh * C)                   # XL position projection: 32768
    assert want == 152576
    assert model_cost(moa.config).layers[0]["macs"] == want
    mod = upcycle(runs["rope"], depth="mod:capacity=0.5")
    assert model_cost(mod.config).params == count_module_parameters(mod)
    assert [r["tokens"] for r in model_cost(mod.config).layers] == [32, 16]


# ------------------------------------------------------------------------- layers and helpers

def test_balanced_clusters_is_a_permutation_of_equal_groups():
    w = torch.randn(24, 5)
    perm = balanced_clusters(w, 4, torch.Generator().manual_seed(0))
    assert sorted(perm.tolist()) == list(range(24))
    # rows aligned with one direction end up together
    w2 = torch.cat([torch.randn(6, 5) * 0.01 + torch.eye(5)[i] * 3 for i in range(4)])
    groups = balanced_clusters(w2, 4, torch.Generator().manual_seed(1)).view(4, 6)
    assert all(len(set((g // 6).tolist())) == 1 for g in groups)


def test_parse_spec():
    assert parse_spec("sigma-moe:E=8,k=2", "--ff") == Spec("sigma-moe", {"E": 8, "k": 2})
    assert parse_spec("mod:blocks=1,3,capacity=0.5", "--depth") == Spec(
        "mod", {"blocks": [1, 3], "capacity": 0.5})
    assert parse_spec("switch:E=4,dropless=false", "--ff").options["dropless"] is False
    assert parse_spec("MoA", "--attention") == Spec("moa", {})
    for bad in ("sigma-moe:,=3", "switch:E=4,E=5", "moa:3", ""):
        with pytest.raises(ValueError):
            parse_spec(bad, "--x")


@pytest.mark.parametrize("kind,conversions,message", [
    ("xl", {"attention": "switchhead:E=3"}, "divide"),
    ("xl", {"feedforward": "sigma-moe:E=5"}, "d_ff=64"),
    ("xl", {"feedforward": "sigma-moe:E=4,bogus=1"}, "unknown option"),
    ("xl", {"attention": "switchhead"}, "give E"),
    ("xl", {"attention": "switchhead:E=2,experts=qv"}, "experts must be"),
    ("xl", {"attention": "moa:k=9"}, "k must lie"),
    ("xl", {"feedforward": "dense-moe:E=4"}, "unknown conversion"),
    ("xl", {"depth": "mod:capacity=0.5"}, "XL memory"),
    ("rope", {"depth": "mod:blocks=7"}, "blocks must be"),
    ("xl", {}, "at least one"),
])
def test_bad_conversions_are_clear_errors(runs, kind, conversions, message):
    with pytest.raises(ValueError, match=message):
        upcycle(runs[kind], **conversions)


def test_an_moe_model_is_refused_as_the_source(runs):
    up = upcycle(runs["xl"], feedforward="switch:E=2")
    with pytest.raises(ValueError, match="not a dense model"):
        upcycle(up, attention="switchhead:E=2")


def _with_feedforward(runs, ff_cfg):
    """The trained XL model with its feedforwards replaced by ``ff_cfg`` layers (random weights,
    non-zero biases), as an imported checkpoint has them."""
    import dataclasses

    torch.manual_seed(5)
    model = dataclasses.replace(runs["xl"].config, feedforward=(ff_cfg,)).build()
    state = {k: v for k, v in runs["xl"].state_dict().items() if ".feedforward." not in k}
    model.load_state_dict(state, strict=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".feedforward." in name and name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("spec", ["switch:E=3,k=2,router_scale=0", "sigma-moe:E=4,router_scale=0"])
def test_an_imported_gelu_mlp_converts_exactly(runs, spec, bias):
    """GPT-2's MLP (gelu_new, biases) as experts of the same activation: the exact conversions
    reproduce the logits (feedforward.py)."""
    from moeify.layers.mlp import MLPConfig

    model = _with_feedforward(runs, MLPConfig(d_model=32, d_ff=64, activation="gelu_tanh",
                                              bias=bias, n_layers=2))
    up = upcycle(model, feedforward=spec)
    ff = up.blocks[0].feedforward
    assert ff.config.activation == "gelu_tanh" and ff.config.bias is bias
    torch.testing.assert_close(logits_of(up, runs["batch"]), logits_of(model, runs["batch"]),
                               atol=1e-5, rtol=1e-5)


def _with_attention(runs, **gqa):
    """The trained RoPE model with its attention replaced by imported-style attention (random
    weights), as a Llama-family checkpoint without grouping has it."""
    import dataclasses

    from moeify.layers.gqa import GroupedQueryAttentionConfig

    torch.manual_seed(6)
    att = GroupedQueryAttentionConfig(**{"d_model": 32, "n_heads": 4, "n_kv_heads": 4,
                                         "d_head": 8, "n_layers": 2, **gqa})
    model = dataclasses.replace(runs["rope"].config, attention=(att,)).build()
    state = {k: v for k, v in runs["rope"].state_dict().items() if ".attention." not in k}
    model.load_state_dict(state, strict=False)
    return model


@pytest.mark.parametrize("pos", ["rope", "absolute"])
def test_imported_multi_head_attention_keeps_the_representative_heads(pos):
    """Kept head h attends as imported head h·E when the dropped biases change no pattern
    (attention.py): a K bias without RoPE (GPT-2); no Q bias; the output bias never does."""
    from moeify.layers.gqa import GroupedQueryAttentionConfig
    from moeify.models.upcycle import to_switchhead

    torch.manual_seed(6)
    att = GroupedQueryAttentionConfig(d_model=32, n_heads=4, n_kv_heads=4, d_head=8, pos=pos,
                                      rope_base=500.0, qkv_bias=True, out_bias=True).build()
    with torch.no_grad():
        att.w_o.bias.normal_()
        if pos == "absolute":
            att.w_k.bias.normal_()
    sh = to_switchhead(att, n_experts=2, k=1)
    assert sh.config.pos == ("rope" if pos == "rope" else "none")
    x = torch.randn(2, 10, 32)
    want = att.inspect(x)["probs_BHTS"][:, ::2]
    torch.testing.assert_close(sh.inspect(x)["probs_BHTS"], want, atol=1e-6, rtol=1e-5)
    with torch.no_grad():  # a Q bias does change the pattern, and is not kept
        att.w_q.bias.normal_()
    assert not torch.allclose(to_switchhead(att, n_experts=2, k=1).inspect(x)["probs_BHTS"],
                              att.inspect(x)["probs_BHTS"][:, ::2], atol=1e-3)


def test_grouped_query_attention_is_refused(runs):
    model = _with_attention(runs, n_kv_heads=2)
    with pytest.raises(ValueError, match=r"grouped-query attention \(2 key/value heads for 4"):
        upcycle(model, attention="switchhead:E=2")
    with pytest.raises(ValueError, match="moa: only dense multi-head attention"):
        upcycle(_with_attention(runs), attention="moa:k=2")


def test_dense_components_the_conversions_do_not_take_are_named(runs):
    """A gated (SwiGLU) MLP cannot become two-matrix experts; the attention still converts."""
    from moeify.layers.mlp import GatedMLPConfig

    model = _with_feedforward(runs, GatedMLPConfig(d_model=32, d_ff=64, n_layers=2))
    with pytest.raises(ValueError, match=r"cannot convert layer 0 feedforward \(GatedMLPConfig\)"
                                         r": a gated \(SwiGLU\) MLP"):
        upcycle(model, feedforward="sigma-moe:E=4")
    up = upcycle(model, attention="switchhead:E=2")
    assert isinstance(up.blocks[0].attention, SwitchHeadAttention)
    assert type(up.blocks[0].feedforward) is type(model.blocks[0].feedforward)


def test_the_source_model_is_left_unchanged(runs):
    dense = runs["xl"]
    before = {k: v.clone() for k, v in dense.state_dict().items()}
    up = upcycle(dense, attention="switchhead:E=2", feedforward="switch:E=2,noise=0.5")
    with torch.no_grad():
        for p in up.parameters():
            p.add_(1.0)
    for k, v in dense.state_dict().items():
        assert torch.equal(v, before[k]), k


# ------------------------------------------------------------------------- the CLI and runs

def tree_hash(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def cli_run(runs):
    """A tiny RoPE dense run trained through the CLI, for the CLI tests."""
    tmp = runs["tmp"]
    run = tmp / "cli-dense"
    assert main(["train", "--preset", "tiny-dense", "--data", str(runs["corpus"]), "--steps",
                 "8", "--out", str(run), "--quiet", "--set", "tokenizer=byte256",
                 "--set", "batch_size=4", "--set", "warmup_steps=0", "--set", "lr=3e-3",
                 "--set", "eval_tokens=512", "--set", "eval_batch_size=2",
                 *[a for o in TINY + ROPE for a in ("--set", o)]]) == 0
    return run


def test_upcycled_run_is_a_normal_run(runs, cli_run, capsys):
    out = runs["tmp"] / "cli-up"
    before = tree_hash(cli_run)
    assert main(["upcycle", "--run", str(cli_run), "--out", str(out),
                 "--attention", "switchhead:E=2,k=1", "--ff", "sigma-moe:E=4,k=2",
                 "--depth", "mod:capacity=0.5", "--steps", "6", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert tree_hash(cli_run) == before
    assert summary["source_step"] == 8 and summary["exact"] is False
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000000"
    assert (out / "tokenizer.json").read_text() == (cli_run / "tokenizer.json").read_text()
    ckpt = torch.load(out / "checkpoints" / "step-00000000" / "state.pt", weights_only=True)
    assert ckpt["step"] == 0 and ckpt["optimizer"]["state"] == {}  # fresh optimizer
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["kind"] == "valid" and records[0]["step"] == 0
    assert records[0]["loss"] == pytest.approx(summary["valid"]["loss"])

    tm = load_trained(out)
    assert isinstance(tm.model.blocks[1], MixtureOfDepths)
    assert isinstance(tm.model.blocks[0].attention, SwitchHeadAttention)
    assert isinstance(tm.model.blocks[0].feedforward, SigmaMoE)

    assert main(["count", "--config", str(out / "model.json"), "--json"]) == 0
    counted = json.loads(capsys.readouterr().out)
    assert counted["params"] == count_module_parameters(tm.model) == summary["params"]
    assert main(["eval", "--run", str(out), "--task", "ppl", "--split", "valid", "--limit",
                 "256", "--batch-size", "2", "--json"]) == 0
    assert math.isfinite(json.loads(capsys.readouterr().out)["loss"])
    assert main(["generate", "--run", str(out), "--prompt", "the cat", "--max-new-tokens", "8",
                 "--seed", "1"]) == 0
    assert capsys.readouterr().out.startswith("the cat")


def test_train_resume_of_an_upcycled_run_learns_and_is_exact(runs, cli_run, capsys):
    tmp = runs["tmp"]
    conv = ["--attention", "switchhead:E=2", "--ff", "switch:E=2,dropless=false"]
    for name in ("straight", "split"):
        assert main(["upcycle", "--run", str(cli_run), "--out", str(tmp / name), "--steps", "12",
                     "--set", "eval_every=0", "--set", "log_every=1",
                     "--set", "checkpoint_every=5", *conv]) == 0
    assert main(["train", "--resume", str(tmp / "straight"), "--quiet"]) == 0
    from moeify.train.config import read_train_config

    # interrupted after step 5 (same schedule: steps stays 12), then resumed
    train(read_train_config(tmp / "split"), tmp / "split", resume=True, stop_after=5, quiet=True)
    assert (tmp / "split" / "checkpoints" / "latest").read_text().strip() == "step-00000005"
    assert main(["train", "--resume", str(tmp / "split"), "--quiet"]) == 0
    capsys.readouterr()

    def metrics(name):
        return [json.loads(x) for x in (tmp / name / "metrics.jsonl").read_text().splitlines()]

    straight, split = metrics("straight"), metrics("split")
    valid = [r["loss"] for r in straight if r["kind"] == "valid"]
    assert valid[-1] < valid[0]  # step 0 (right after conversion) -> step 12
    train_losses = lambda rs: [(r["step"], r["loss"]) for r in rs if r["kind"] == "train"]
    assert train_losses(split) == train_losses(straight)
    a = load_trained(tmp / "straight").model.state_dict()
    b = load_trained(tmp / "split").model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_first_step_of_an_upcycled_run_is_a_fresh_runs_first_step(runs, cli_run):
    """The step-0 checkpoint carries a fresh run's state: resuming it gives the losses of a run
    that trains the same model from the same weights without any checkpoint in between."""
    from moeify.train.config import TrainConfig as TC
    from moeify.train.config import read_train_config
    from moeify.train.trainer import Trainer

    tmp = runs["tmp"]
    out = tmp / "first"
    assert main(["upcycle", "--run", str(cli_run), "--out", str(out), "--steps", "3",
                 "--no-validate", "--set", "log_every=1", "--ff", "sigma-moe:E=4,k=2"]) == 0
    start = load_trained(out).model.state_dict()
    assert main(["train", "--resume", str(out), "--quiet"]) == 0
    resumed = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()
               if json.loads(x)["kind"] == "train"]
    cfg = read_train_config(out)
    fresh = Trainer(TC.from_dict(cfg.to_dict()), tmp / "fresh", quiet=True,
                    tokenizer=load_trained(cli_run).tokenizer)
    try:
        fresh.model.load_state_dict(start)
        losses = [fresh.train_step()["loss"] for _ in range(3)]
    finally:
        fresh.close()
    assert len(resumed) == 3 and resumed == pytest.approx(losses, rel=0, abs=0)


@pytest.mark.parametrize("args,message", [
    (["--attention", "switchhead:E=3"], "E=3 does not divide"),
    (["--ff", "sigma-moe:E=4,colour=red"], "unknown option"),
    (["--ff", "sigma-moe:E=5"], "does not split"),
    (["--depth", "mod:capacity=2"], "capacity"),
    ([], "at least one conversion"),
])
def test_cli_bad_input_exits_2_with_one_line_and_leaves_the_source(runs, cli_run, capsys, args,
                                                                   message):
    before = tree_hash(cli_run)
    out = runs["tmp"] / "bad-out"
    assert main(["upcycle", "--run", str(cli_run), "--out", str(out), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert tree_hash(cli_run) == before
    assert not (out / "checkpoints").exists()


def test_cli_refuses_an_moe_run_and_an_occupied_out(runs, cli_run, capsys):
    tmp = runs["tmp"]
    moe = tmp / "moe-source"
    assert main(["upcycle", "--run", str(cli_run), "--out", str(moe), "--no-validate",
                 "--ff", "switch:E=2"]) == 0
    capsys.readouterr()
    before = tree_hash(moe)
    assert main(["upcycle", "--run", str(moe), "--out", str(tmp / "moe2"), "--attention",
                 "switchhead:E=2"]) == 2
    assert "not a dense model" in capsys.readouterr().err
    assert tree_hash(moe) == before
    assert main(["upcycle", "--run", str(cli_run), "--out", str(moe), "--ff",
                 "switch:E=2"]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["upcycle", "--run", str(cli_run), "--out", str(cli_run), "--ff",
                 "switch:E=2"]) == 2
    assert "source" in capsys.readouterr().err
