"""Every MoE family with every expert-matmul implementation forced, in float32 and in bf16
autocast under CUDA's autocast policy (amp_policy.cuda_autocast_policy): a training step runs,
and the implementations agree.

This is the matrix a GPU run met first: SwitchHead, MoA and SwitchAll could not train in bf16 on
CUDA with "segment", "grouped" or "auto" (their Functions returned float32 under CUDA's policy
and failed in the backward), while the CPU suite, under CPU autocast's policy, never saw it.

float32: the loss and every gradient of each implementation equal those of "reference" (one
dense matmul over all experts, the implementation that needs nothing but matmul and indexing).
bf16: finite, close to float32, and one optimizer step later still finite.
"""

import pytest
import torch

from amp_policy import cuda_autocast_policy
from impl_matrix import every_impl_cases, every_impl_model


def _ids(cfg):
    return torch.randint(0, cfg.vocab_size, (2, cfg.context_length + 1),
                         generator=torch.Generator().manual_seed(1))


def _step(model, ids, amp):
    model.zero_grad(set_to_none=True)
    with cuda_autocast_policy(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        out = model(ids[:, :-1], ids[:, 1:])
    (out.loss + out.aux_loss).backward()
    return out.loss.detach().double(), {n: p.grad.double() for n, p in model.named_parameters()
                                        if p.grad is not None}


_REFERENCE = {}


def _reference(preset):
    if preset not in _REFERENCE:
        cfg, model = every_impl_model(preset, "reference")
        _REFERENCE[preset] = _step(model, _ids(cfg), amp=False)
    return _REFERENCE[preset]


@pytest.mark.parametrize("preset,impl", list(every_impl_cases()))
def test_a_training_step_in_fp32_and_bf16(preset, impl):
    cfg, model = every_impl_model(preset, impl)
    ids = _ids(cfg)
    loss, grads = _step(model, ids, amp=False)
    want_loss, want_grads = _reference(preset)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    assert grads.keys() == want_grads.keys()
    for name, g in grads.items():
        scale = want_grads[name].abs().max().clamp_min(1e-6)
        assert (g - want_grads[name]).abs().max() / scale < 1e-4, name

    loss_b, grads_b = _step(model, ids, amp=True)
    assert torch.isfinite(loss_b) and all(torch.isfinite(g).all() for g in grads_b.values())
    assert abs(float(loss_b - loss)) < 0.03 * float(loss)
    assert grads_b.keys() == grads.keys()
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    loss_2, _ = _step(model, ids, amp=True)
    assert torch.isfinite(loss_2)
