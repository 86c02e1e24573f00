"""What identifies a run's training data, so that a run works from any directory.

config.json records ``data`` (a corpus name, or the absolute path of a local corpus) and
``data_sha256``, the fingerprint of the prepared corpus's content
(moeify.data.corpora.corpus_fingerprint). A resumed run accepts any path to the same content
and refuses, saying so, content that differs. Runs that recorded a path as typed (relative,
with no fingerprint) are still read: the path is looked up from the current directory, then
from the directory the run was most likely started in.
"""

from __future__ import annotations

from pathlib import Path

from moeify.data.corpora import CORPORA, corpus_fingerprint, load_corpus
from moeify.errors import MoeifyError


def is_corpus_name(spec: str) -> bool:
    """Whether ``spec`` names a registered corpus (not a path)."""
    return spec in CORPORA


def resolve_spec(spec: str) -> str:
    """A corpus name as it is; a path made absolute (``~`` expanded, links resolved)."""
    return spec if is_corpus_name(spec) else str(Path(spec).expanduser().resolve())


def recorded_spec(recorded: str, run_dir: str | Path | None) -> str:
    """The corpus a run recorded (config.json's ``data``) as a spec that works from here: a
    name or an absolute path as it is; a relative path (recorded as typed) from the current
    directory when it exists there, else from the directory above the run's parent (runs/NAME
    was made from there by default), else from the run's parent; unchanged when none exists."""
    if is_corpus_name(recorded) or Path(recorded).expanduser().is_absolute():
        return recorded
    bases = [Path.cwd()]
    if run_dir is not None:
        parent = Path(run_dir).resolve().parent
        bases += [parent.parent, parent]
    for base in bases:
        p = base / recorded
        if p.exists():
            return str(p.resolve())
    return recorded


def run_corpus_spec(recorded: str | None, run_dir: str | Path, *, flag: str = "--data") -> str:
    """The corpus a reader of a run (eval, plot) uses when no ``flag`` is given: the run's own,
    found from any directory, or a one-line error saying what to pass."""
    if not recorded:
        raise ValueError(f"{run_dir} does not record its training corpus: pass {flag} CORPUS")
    spec = recorded_spec(recorded, run_dir)
    if not is_corpus_name(spec) and not Path(spec).expanduser().exists():
        raise MoeifyError(f"{run_dir} was trained on {recorded}, which is not there any more (nor "
                          f"from {Path(run_dir).resolve().parent.parent}): pass {flag} PATH with "
                          "the same text, or a corpus name")
    return spec


def identify(spec: str) -> tuple[str, str | None]:
    """(``spec`` resolved as config.json records it, the content's fingerprint). A local corpus
    is prepared (from the cache after the first time) to fingerprint it; a named corpus is
    identified by its name (its recipe verifies a checksum), so nothing is downloaded here,
    outside the trainer's one-process-first preparation."""
    if is_corpus_name(spec):
        return spec, None
    return resolve_spec(spec), corpus_fingerprint(load_corpus(spec))


def data_difference(saved_data: str, saved_sha: str | None, data: str, sha: str | None,
                    run_dir: str | Path | None = None) -> str | None:
    """Why a run trained on ``saved_data`` (fingerprint ``saved_sha``) cannot continue on
    ``data`` (``sha``), or None when it can: the same content by fingerprint when both are
    known, else the same corpus name or file."""
    if saved_sha and sha:
        if saved_sha == sha:
            return None
        return (f"the data given ({data}) is not the data this run was trained on: its content "
                f"differs (fingerprint {sha[:12]}, the run's is {saved_sha[:12]}, from "
                f"{saved_data}); give --data a path to the same text, or start a new run from "
                "this one's weights with --init-from RUN --data ...")
    if saved_data == data:
        return None
    a, b = recorded_spec(saved_data, run_dir), recorded_spec(data, run_dir)
    if sha and not saved_sha and not is_corpus_name(a) and Path(a).expanduser().exists():
        # A run that recorded no fingerprint: its data, where it still is, gives one.
        return data_difference(saved_data, identify(a)[1], data, sha, run_dir)
    if a == b or resolve_spec(a) == resolve_spec(b):
        return None
    try:
        if Path(a).expanduser().samefile(Path(b).expanduser()):
            return None
    except OSError:
        pass
    return (f"cannot change data when resuming: the run was trained on {saved_data!r}, and "
            f"{data!r} was given; give --data a path to the same text, or start a new run from "
            "this one's weights with --init-from RUN --data ...")
