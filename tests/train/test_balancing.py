"""Loss-free balancing and the global-batch balance loss, against hand computations: with
gradient accumulation and two gloo processes, the bias follows the paper's update once per
optimizer step from the counts of every micro-batch and process, and the global-batch loss uses
the counts summed over processes and the update's micro-batches so far."""

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
    """Every forward of each feedforward layer: its input, router weights and bias then, and
    the aux losses it returned."""
    seen = []
    for i, block in enumerate(trainer.model.layer_blocks()):
        ff = block.feedforward

        def hook(mod, args, out, i=i):
            w = mod.w_router
            seen.append({"layer": i, "x": args[0].detach().clone(), "w": w.detach().clone(),
                         "bias": mod.expert_bias.clone(),
                         "losses": {k: v.detach().clone() for k, v in out[1].losses.items()}})
        ff.register_forward_hook(hook)
    return seen


def _worker(rank, world, init_file, cfg_dict, run_dir, out_file):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        tr = Trainer(TrainConfig.from_dict(cfg_dict), run_dir, quiet=True)
        seen = _capture(tr)
        steps = []
        for _ in range(3):
            n = len(seen)
            tr.train_step()
            steps.append({"forwards": seen[n:],
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
                by_mb.setdefault((j // 2, f["layer"]), []).append(f)
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
                torch.testing.assert_close(f["losses"]["balance"], want, rtol=1e-5, atol=1e-7)
        for layer in range(2):
            c = counts[layer].double()
            expected[layer] = expected[layer] + RATE * torch.sign(c.mean() - c).float()
            moved |= bool((expected[layer] != 0).any())
            for r in range(2):
                torch.testing.assert_close(ranks[r][s]["bias"][layer], expected[layer],
                                           rtol=0, atol=1e-7)
    assert moved


def test_recomputed_activations_do_not_double_the_counts(env):
    """sigma-MoE with loss-free balancing, once plain and once with every block under
    activation checkpointing (its forward runs again in backward): the same logged loads and
    biases, although the layer's own running usage buffer does count the recomputation."""
    import torch.utils.checkpoint as tuc

    tmp, corpus = env
    cfg = _cfg(corpus, "sigmamoe", (f"model.feedforward.lossfree_rate={RATE}",
                                    "model.feedforward.expert_size=16"))
    results = []
    for name, recompute in (("plain", False), ("ac", True)):
        tr = Trainer(cfg, tmp / name, quiet=True)
        if recompute:
            for block in tr.model.blocks:
                orig = block.forward
                block.forward = (lambda *a, _f=orig, **k:
                                 tuc.checkpoint(_f, *a, use_reentrant=False, **k))
        # Without early stop the recomputation runs every layer's forward to its end.
        with tuc.set_checkpoint_early_stop(False):
            recs = [tr.train_step() for _ in range(2)]
        results.append(([r["load"] for r in recs],
                        [b.feedforward.expert_bias.clone() for b in tr.model.blocks],
                        tr.model.blocks[0].feedforward.usage.clone()))
        tr.close()
    (load_p, bias_p, usage_p), (load_a, bias_a, usage_a) = results
    for lp, la in zip(load_p, load_a):
        assert lp.keys() == la.keys() and lp
        for k in lp:
            torch.testing.assert_close(la[k], lp[k])
    for bp, ba in zip(bias_p, bias_a):
        torch.testing.assert_close(ba, bp)
    assert (bias_p[0] != 0).any()
    # The recomputation really ran: the layer's own buffer counted every token twice.
    torch.testing.assert_close(usage_a, 2 * usage_p)


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
