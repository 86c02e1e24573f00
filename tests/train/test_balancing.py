"""Loss-free balancing and the global-batch balance loss, against hand computations: with
gradient accumulation and two gloo processes, the bias follows the paper's update once per
optimizer step from the counts of every micro-batch and process, and the global-batch loss uses
the counts summed over processes and the update's micro-batches so far. Under activation
checkpointing (every block's forward runs again in backward) both hold unchanged."""

import gc

import pytest

import torch
import torch.multiprocessing as mp

from moeify.ops.aux_losses import global_balance_loss, loss_free_bias_update, switch_balance_loss
from moeify.ops.routing import sigmoid_topk, softmax_topk
from moeify.train.config import TrainConfig
from moeify.train.trainer import Trainer

TINY = ("model.d_model=32", "model.n_layers=2", "model.context_length=16")
RATE = 0.01


def test_bias_update_is_the_papers_and_centring_is_an_option():
    b = torch.tensor([0.0, 0.5, -0.5, 0.0])
    c = torch.tensor([4, 1, 3, 0])  # mean 2: experts 0 and 2 overloaded, 1 and 3 underloaded
    torch.testing.assert_close(loss_free_bias_update(b, c, 0.1),
                               torch.tensor([-0.1, 0.6, -0.6, 0.1]))
    even = loss_free_bias_update(b, torch.tensor([2, 2, 2, 2]), 0.1)  # sign(0) = 0
    torch.testing.assert_close(even, b)
    centred = loss_free_bias_update(b + 1.0, c, 0.1, centre=True)
    torch.testing.assert_close(centred, torch.tensor([-0.1, 0.6, -0.6, 0.1]))


def test_bias_moves_the_choice_not_the_gates():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    bias = torch.tensor([0.0, 0.0, 10.0])
    for fn in (sigmoid_topk, softmax_topk):
        plain, biased = fn(logits, 1), fn(logits, 1, bias=bias)
        assert plain.idx.item() == 0 and biased.idx.item() == 2
        torch.testing.assert_close(biased.gates, plain.scores[:, 2:])  # unbiased score


def test_global_balance_loss_with_the_batch_counts_is_the_switch_loss():
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(10, 4, generator=g), -1)
    top1 = probs.argmax(-1)
    valid = torch.rand(10, generator=g) > 0.3
    counts = torch.bincount(top1[valid], minlength=4)
    torch.testing.assert_close(global_balance_loss(probs, counts, valid),
                               switch_balance_loss(probs, top1, valid))


def _cfg(corpus, ff: str, extra=()):
    return TrainConfig(preset=f"tiny-{ff}", data=str(corpus), tokenizer="byte256", steps=3,
                       batch_size=4, grad_accum=2, warmup_steps=1, lr=3e-3, log_every=1,
                       eval_every=0, checkpoint_every=0, model_overrides=TINY + tuple(extra))


def _capture(trainer):
    """Every forward of each feedforward layer (its input, router weights and bias then), and
    the aux losses the trainer trained on after each micro-batch's forward."""
    seen, trained = [], []
    for i, block in enumerate(trainer.model.layer_blocks()):
        ff = block.feedforward

        def hook(mod, args, out, i=i):
            bias = getattr(mod, "expert_bias", torch.zeros(()))
            seen.append({"layer": i, "x": args[0].detach().clone(),
                         "w": mod.w_router.detach().clone(), "bias": bias.clone()})
        ff.register_forward_hook(hook)
    after_forward = trainer.balancing.after_forward

    def record(out):
        aux = after_forward(out)
        trained.append({k: v.detach().clone() for k, v in out.losses.items()})
        return aux
    trainer.balancing.after_forward = record
    return seen, trained


def _worker(rank, world, init_file, cfg_dict, run_dir, out_file):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        tr = Trainer(TrainConfig.from_dict(cfg_dict), run_dir, quiet=True)
        seen, trained = _capture(tr)
        steps = []
        for _ in range(3):
            n, t = len(seen), len(trained)
            tr.train_step()
            steps.append({"forwards": seen[n:], "trained": trained[t:],
                          "bias": [b.feedforward.expert_bias.clone()
                                   for b in tr.model.layer_blocks()]})
        tr.close()
        torch.save(steps, f"{out_file}.{rank}")
    finally:
        dist.destroy_process_group()


