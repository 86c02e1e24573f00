"""Where things are in a run directory (the layout: moeify.rundir), and finding checkpoints."""

from __future__ import annotations

from pathlib import Path

from moeify.errors import MoeifyError

CONFIG_FILE = "config.json"
MODEL_CONFIG_FILE = "model.json"
METRICS_FILE = "metrics.jsonl"

CHECKPOINTS = "checkpoints"
LATEST = "latest"
MODEL_FILE = "model.safetensors"   # single-file checkpoints: the weights
STATE_FILE = "state.pt"            # both kinds: optimizer (single-file), schedule, data, RNG
META_FILE = "meta.json"            # both kinds: written last, so its presence means complete
DCP_DIR = "dcp"                    # sharded checkpoints: torch.distributed.checkpoint files
SHARDED_KIND = "sharded"           # meta.json "kind" of a sharded checkpoint
FORMAT_VERSION = 1


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def step_of(path: Path) -> int:
    """The step number of a checkpoint directory (step-00000100 -> 100)."""
    return int(path.name.split("-", 1)[1])


def run_dir_of(checkpoint: Path) -> Path:
    return checkpoint.parent.parent


def checkpoint_dirs(run_dir: str | Path) -> list[Path]:
    """Complete checkpoint directories of a run (``step-*`` holding meta.json), oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for p in root.glob("step-*"):
        try:
            step = int(p.name.split("-", 1)[1])
        except ValueError:
            continue
        if (p / META_FILE).is_file():
            found.append((step, p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The run's newest checkpoint, by one rule for every reader:

    1. the directory ``checkpoints/latest`` names, when it is a directory there (even a damaged
       one: loading it then says what is wrong, rather than silently using an older one);
    2. else the newest complete checkpoint (``step-*`` with meta.json, by step number);
    3. else None (the run has none yet; callers that need one say so).

    Either kind of checkpoint counts (single-file or sharded); a reader that handles only one
    kind chooses among ``checkpoint_dirs`` itself (moeify.rundir.model.load_trained)."""
    root = Path(run_dir) / CHECKPOINTS
    pointer = root / LATEST
    if pointer.is_file():
        target = root / pointer.read_text().strip()
        if target.is_dir() and target.parent == root:
            return target
    dirs = checkpoint_dirs(run_dir)
    return dirs[-1] if dirs else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from either a checkpoint directory or a run directory (its
    ``latest_checkpoint``)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: give a run directory (runs/NAME) or one "
                                "of its checkpoints (runs/NAME/checkpoints/step-...)")
    if (path / META_FILE).is_file() or path.parent.name == CHECKPOINTS:
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise MoeifyError(f"{path} holds no complete checkpoint (no {CHECKPOINTS}/step-*/"
                          f"{META_FILE}); train first, or point at the right run directory")
    return found


def default_run_dir(root: Path, preset: str, data: str) -> Path:
    """``root/<preset>-<corpus>``, with -2, -3, ... appended when that run already exists."""
    corpus = Path(data).name if ("/" in data or "\\" in data) else data
    base = root / f"{preset}-{corpus}"
    candidate, n = base, 1
    while candidate.exists() and any(candidate.iterdir()):
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate
