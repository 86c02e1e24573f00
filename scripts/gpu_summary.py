"""The GPU check's summary: every ratio the benchmarks measured, beside the paper's figure and
moeify's target, as one JSON file and one markdown table.

    python scripts/gpu_summary.py OUT_DIR        (scripts/gpu_check.sh runs it last)

Reads what gpu_check.sh wrote in OUT_DIR (device.json, suite.txt, expert-matmul.json: the
kernel table's shapes, expert-matmul-unpadded.json, expert-matmul-peer.json,
expert-matmul-profile.json, attention-47m.json, attention-262m.json, step-47m.json,
step-262m.json, ff.json; a missing or failed phase is reported as such) and writes
OUT_DIR/summary.json and OUT_DIR/summary.md (the
profile as a list below the table).

Paper figures: SwitchHead (arXiv 2312.07987) Table 5, a whole training step against the dense
baseline: 47M 0.72x time, 0.65x memory; 262M 0.65x time, 0.61x memory. Targets beyond the
paper's: the expert matmul at 1.5x an equal-MAC dense GEMM at most, the attention layer at
0.6x (47M) / 0.55x (262M) of dense, the feedforward MoEs at or below Hugging Face's fastest
Mixtral experts implementation.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

PAPER_STEP = {"47m": (0.72, 0.65), "262m": (0.65, 0.61)}
ATTENTION_TARGET = {"47m": 0.6, "262m": 0.55}
EXPERT_MATMUL_TARGET = 1.5


def _load(out: Path, name: str) -> dict | None:
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None


def _suite(out: Path) -> dict:
    try:
        text = (out / "suite.txt").read_text()
    except OSError:
        return {"ran": False}
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", text)}
    return {"ran": True, **counts}


def _row(measure, ratio, *, paper=None, target=None, detail=""):
    met = None if ratio is None or target is None else ratio <= target
    return {"measure": measure, "ratio": ratio, "paper": paper, "target": target, "met": met,
            "detail": detail}


def _expert_matmul_rows(res: dict | None) -> list[dict]:
    """One row per kernel (baselines left out) of one expert-matmul result, or of each shape of
    a kernel-table result (its "results")."""
    if res is None:
        return [_row("expert matmul fwd+bwd x equal-MAC dense GEMM", None,
                     target=EXPERT_MATMUL_TARGET, detail="no result")]
    if "results" in res:
        return [row for r in res["results"] for row in _expert_matmul_rows(r)]
    s = res["shape"]
    contract = "".join(f", {k} {s[k]}" for k in ("groups", "sum_rows") if s.get(k, 1) != 1)
    shape = f"M {s['M']}, D {s['D']}, E {s['E']}, K {s['K']}, F {s['F']}{contract}, {res['dtype']}"
    errors = res.get("peer_errors", {})
    where = f" ({res['name']})" if res.get("name") else ""

    def detail(r):
        err = errors.get(r["implementation"])
        concat = ("" if r.get("x concat") is None
                  else f"; {r['x concat']:.2f}x the concatenated GEMM")
        return (f"{shape}; {r['fwd+bwd ms']:.3f} ms{concat}"
                + ("" if err is None else f"; differs from the reference by {err:.1e}"))

    return [_row(f"expert matmul fwd+bwd [{r['implementation']}]{where} x dense GEMM",
                 r["x dense"], target=EXPERT_MATMUL_TARGET, detail=detail(r))
            for r in res["rows"] if not r["implementation"].startswith("dense")]


def _attention_rows(res: dict | None, size: str) -> list[dict]:
    if res is None:
        return [_row(f"{size} attention layer fwd+bwd x dense", None,
                     target=ATTENTION_TARGET[size], detail="no result")]
    rows = []
    for group in res["groups"]:
        for r in group["rows"]:
            if r["case"] == group.get("baseline") or "dense" in r["case"]:
                continue
            target = ATTENTION_TARGET[size] if "switchhead" in r["case"] else None
            rows.append(_row(f"{size} attention layer fwd+bwd: {r['case']}", r["fwd+bwd x"],
                             target=target, detail=f"{r['fwd+bwd ms']:.3f} ms"))
            if r.get("peak x") is not None:
                rows.append(_row(f"{size} attention layer peak memory: {r['case']}",
                                 r["peak x"], detail=f"{r['peak MiB']:.0f} MiB"))
    return rows


def _step_rows(res: dict | None, size: str) -> list[dict]:
    time_p, mem_p = PAPER_STEP[size]
    if res is None:
        return [_row(f"{size} training step time x dense", None, paper=time_p, target=time_p,
                     detail="no result")]
    rows = []
    for r in res["rows"]:
        if r["case"] == res["baseline"]:
            continue
        sh = "switchhead" in r["case"] and not r.get("compile")  # the paper's rows: eager
        batch = f"batch {res['batch']}, {res['dtype']}"
        rows.append(_row(f"{size} training step time: {r['case']}", r["time x"],
                         paper=time_p if sh else None, target=time_p if sh else None,
                         detail=f"{batch}; {r['step ms']:.1f} ms"))
        if r.get("peak x") is not None:
            rows.append(_row(f"{size} training step peak memory: {r['case']}", r["peak x"],
                             paper=mem_p if sh else None, target=mem_p if sh else None,
                             detail=f"{batch}; {r['peak MiB']:.0f} MiB"))
    return rows


def _ff_rows(res: dict | None) -> list[dict]:
    if res is None:
        return [_row("feedforward MoE fwd+bwd x HF best", None, target=1.0, detail="no result")]
    rows = []
    for r in res["rows"]:
        if r["case"].startswith(("HF ", "dense")):
            continue
        rows.append(_row(f"{r['case']} fwd+bwd x HF Mixtral best", r.get("fwd+bwd x HF best"),
                         target=1.0, detail=f"impl {r['impl']}; {r['fwd+bwd ms']:.3f} ms"))
    return rows


def _unpadded_rows(res: dict | None) -> list[dict]:
    """The Triton kernels run without their width padding (MOEIFY_TRITON_PAD=0), if measured."""
    if res is None:
        return []
    for r in res["rows"]:
        if r["implementation"] == "triton":
            r["implementation"] = "triton, MOEIFY_TRITON_PAD=0"
    return _expert_matmul_rows(res)


def _peer_rows(res: dict | None) -> list[dict]:
    """Other projects' kernels (``--peer``), measured in their own phase beside moeify's."""
    if res is None:
        return []
    peers = [r for r in res["rows"] if r["implementation"].endswith("(peer)")]
    return _expert_matmul_rows(dict(res, rows=peers))


def summarize(out: Path) -> dict:
    rows = _expert_matmul_rows(_load(out, "expert-matmul.json"))
    rows += _unpadded_rows(_load(out, "expert-matmul-unpadded.json"))
    rows += _peer_rows(_load(out, "expert-matmul-peer.json"))
    for size in ("47m", "262m"):
        rows += _attention_rows(_load(out, f"attention-{size}.json"), size)
        rows += _step_rows(_load(out, f"step-{size}.json"), size)
    rows += _ff_rows(_load(out, "ff.json"))
    prof = _load(out, "expert-matmul-profile.json")
    return {"device": _load(out, "device.json"), "suite": _suite(out), "rows": rows,
            "expert_matmul_profile": (prof or {}).get("profile")}


def _profile_lines(profile: dict | None, top: int = 5) -> list[str]:
    """Where one expert-matmul call spends its time, per implementation: its launches and its
    ``top`` kernels with their shares."""
    if not profile:
        return []
    lines = ["", "Expert matmul, one profiled fwd+bwd call (kernels by time):", ""]
    for impl, p in profile.items():
        kernels = "; ".join(f"{k['kernel']} x{k['calls']} {k['share']:.0%}"
                            for k in p["top"][:top])
        lines.append(f"- {impl}: {p['launches']} {p['counted']}, {p['total_us']:.0f} us: "
                     f"{kernels}")
    return lines


def markdown(summary: dict) -> str:
    dev = summary["device"] or {}
    suite = summary["suite"]
    lines = [f"GPU check on {dev.get('name', 'an unknown device')} (torch {dev.get('torch', '?')}, "
             f"CUDA {dev.get('cuda', '?')}, Triton {dev.get('triton', '-')})", ""]
    if suite.get("ran"):
        lines += [f"CUDA suite: {suite.get('passed', 0)} passed, {suite.get('failed', 0)} failed, "
                  f"{suite.get('skipped', 0)} skipped", ""]
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    lines += ["| measure | ratio | paper | target | met | detail |", "|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        met = {True: "yes", False: "no", None: "-"}[r["met"]]
        lines.append(f"| {r['measure']} | {fmt(r['ratio'])} | {fmt(r['paper'])} | "
                     f"{fmt(r['target'])} | {met} | {r['detail']} |")
    lines += _profile_lines(summary.get("expert_matmul_profile"))
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python scripts/gpu_summary.py OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    summary = summarize(out)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    md = markdown(summary)
    (out / "summary.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