def test_two_processes_with_accumulation_follow_the_hand_computation(setup):
    """Switch with loss-free balancing and the global-batch loss, 2 processes x 2 micro-batches,
    3 updates: the bias after each update and every micro-batch's balance loss, recomputed by
    hand from the layer inputs each forward saw."""
    tmp, corpus = setup
    cfg = _cfg(corpus, "switch", (f"model.feedforward.lossfree_rate={RATE}",
                                  "model.feedforward.balance_scope=global",
                                  "model.feedforward.balance_coef=0.01"))
    out = tmp / "steps"
    gc.collect()
    mp.start_processes(_worker, args=(2, str(tmp / "pg"), cfg.to_dict(), str(tmp / "run"),
                                      str(out)), nprocs=2, join=True, start_method="fork")
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    E = ranks[0][0]["bias"][0].numel()
    expected = [torch.zeros(E), torch.zeros(E)]  # per layer
    moved = False
    for s in range(3):
        counts = [torch.zeros(E, dtype=torch.int64) for _ in range(2)]
        top1_so_far = [torch.zeros(E) for _ in range(2)]
        by_mb = {}
        for r in range(2):
            fw = ranks[r][s]["forwards"]
            assert len(fw) == 4  # 2 micro-batches x 2 layers
            for j, f in enumerate(fw):
                loss = ranks[r][s]["trained"][j // 2][f"layers.{f['layer']}.ff.balance"]
                by_mb.setdefault((j // 2, f["layer"]), []).append({**f, "balance": loss})
        for (mb, layer), fs in sorted(by_mb.items()):
            probs = []
            for f in fs:
                # The bias a forward saw is the one after the previous update: once per step.
                torch.testing.assert_close(f["bias"], expected[layer], rtol=0, atol=1e-7)
                x = f["x"].reshape(-1, f["x"].shape[-1])
                p = torch.softmax(x @ f["w"].t(), -1)
                idx = torch.sort(p + f["bias"], dim=-1, descending=True, stable=True).indices[:, :1]
                counts[layer] += torch.bincount(idx.reshape(-1), minlength=E)
                top1_so_far[layer] += torch.bincount(idx[:, 0], minlength=E)
                probs.append(p)
            for f, p in zip(fs, probs):  # this micro-batch's loss: counts of all processes
                want = 0.01 * E * ((top1_so_far[layer] / top1_so_far[layer].sum())
                                   * p.mean(0)).sum()
                torch.testing.assert_close(f["balance"], want, rtol=1e-5, atol=1e-7)
        for layer in range(2):
            c = counts[layer].double()
            expected[layer] = expected[layer] + RATE * torch.sign(c.mean() - c).float()
            moved |= bool((expected[layer] != 0).any())
            for r in range(2):
                torch.testing.assert_close(ranks[r][s]["bias"][layer], expected[layer],
                                           rtol=0, atol=1e-7)
    assert moved


def _steps(corpus, tmp, name, extra, *, ac: bool, steps: int = 2, grad_accum: int = 2):
    """``steps`` updates of a tiny run, plain or with every block checkpointed: per step the
    logged loads, the losses trained on after each micro-batch, the feedforwards' biases; and
    every feedforward forward (recomputations included), the usage counters at the end."""
    cfg = _cfg(corpus, name, extra)
    cfg = TrainConfig.from_dict({**cfg.to_dict(), "grad_accum": grad_accum,
                                 "batch_size": 2 * grad_accum,
                                 "activation_checkpointing": "block" if ac else "none"})
    tr = Trainer(cfg, tmp / f"{name}-{ac}", quiet=True)
    seen, trained = _capture(tr)
    recs = []
    # Without early stop the recomputation runs every layer's forward to its end.
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        for _ in range(steps):
            t = len(trained)
            rec = tr.train_step()
            recs.append({"load": rec["load"], "trained": trained[t:],
                         "bias": [getattr(b.feedforward, "expert_bias", None)
                                  for b in tr.model.blocks]})
    usage = [b.feedforward.usage.clone() for b in tr.model.blocks]
    tr.close()
    return recs, seen, usage


def _assert_same_steps(plain, ac):
    for p, a in zip(plain, ac):
        assert p["load"].keys() == a["load"].keys() and p["load"]
        for k in p["load"]:
            torch.testing.assert_close(a["load"][k], p["load"][k])
        for tp, ta in zip(p["trained"], a["trained"], strict=True):
            assert tp.keys() == ta.keys()
            for k in tp:
                torch.testing.assert_close(ta[k], tp[k], rtol=1e-5, atol=1e-7)
        for bp, ba in zip(p["bias"], a["bias"]):
            if bp is not None:
                torch.testing.assert_close(ba, bp)


def test_recomputed_activations_do_not_double_the_counts(env):
    """sigma-MoE with loss-free balancing, once plain and once with activation_checkpointing=
    block: the same logged loads, losses and biases, and the same usage counters, although every
    feedforward forward really ran twice."""
    tmp, corpus = env
    extra = (f"model.feedforward.lossfree_rate={RATE}", "model.feedforward.expert_size=16")
    plain, seen_p, usage_p = _steps(corpus, tmp, "sigmamoe", extra, ac=False)
    ac, seen_a, usage_a = _steps(corpus, tmp, "sigmamoe", extra, ac=True)
    assert len(seen_a) == 2 * len(seen_p)  # the recomputation ran
    _assert_same_steps(plain, ac)
    assert any((b != 0).any() for b in plain[-1]["bias"] if b is not None)
    for up, ua in zip(usage_p, usage_a):
        torch.testing.assert_close(ua, up)


def test_global_batch_loss_under_recomputation_counts_each_micro_batch_once(env):
    """Switch with the global-batch loss, 3 micro-batches, plain and checkpointed: micro-batch j
    trains on coef · E · Σ_i f_i · P_i with f_i the top-1 counts of micro-batches 1..j and P_i
    its own mean probabilities, recomputed here from the inputs each layer saw; the same under
    recomputation (where a recomputed forward once counted its micro-batch twice)."""
    tmp, corpus = env
    extra = ("model.feedforward.balance_scope=global", "model.feedforward.balance_coef=0.01")
    plain, seen, _ = _steps(corpus, tmp, "switch", extra, ac=False, steps=1, grad_accum=3)
    ac, seen_a, _ = _steps(corpus, tmp, "switch", extra, ac=True, steps=1, grad_accum=3)
    assert len(seen_a) == 2 * len(seen)
    _assert_same_steps(plain, ac)
    E = seen[0]["w"].shape[0]
    so_far = [torch.zeros(E), torch.zeros(E)]
    for j, f in enumerate(seen):  # micro-batch j // 2, layer f["layer"]
        x = f["x"].reshape(-1, f["x"].shape[-1])
        p = torch.softmax(x @ f["w"].t(), -1)
        so_far[f["layer"]] += torch.bincount(p.argmax(-1), minlength=E)
        c = so_far[f["layer"]]
        want = 0.01 * E * ((c / c.sum()) * p.mean(0)).sum()
        got = plain[0]["trained"][j // 2][f"layers.{f['layer']}.ff.balance"]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_batch_balance_loss_under_recomputation_is_the_micro_batchs(env):
    """Switch with the per-batch loss, plain and checkpointed: each micro-batch trains on its
    own Switch loss (hand-computed) and the two runs agree."""
    tmp, corpus = env
    plain, seen, _ = _steps(corpus, tmp, "switch", ("model.feedforward.balance_coef=0.01",),
                            ac=False, steps=1)
    ac, _, _ = _steps(corpus, tmp, "switch", ("model.feedforward.balance_coef=0.01",), ac=True,
                      steps=1)
    _assert_same_steps(plain, ac)
    for j, f in enumerate(seen):
        x = f["x"].reshape(-1, f["x"].shape[-1])
        p = torch.softmax(x @ f["w"].t(), -1)
        E = p.shape[-1]
        frac = torch.bincount(p.argmax(-1), minlength=E) / p.shape[0]
        want = 0.01 * E * (frac * p.mean(0)).sum()
        got = plain[0]["trained"][j // 2][f"layers.{f['layer']}.ff.balance"]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_remoe_coefficient_follows_the_update_sparsity(setup):
    """ReMoE (arXiv 2412.14711 Sec. 3): 3 updates of 2 micro-batches through the trainer; after
    each update lambda moves by alpha toward 1 - k/E from the sparsity of every forward of the
    update (both layers, both micro-batches), counted from the layer's own routing outputs."""
    from references import ref_remoe_coef_update

    tmp, corpus = setup
    cfg = TrainConfig(preset="repro-remoe", data=str(corpus), tokenizer="byte256", steps=3,
                      batch_size=4, grad_accum=2, warmup_steps=1, lr=3e-3, log_every=1,
                      eval_every=0, checkpoint_every=0,
                      model_overrides=TINY + ("model.feedforward.init_std=0.2",))
    tr = Trainer(cfg, tmp / "run", quiet=True)
    seen = []
    for block in tr.model.layer_blocks():
        block.feedforward.register_forward_hook(
            lambda mod, args, out: seen.append(
                (mod.route(args[0].reshape(-1, args[0].shape[-1]).detach()) > 0).double()))
    lam, c = 1e-8, tr.model.layer_blocks()[0].feedforward.config
    for _ in range(3):
        n = len(seen)
        out = tr.train_step()
        assert len(seen) - n == 4 and torch.isfinite(torch.as_tensor(out["loss"]))
        active = torch.cat(seen[n:])
        lam = ref_remoe_coef_update(lam, 1 - active.mean().item(), c.k, c.n_experts,
                                    c.l1_multiplier)
        for block in tr.model.layer_blocks():
            assert block.feedforward.l1_coef.item() == pytest.approx(lam, rel=1e-5)
    tr.close()


def test_token_choice_recursion_depth_bias_follows_the_update_counts():
    """Mixture-of-Recursions token-choice with loss-free balancing (the authors' "loss_free"):
    over an update of two micro-batches the bias moves by rate · sign(mean c - c), c the tokens
    that chose each depth, recomputed here from the input the recursion module saw; the next
    update chooses with the new bias."""
    from moeify.models.presets import get_preset
    from moeify.train.balancing import Balancing
    from moeify.train.distributed import DistEnv
    from moeify.train.overrides import apply_model_overrides

    cfg = apply_model_overrides(get_preset("repro-mor-token"), (
        "model.d_model=32", "model.context_length=16", "model.attention.n_heads=2",
        "model.feedforward.d_ff=64", f"model.recursion.lossfree_rate={RATE}",
        "model.recursion.balance_coef=0"))
    torch.manual_seed(0)
    model = cfg.build().train()
    mor = model.blocks[1]
    with torch.no_grad():
        mor.w_router.normal_(0.0, 0.5)
    seen = []
    mor.register_forward_hook(lambda m, args, out: seen.append(args[0].detach()))
    balancing = Balancing(model, DistEnv())
    bias = torch.zeros(2)
    for step in range(2):
        balancing.start_step()
        counts = torch.zeros(2)
        for micro in range(2):
            ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(
                10 * step + micro))
            out = model(ids)
            balancing.after_forward(out)
            probs = torch.softmax(seen[-1].double() @ mor.w_router.detach().double().t(), -1)
            depth = (probs + bias.double()).argmax(-1)
            counts += torch.bincount(depth.flatten(), minlength=2)
        load = balancing.after_optimizer_step()
        assert torch.equal(load["layers.1.mor"], counts.double())
        bias = bias + RATE * torch.sign(counts.mean() - counts)
        torch.testing.assert_close(mor.expert_bias, bias)
    assert mor.expert_bias.abs().sum() > 0
