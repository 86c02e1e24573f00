"""Model-level checks shared by the layer families' tests: every block compiled as one graph
(fullgraph) against the eager model, and a few optimizer steps on a fixed batch."""

import copy

import torch


def compiled_blocks_match_eager(cfg, backend="aot_eager"):
    """Build ``cfg`` (seed 0, training mode), compile a copy's blocks with fullgraph=True (a
    graph break raises), run both on one batch of 16 byte tokens with LM + aux loss backward,
    and assert the losses and every gradient equal. Returns (eager, compiled) for further
    checks (their buffers). aot_eager traces forward and backward as inductor does, without
    its code generation (minutes per model on a busy CPU)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = cfg.build().train()
    compiled = copy.deepcopy(eager)
    for block in compiled.blocks:
        block.compile(fullgraph=True, backend=backend)
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    outs = []
    for m in (eager, compiled):
        out = m(ids[:, :-1], ids[:, 1:])
        (out.loss + out.aux_loss).backward()
        outs.append((out, {n: p.grad for n, p in m.named_parameters()}))
    (oe, ge), (oc, gc) = outs
    torch.testing.assert_close(oc.loss, oe.loss, rtol=0, atol=1e-5)
    torch.testing.assert_close(oc.aux_loss, oe.aux_loss, rtol=0, atol=1e-6)
    for name in ge:
        torch.testing.assert_close(gc[name], ge[name], rtol=1e-4, atol=1e-5, msg=name)
    return eager, compiled


def train_steps(cfg, steps=6, lr=3e-3):
    """(model, the last output, the LM losses): ``steps`` AdamW steps of ``cfg`` (seed 0) on
    one fixed batch of 16 byte tokens, minimising the LM loss plus the aux losses."""
    torch.manual_seed(0)
    model = cfg.build().train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(2))
    losses = []
    for _ in range(steps):
        out = model(ids[:, :-1], ids[:, 1:])
        opt.zero_grad()
        out.total_loss.backward()
        opt.step()
        losses.append(out.loss.item())
    return model, out, losses
