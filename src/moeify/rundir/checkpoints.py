"""Reading a checkpoint of either kind (layout: moeify.rundir), always verified: the format, the
sha256 of every file recorded in meta.json, the model config it was written for, and that every
number is finite, so nothing resumes, evaluates or samples from a damaged or diverged state.

Writing is moeify.rundir.write's (single-file) and moeify.rundir.sharded's (DCP).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from moeify.errors import MoeifyError, read_utf8
from moeify.rundir.atomic import sha256_file
from moeify.rundir.files import same_model_config
from moeify.rundir.layout import (CHECKPOINTS, DCP_DIR, FORMAT_VERSION, META_FILE, MODEL_FILE,
                                  SHARDED_KIND, STATE_FILE, resolve_checkpoint)


class NonFiniteState(MoeifyError):
    """Weights or optimizer state hold a NaN or an infinity."""


@dataclass
class Checkpoint:
    path: Path
    step: int
    model_state: dict[str, torch.Tensor]
    train_state: dict[str, Any]
    meta: dict[str, Any]


# ---------------------------------------------------------------------- finiteness

def nonfinite_tensors(obj: Any, prefix: str = "") -> list[str]:
    """Names of the floating-point tensors in a (nested) state that hold a NaN or infinity."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() or obj.is_complex():
            return [] if bool(torch.isfinite(obj).all()) else [prefix or "tensor"]
        return []
    if isinstance(obj, float):
        return [] if obj == obj and abs(obj) != float("inf") else [prefix or "value"]
    items = (obj.items() if isinstance(obj, dict)
             else enumerate(obj) if isinstance(obj, (list, tuple)) else ())
    out: list[str] = []
    for k, v in items:
        out += nonfinite_tensors(v, f"{prefix}.{k}" if prefix else str(k))
    return out


def nonfinite_state(model_state: dict[str, torch.Tensor],
                    train_state: dict[str, Any]) -> list[str]:
    """Names of the non-finite weights and optimizer tensors ("optimizer ..." for the latter)."""
    return nonfinite_tensors(model_state) + [
        f"optimizer {n}" for n in nonfinite_tensors(train_state.get("optimizer", {}))]


def check_finite(model_state: dict[str, torch.Tensor], train_state: dict[str, Any],
                 where: str, advice: str) -> None:
    """Raise NonFiniteState naming the first bad tensors of the weights or optimizer state."""
    refuse_nonfinite(nonfinite_state(model_state, train_state), where, advice)


def refuse_nonfinite(bad: list[str], where: str, advice: str) -> None:
    """Raise NonFiniteState naming the first of the tensors ``bad`` (nothing when empty)."""
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise NonFiniteState(f"{where}: non-finite values (NaN or inf) in "
                             f"{', '.join(bad[:3])}{more}; {advice}")


# ---------------------------------------------------------------------- both kinds

def read_meta(ckpt: Path) -> dict[str, Any]:
    """A checkpoint's meta.json, or a MoeifyError saying it is incomplete or corrupt."""
    meta_path = ckpt / META_FILE
    try:
        meta = json.loads(read_utf8(meta_path))
        if not isinstance(meta, dict) or "step" not in meta or "sha256" not in meta:
            raise ValueError("step or sha256 missing")
    except FileNotFoundError:
        raise MoeifyError(f"checkpoint {ckpt} is incomplete: {META_FILE} is missing (a write was "
                          "interrupted); use an earlier checkpoint") from None
    except (OSError, ValueError) as e:
        raise MoeifyError(f"checkpoint {ckpt} is corrupt: {META_FILE} cannot be read ({e}); use "
                          "an earlier checkpoint") from None
    return meta


def is_sharded_checkpoint(ckpt_dir: Path) -> bool:
    return read_meta(ckpt_dir).get("kind") == SHARDED_KIND


def load_model_checkpoint(path: str | Path, model: torch.nn.Module, *,
                          model_config: dict[str, Any] | None = None,
                          weights_only: bool = False) -> Checkpoint:
    """Load either kind of checkpoint (a checkpoint directory or a run directory's latest) into
    the plain model ``model``. Returns the Checkpoint (for a sharded one ``model_state`` is the
    model's own state dict and ``train_state`` is empty). ``weights_only``: the optimizer state
    is not read, and the model's tensors become the memory-mapped weights of the file
    (``load_weights``), dtype included."""
    ckpt_dir = resolve_checkpoint(path)
    if is_sharded_checkpoint(ckpt_dir):
        meta = load_sharded_weights(ckpt_dir, model, model_config=model_config)
        return Checkpoint(path=ckpt_dir, step=int(meta["step"]), model_state=model.state_dict(),
                          train_state={}, meta=meta)
    if weights_only:
        loaded = load_weights(ckpt_dir, model_config=model_config)
        load_model_state(model, loaded, assign=True)
        return loaded
    loaded = load_checkpoint(ckpt_dir, model_config=model_config)
    load_model_state(model, loaded)
    return loaded


# ---------------------------------------------------------------------- single-file

def _verified(path: str | Path, model_config: dict[str, Any] | None) -> tuple[Path, dict]:
    """(checkpoint directory, meta) of a single-file checkpoint whose format, model config and
    file checksums are checked."""
    ckpt = resolve_checkpoint(path)
    meta = read_meta(ckpt)
    if meta.get("format") != FORMAT_VERSION:
        raise MoeifyError(f"checkpoint {ckpt} has format {meta.get('format')!r}; this moeify "
                          f"reads format {FORMAT_VERSION}")
    if model_config is not None and not same_model_config(meta.get("model_config"),
                                                              model_config):
        diff = _config_diff(meta.get("model_config"), model_config)
        raise MoeifyError(f"checkpoint {ckpt} is from another model (preset "
                          f"{meta.get('preset')!r}): {diff}. "
                          "Load it with its own run's configuration, or start a new run")
    for f in (MODEL_FILE, STATE_FILE):
        p = ckpt / f
        if not p.is_file():
            raise MoeifyError(f"checkpoint {ckpt} is incomplete: {f} is missing; use an earlier "
                              "checkpoint")
        want = meta["sha256"].get(f)
        if want is not None and sha256_file(p) != want:
            raise MoeifyError(f"checkpoint {ckpt} is corrupt: {f} does not match the checksum "
                              f"recorded when it was written; use an earlier checkpoint "
                              f"({CHECKPOINTS}/step-...) or retrain")
    return ckpt, meta


def load_checkpoint(path: str | Path, *, model_config: dict[str, Any] | None = None,
                    map_location: str | torch.device = "cpu") -> Checkpoint:
    """Load and verify a single-file checkpoint (directory or run directory).

    ``model_config``: the ModelConfig dict of the model it is loaded into; a checkpoint written
    for another model (another preset or other overrides) is refused with a clear message."""
    ckpt, meta = _verified(path, model_config)
    try:
        model_state = load_file(str(ckpt / MODEL_FILE), device=str(map_location))
    except Exception as e:  # safetensors raises its own error types on malformed files
        raise MoeifyError(f"checkpoint {ckpt} is corrupt: {MODEL_FILE} cannot be read ({e})") \
            from None
    try:
        train_state = torch.load(ckpt / STATE_FILE, map_location=map_location, weights_only=True)
    except Exception as e:  # unpickling errors come in many types
        raise MoeifyError(f"checkpoint {ckpt} is corrupt: {STATE_FILE} cannot be read ({e})") \
            from None
    if isinstance(train_state, dict):
        check_finite(model_state, train_state, f"checkpoint {ckpt} cannot be used",
                     "the run had diverged when it was written; use an earlier checkpoint")
    return Checkpoint(path=ckpt, step=int(meta["step"]), model_state=model_state,
                      train_state=train_state, meta=meta)


def load_weights(path: str | Path, *, model_config: dict[str, Any] | None = None
                 ) -> Checkpoint:
    """A single-file checkpoint's weights only, for inference: verified as ``load_checkpoint``
    verifies them, the optimizer state (state.pt) checksummed but never unpickled, the tensors
    memory-mapped from model.safetensors (``mapped_safetensors``) in their stored dtype.
    ``train_state`` is empty."""
    ckpt, meta = _verified(path, model_config)
    try:
        model_state = mapped_safetensors(ckpt / MODEL_FILE)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise MoeifyError(f"checkpoint {ckpt} is corrupt: {MODEL_FILE} cannot be read ({e})") \
            from None
    refuse_nonfinite(nonfinite_tensors(model_state), f"checkpoint {ckpt} cannot be used",
                     "the run had diverged when it was written; use an earlier checkpoint")
    return Checkpoint(path=ckpt, step=int(meta["step"]), model_state=model_state,
                      train_state={}, meta=meta)


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                       "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
                       "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


