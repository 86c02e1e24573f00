"""Sharded (DCP) checkpoints whose feedforward MoEs held their expert weights themselves
(``feedforward.w_in``, before the experts became a sub-module, moeify.layers.experts): the
weights and the AdamW state load into the current model and optimizer (single-file checkpoints
go through load_state_dict, tests/layers/test_moved_expert_keys.py); and checkpoints that hold the
learned scalars 0-dim (the attention scale, MoD's router bias), one-element vectors now."""

import pytest
import torch

from moeify.models.presets import get_preset
from moeify.rundir.checkpoints import _legacy_names, load_dcp
from moeify.rundir.layout import DCP_DIR
from moeify.train.config import apply_model_overrides

pytestmark = pytest.mark.usefixtures("single_thread")

FLAT = {"experts.w_in": "w_in", "experts.w_out": "w_out", "experts.w_gate": "w_gate",
        "experts.bias_in": "bias_in"}


def _flat(key: str) -> str:
    for new, old in FLAT.items():
        if key.endswith("." + new):
            return key[:len(key) - len(new)] + old
    return key


def _trained(seed: int, preset: str = "tiny-switchall"):
    cfg = apply_model_overrides(get_preset(preset),
                                ("model.d_model=32", "model.n_layers=2", "model.context_length=16"))
    torch.manual_seed(seed)
    model = cfg.build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (2, 13))
    out = model(ids[:, :-1], ids[:, 1:])
    (out.loss + out.aux_loss).backward()
    opt.step()
    return model, opt


def test_a_sharded_checkpoint_with_flat_expert_keys_restores_weights_and_adamw_state(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _trained(0)
    model_sd, optim_sd = get_state_dict(model, opt)
    old_model = {_flat(k): v for k, v in model_sd.items()}
    assert "blocks.0.feedforward.w_in" in old_model
    old_optim = {"state": {_flat(k): v for k, v in optim_sd["state"].items()},
                 "param_groups": [{**g, "params": [_flat(k) for k in g["params"]]}
                                  for g in optim_sd["param_groups"]]}
    dcp.save({"model": old_model, "optim": old_optim}, checkpoint_id=str(tmp_path / DCP_DIR))

    fresh, fresh_opt = _trained(1)
    state_model, state_optim = get_state_dict(fresh, fresh_opt)
    state = {"model": state_model, "optim": state_optim}
    load_dcp(tmp_path, state, fresh)
    assert state["model"].keys() == model_sd.keys()  # handed back under the current names
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    for key, value in model.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[key], value, rtol=0, atol=0)
    _, got = get_state_dict(fresh, fresh_opt)
    for key, st in optim_sd["state"].items():
        for name, value in st.items():
            torch.testing.assert_close(got["state"][key][name], value, rtol=0, atol=0)


def test_a_sharded_checkpoint_with_the_current_keys_needs_no_renaming(tmp_path):
    import torch.distributed.checkpoint as dcp

    model, _ = _trained(0)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / DCP_DIR))
    fresh, _ = _trained(1)
    state = {"model": fresh.state_dict()}
    saved = dcp.FileSystemReader(str(tmp_path / DCP_DIR)).read_metadata().state_dict_metadata
    assert _legacy_names(saved, state, fresh) == {}
    import warnings

    with warnings.catch_warnings():  # one process reads a sharded checkpoint without torch's
        warnings.simplefilter("error")  # "assuming the intent is to load in a single process"
        load_dcp(tmp_path, state, fresh)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(state["model"][key], value, rtol=0, atol=0)


# Learned scalars (the dense attention core's logit scale, Mixture-of-Depths' router bias) were
# 0-dim parameters; they are one-element vectors now (FSDP2 shards dim 0).
SCALARS = (".scale", ".bias_router")


def _as_scalars(sd: dict) -> dict:
    return {k: (v.reshape(()) if k.endswith(SCALARS) else v) for k, v in sd.items()}


def _moments_as_scalars(st: dict) -> dict:
    return {k: (v if k == "step" else v.reshape(())) for k, v in st.items()}


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-mod"])
def test_a_sharded_checkpoint_with_0_dim_scalars_restores_weights_and_adamw_state(tmp_path,
                                                                                 preset):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _trained(0, preset)
    model_sd, optim_sd = get_state_dict(model, opt)
    scalars = [k for k in model_sd if k.endswith(SCALARS)]
    assert scalars and all(model_sd[k].shape == (1,) for k in scalars)
    old_optim = {"state": {k: (_moments_as_scalars(st) if k.endswith(SCALARS) else st)
                           for k, st in optim_sd["state"].items()},
                 "param_groups": optim_sd["param_groups"]}
    assert old_optim["state"][scalars[0]]["exp_avg"].dim() == 0
    dcp.save({"model": _as_scalars(model_sd), "optim": old_optim},
             checkpoint_id=str(tmp_path / DCP_DIR))

    fresh, fresh_opt = _trained(1, preset)
    state_model, state_optim = get_state_dict(fresh, fresh_opt)
    state = {"model": state_model, "optim": state_optim}
    load_dcp(tmp_path, state, fresh)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    for key, value in model.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[key], value, rtol=0, atol=0)
    _, got = get_state_dict(fresh, fresh_opt)
    for key in scalars:
        for name in ("exp_avg", "exp_avg_sq"):
            assert got["state"][key][name].shape == (1,)
            torch.testing.assert_close(got["state"][key][name], optim_sd["state"][key][name],
                                       rtol=0, atol=0)


def test_a_single_file_state_with_0_dim_scalars_loads(tmp_path):
    from moeify.rundir.checkpoints import reshape_scalar_state

    model, opt = _trained(0, "tiny-mod")
    fresh, fresh_opt = _trained(1, "tiny-mod")
    fresh.load_state_dict(_as_scalars(model.state_dict()))  # the layers' load hook
    for key, value in model.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[key], value, rtol=0, atol=0)
    names = [n for n, _ in model.named_parameters()]
    old = opt.state_dict()
    old["state"] = {i: (_moments_as_scalars(st) if names[i].endswith(SCALARS) else st)
                    for i, st in old["state"].items()}
    reshape_scalar_state(old, list(fresh.parameters()))
    fresh_opt.load_state_dict(old)
    ids = torch.randint(0, 256, (2, 13))
    out = fresh(ids[:, :-1], ids[:, 1:])
    (out.loss + out.aux_loss).backward()
    fresh_opt.step()  # AdamW's in-place moment updates need the moments' shape to fit
    bias = [p for n, p in fresh.named_parameters() if n.endswith(".bias_router")][0]
    assert fresh_opt.state[bias]["exp_avg"].shape == (1,)
