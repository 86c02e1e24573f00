"""MoSA and MoEUT CPU-scale presets: compute / parameter matching against their dense RoPE
baseline, and MoSA's cost accounting (O(k² + T) per sparse head)."""

import pytest

from moeify.layers.mosa import MoSAConfig
from moeify.models.cost import attention_cost, model_cost, mosa_cost
from moeify.models.params import model_parameters
from moeify.models.presets import get_preset


def test_mosa_presets_match_the_dense_rope_attention_macs_exactly():
    dense = model_cost(get_preset("repro-rope-dense"))
    for name in ("tiny-mosa", "repro-mosa"):
        mosa = model_cost(get_preset(name))
        assert [r["macs"] for r in mosa.layers] == [r["macs"] for r in dense.layers] \
            == [12_582_912] * 4, name
        assert mosa.layers[0]["attention"].startswith("MoSA H=32 d_h=32 rho=8 +1 dense")


def test_repro_mosa_paper_is_the_papers_hybrid_flop_matched_by_its_rule():
    """4 dense heads kept, MoSA heads of the same width filling the dense model's attention
    FLOPs (App. A, per layer, h = 128, h' = 16, T = 128, k = 16): 8 dense heads cost
    8 * (8*128*16*128 + 4*16*128**2) = 25,165,824; 4 keep 12,582,912; a MoSA head costs
    8*128*16*16 + 4*16*16**2 + 2*128*128 + 16*16 = 311,552; 12,582,912 // 311,552 = 40."""
    cfg = get_preset("repro-mosa-paper")
    attn = cfg.attention_layers()[0]
    assert (attn.n_heads, attn.n_dense_heads, attn.d_head, attn.sparsity, attn.include_first) \
        == (40, 4, 16, 8, True)
    assert 40 * 311_552 <= 12_582_912 < 41 * 311_552


def test_mosa_cost_terms():
    # per sparse head: router d·T, projections 4·d·h'·k, attention 2·h'·k²
    c = mosa_cost(d_model=16, n_heads=3, d_head=4, k=5, T=20)
    assert c.macs == 3 * (16 * 20 + 4 * 16 * 4 * 5 + 2 * 4 * 25)
    assert c.memory == 3 * (2 * 25 + 4 * 4 * 5 + 20)
    cfg = MoSAConfig(d_model=16, n_heads=3, d_head=4, sparsity=4)
    assert attention_cost(cfg, T=20, C=1) == c  # k = 20 // 4


def test_repro_moeut_is_parameter_matched_to_its_dense_baseline():
    dense = model_parameters(get_preset("repro-rope-dense"))["total"]
    moeut = model_parameters(get_preset("repro-moeut"))["total"]
    assert abs(moeut - dense) <= 0.01 * dense, (moeut, dense)


def test_tiny_mosa_lm_decoding_is_prefix_routing_in_every_layer():
    # moeify.layers.mosa: each MoSA layer's output at t is its full forward on its own inputs
    # up to t (tests/layers/test_mosa.py). Stacked, the model's decoding is the causal model in
    # which every layer routes each position on its prefix, however the tokens are chunked;
    # the first position and a one-layer model agree with the teacher-forced full forward.
    import dataclasses

    import torch

    torch.manual_seed(0)
    m = get_preset("tiny-mosa").build().double().eval()
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = m.new_cache()
        got = torch.cat([m(ids[:, :12], cache=cache).logits]
                        + [m(ids[:, t:t + 1], cache=cache).logits for t in range(12, 20)], 1)
        torch.testing.assert_close(got, m(ids, cache=m.new_cache()).logits, rtol=1e-12,
                                   atol=1e-12)
        torch.testing.assert_close(got[:, 0], m(ids[:, :1]).logits[:, 0])
        cfg = get_preset("tiny-mosa")
        one = dataclasses.replace(cfg, n_layers=1, attention=dataclasses.replace(
            cfg.attention[0], n_layers=1), feedforward=dataclasses.replace(
            cfg.feedforward[0], n_layers=1)).build().double().eval()
        cache = one.new_cache()
        got = torch.cat([one(ids[:, t:t + 1], cache=cache).logits for t in range(20)], 1)
        want = torch.stack([one(ids[:, :t + 1]).logits[:, t] for t in range(20)], 1)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def test_upcycling_and_hf_export_say_where_they_do_not_apply():
    import pytest

    from moeify.errors import MoeifyError
    from moeify.interop.hf_export import hf_config
    from moeify.models.upcycle import check_dense

    for name in ("tiny-moeut", "tiny-mosa"):
        with pytest.raises(ValueError, match="not a dense model|shared-layer"):
            check_dense(get_preset(name))
    import dataclasses
    shared_dense = dataclasses.replace(get_preset("repro-rope-dense"), group_size=2)
    with pytest.raises(ValueError, match="shared-layer"):
        check_dense(shared_dense)
    with pytest.raises(MoeifyError, match="MoSA"):
        hf_config(get_preset("tiny-mosa"), None)
    assert hf_config(get_preset("tiny-moeut"), None)["num_hidden_layers"] == 4


def test_moeut_and_mosa_train_under_bf16_autocast():
    import dataclasses

    import torch

    for cfg in (get_preset("tiny-moeut"), get_preset("tiny-mosa"),
                dataclasses.replace(get_preset("tiny-mosa"), attention=dataclasses.replace(
                    get_preset("tiny-mosa").attention[0], n_dense_heads=0))):
        torch.manual_seed(0)
        m = cfg.build()
        ids = torch.randint(0, 256, (2, 32))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(ids, ids)
        (out.loss + out.aux_loss).backward()
        assert torch.isfinite(out.loss)
        assert all(p.grad is not None for p in m.parameters())


@pytest.mark.parametrize("T", [1024, 2048, 4096, 8192])
def test_the_long_sequence_rows_follow_section_3_4(T):
    """Sec. 3.4: 6 layers, hidden size 1024, 60 MoSA heads and 4 local attention heads in every
    layer, k = 64 tokens per MoSA head at every length (rho 16 at T = 1024 up to 128 at 8192)."""
    cfg = get_preset(f"c4-mosa-long-t{T}")
    assert (cfg.d_model, cfg.context_length, cfg.vocab_size) == (1024, T, 8000)
    layers = cfg.attention_layers()
    assert len(layers) == 6
    for a in layers:
        assert (a.n_heads, a.d_head, a.n_dense_heads, a.n_local_heads) == (60, 64, 0, 4)
        assert T // a.sparsity == 64 and a.local_window == 64
