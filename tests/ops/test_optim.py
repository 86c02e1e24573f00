"""The trainer's AdamW (moeify.ops.optim): the fused kernel against torch's default over several
steps, with weight decay on some groups, and the choice of implementation."""

import pytest
import torch

from moeify.ops.optim import adamw, fused_supported


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g, dtype=dtype))
            for s in ((7, 5), (5,), (3, 4, 2))]


def _train(impl, dtype, steps=4):
    ps = _params(dtype)
    opt = adamw([{"params": [ps[0], ps[2]], "weight_decay": 0.1},
                 {"params": [ps[1]], "weight_decay": 0.0}], lr=1e-2, betas=(0.9, 0.98),
                impl=impl)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g, dtype=dtype)
        opt.step()
    return ps, opt


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_fused_equals_torchs_default_over_several_steps(dtype, tol):
    fused, opt_f = _train("auto", dtype)
    ref, opt_r = _train("default", dtype)
    assert opt_f.defaults["fused"] and not opt_r.defaults["fused"]
    for a, r, p0 in zip(fused, ref, _params(dtype)):
        torch.testing.assert_close(a, r, rtol=tol, atol=tol)
        assert not torch.equal(a, p0)  # the parameters moved
    for a, r in zip(opt_f.state.values(), opt_r.state.values()):
        torch.testing.assert_close(a["exp_avg_sq"], r["exp_avg_sq"], rtol=tol, atol=tol)


def test_fused_only_where_torch_has_the_kernel():
    assert fused_supported(_params(torch.float32))
    assert not fused_supported([torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))])
    opt = adamw([torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))], lr=1e-3,
                betas=(0.9, 0.999))
    assert not opt.defaults["fused"]
    with pytest.raises(ValueError, match="impl"):
        adamw(_params(torch.float32), lr=1e-3, betas=(0.9, 0.999), impl="foreach")