def mapped_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file as views of one copy-on-write memory map of it
    (``torch.from_file(shared=False)``): pages are read from the file when touched and belong
    to the page cache, not to the process's own memory, until written. A tensor whose offset
    does not suit its dtype's alignment is copied instead."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 0 < n <= size - 8:
            raise ValueError("bad header length")
        header = json.loads(f.read(n))
    data = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES[info["dtype"]]
        start, end = info["data_offsets"]
        if not 0 <= start <= end <= data.numel():
            raise ValueError(f"tensor {name} lies outside the file")
        raw = data[start:end]
        if start % dtype.itemsize:
            raw = raw.clone()
        out[name] = raw.view(dtype).view(info["shape"])
    return out


def load_model_state(model: torch.nn.Module, ckpt: Checkpoint, *, assign: bool = False
                     ) -> None:
    """Copy the checkpoint's weights into ``model`` (``assign``: make them the model's tensors,
    without a copy), with a clear error when they do not fit."""
    try:
        model.load_state_dict(ckpt.model_state, strict=True, assign=assign)
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        raise MoeifyError(f"checkpoint {ckpt.path} does not fit this model (it is from another "
                          f"preset or configuration): {' '.join(first[:3])}") from None


def _config_diff(saved: Any, wanted: Any) -> str:
    if not isinstance(saved, dict) or not isinstance(wanted, dict):
        return "the checkpoint records no model configuration"
    keys = sorted(k for k in set(saved) | set(wanted) if saved.get(k) != wanted.get(k))
    parts = []
    for k in keys[:4]:
        a, b = saved.get(k), wanted.get(k)
        if isinstance(a, (dict, list)) or isinstance(b, (dict, list)):
            parts.append(f"{k} differs")
        else:
            parts.append(f"{k} {a!r} in the checkpoint vs {b!r} here")
    return "; ".join(parts)


# ---------------------------------------------------------------------- sharded (DCP)

def verify_sharded(ckpt: Path, *, model_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The meta record of a sharded checkpoint, after checking its files against the checksums
    (and its model config against ``model_config``, when given)."""
    meta = read_meta(ckpt)
    if meta.get("kind") != SHARDED_KIND:
        raise MoeifyError(f"{ckpt} is not a sharded checkpoint")
    if meta.get("format") != FORMAT_VERSION:
        raise MoeifyError(f"checkpoint {ckpt} has format {meta.get('format')!r}; this moeify "
                          f"reads format {FORMAT_VERSION}")
    if model_config is not None and not same_model_config(meta.get("model_config"),
                                                              model_config):
        raise MoeifyError(f"checkpoint {ckpt} is from another model (preset "
                          f"{meta.get('preset')!r}); load it with its own run's configuration")
    for f, want in meta["sha256"].items():
        p = ckpt / f
        if not p.is_file():
            raise MoeifyError(f"checkpoint {ckpt} is incomplete: {f} is missing; use an earlier "
                              "checkpoint")
        if sha256_file(p) != want:
            raise MoeifyError(f"checkpoint {ckpt} is corrupt: {f} does not match the checksum "
                              "recorded when it was written; use an earlier checkpoint")
    return meta


_SINGLE_PROCESS_WARNING = r"torch\.distributed is disabled, unavailable or uninitialized"


def load_dcp(ckpt: Path, state: dict[str, Any], model: torch.nn.Module | None = None) -> None:
    """Fill ``state`` ({"model": ..., "optim": ...} as DCP's ``get_state_dict`` gives them,
    keyed by parameter name, sharded or not) from ``ckpt/dcp``. With ``model``, a checkpoint
    written with earlier parameter names (moeify.layers.common.rename_legacy_keys) is read under
    those names and handed back under the current ones. A one-element vector the checkpoint
    holds 0-dim (learned scalars before they became vectors: moeify.layers.common) is read as
    the scalar it was, weights and AdamW moments alike."""
    # torch.distributed.checkpoint is imported only when a sharded checkpoint is read: it is
    # slow to import and absent from torch builds without distributed support.
    import torch.distributed.checkpoint as dcp

    try:
        saved = dcp.FileSystemReader(str(ckpt / DCP_DIR)).read_metadata().state_dict_metadata
        renames = _legacy_names(saved, state, model) if model is not None else {}
        _rename_state(state, renames)
        scalars = _scalar_placeholders(saved, state)
        try:
            with warnings.catch_warnings():
                # Reading in one process is the intent here (eval, generate, export, plot):
                # torch says so in a warning on every load.
                warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
                dcp.load(state, checkpoint_id=str(ckpt / DCP_DIR))
        finally:
            _fill_from_scalars(scalars)
            _rename_state(state, {old: new for new, old in renames.items()})
    except Exception as e:  # DCP wraps its errors (missing keys, shape mismatches) in its own
        first = str(e).strip().splitlines()
        raise MoeifyError(f"checkpoint {ckpt} does not fit this model or cannot be read: "
                          f"{' '.join(first[:2]) or type(e).__name__}") from None


def _scalar_placeholders(saved: dict[str, Any], state: dict[str, Any]) -> list[tuple]:
    """Swap every one-element vector of ``state`` that the checkpoint holds 0-dim (``saved``:
    DCP's metadata by flattened key) for a 0-dim tensor DCP can load into; returns
    (container, key, the vector) for ``_fill_from_scalars``."""
    found = []

    def walk(obj: dict, path: str) -> None:
        for k, v in list(obj.items()):
            key = f"{path}.{k}" if path else str(k)
            if isinstance(v, dict):
                walk(v, key)
            elif isinstance(v, torch.Tensor) and tuple(v.shape) == (1,) and \
                    tuple(getattr(saved.get(key), "size", (1,))) == ():
                obj[k] = torch.empty((), dtype=v.dtype)
                found.append((obj, k, v))
    walk(state, "")
    return found


def _fill_from_scalars(scalars: list[tuple]) -> None:
    """Put the vectors back, holding the scalars DCP loaded (a sharded vector: into whichever
    process holds its one element)."""
    with torch.no_grad():
        for obj, k, vector in scalars:
            value = obj[k]
            obj[k] = vector
            local = vector.to_local() if hasattr(vector, "to_local") else vector
            local.copy_(value.reshape(1).to(local.device).expand_as(local))


def reshape_scalar_state(optimizer_state: dict[str, Any], params: list[torch.Tensor]) -> None:
    """In place: the per-parameter state of a torch optimizer state dict (keyed by index in
    ``params``' order) with 0-dim moments of one-element vector parameters reshaped to [1]
    (a single-file checkpoint written when those parameters were 0-dim; ``step`` stays)."""
    for i, p in enumerate(params):
        st = optimizer_state.get("state", {}).get(i)
        if st is None or tuple(p.shape) != (1,):
            continue
        for k, v in st.items():
            if k != "step" and isinstance(v, torch.Tensor) and v.dim() == 0:
                st[k] = v.reshape(1)


def _legacy_names(saved: dict[str, Any], state: dict[str, Any], model: torch.nn.Module
                  ) -> dict[str, str]:
    """{current name: the name the checkpoint holds it under} for the parameters the checkpoint
    holds under an earlier name only (none for a checkpoint of the current names)."""
    # (DCP loads in place, into tensors of the current shape: only plain renames apply.)
    pairs = {(old, new) for m in model.modules()
             for old, new in m.__dict__.get("_legacy_keys", {}).items() if isinstance(new, str)}
    if not pairs:
        return {}
    renames = {}
    for key in state["model"]:
        if "model." + key in saved:
            continue
        for old, new in pairs:
            if key == new or key.endswith("." + new):
                was = key[:len(key) - len(new)] + old
                if "model." + was in saved:
                    renames[key] = was
    return renames


def _rename_state(state: dict[str, Any], renames: dict[str, str]) -> None:
    """Rename parameters in place in the model and optimizer state dicts of ``get_state_dict``
    (the optimizer's: its per-parameter ``state`` and its param groups' ``params`` lists)."""
    if not renames:
        return
    model_sd = state["model"]
    for key in [k for k in model_sd if k in renames]:
        model_sd[renames[key]] = model_sd.pop(key)
    optim_sd = state.get("optim")
    if optim_sd:
        per_param = optim_sd.get("state", {})
        for key in [k for k in per_param if k in renames]:
            per_param[renames[key]] = per_param.pop(key)
        for group in optim_sd.get("param_groups", []):
            group["params"] = [renames.get(k, k) for k in group["params"]]


def load_sharded_weights(ckpt: Path, model: torch.nn.Module, *,
                         model_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Fill a plain (unsharded) model from a sharded checkpoint in this one process; returns the
    checkpoint's meta record. The optimizer state is not read."""
    meta = verify_sharded(ckpt, model_config=model_config)
    state = {"model": model.state_dict()}
    load_dcp(ckpt, state, model)
    model.load_state_dict(state["model"], strict=True)
    return meta
