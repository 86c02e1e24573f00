"""Other people's expert-matmul kernels, timed beside moeify's on the same routing.

moeify ships none of their code: a peer is loaded from a file the user points to, and called
through an adapter that maps moeify's contract (rows ``x`` [M, D], expert ids [M, K], weights
[E, D, F], gates [M, K] -> the gated sum [M, F]) onto the peer's API.

``cvmm``: the SwitchHead authors' CVMM (``cvmm.py`` of github.com/RobertCsordas/moeut, the later
copy, which takes bf16 inputs and multiplies them in fp16; SwitchHead's own repository holds the
same file). Its API as that file
defines it: ``cvmm_prepare_sel2(sel, w)`` sorts the [M, K] selection and keeps the gates as the
"reduction weight"; ``cvmm(x, sel, keys)`` with keys [E, D, F] returns the gated sum. It needs
CUDA (it places index tensors with ``.cuda()``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Callable

import torch

PEERS = ("cvmm",)


def load_peer(kind: str, path: str | Path) -> Callable:
    """The peer ``kind`` from the Python file ``path``, as a function (x, idx, w, gates) ->
    [M, F] that autograd differentiates. A one-line ValueError for an unknown kind, a missing
    file, a file that does not import, or one without the functions the adapter calls."""
    if kind not in PEERS:
        raise ValueError(f"unknown peer {kind!r}: the peers are {', '.join(PEERS)}")
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--peer {kind}={path}: no such file; give the path of the peer's "
                         "cvmm.py (e.g. moeut/cvmm.py in a clone of RobertCsordas/moeut)")
    name = f"moeify_peer_{kind}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and torch.library look the module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - any failure of foreign code is one message
        sys.modules.pop(name, None)
        raise ValueError(f"--peer {kind}={path} does not import: "
                         f"{type(e).__name__}: {e}") from None
    missing = [f for f in ("cvmm", "cvmm_prepare_sel2") if not hasattr(module, f)]
    if missing:
        raise ValueError(f"--peer {kind}={path} has no {', '.join(missing)}: "
                         "is it the SwitchHead authors' cvmm.py?")

    def cvmm(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
             gates: torch.Tensor) -> torch.Tensor:
        sel = module.cvmm_prepare_sel2(idx.int(), gates.to(x.dtype))
        return module.cvmm(x, sel, w)

    return cvmm


def parse_peer(spec: str) -> tuple[str, str]:
    """``KIND=PATH`` -> (kind, path), for ``--peer``."""
    kind, sep, path = spec.partition("=")
    if not sep or not path:
        raise ValueError(f"--peer {spec!r}: give KIND=PATH, e.g. cvmm=moeut/cvmm.py")
    return kind, path
