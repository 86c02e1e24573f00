"""docs/upcycling/demo.py: --help says what it does, and a run with other settings never
writes over the committed results beside it."""

import importlib.util
import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parents[2] / "docs" / "upcycling" / "demo.py"


def load(monkeypatch, **env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    spec = importlib.util.spec_from_file_location("upcycling_demo", DEMO)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_help_and_unknown_stages():
    out = subprocess.run([sys.executable, str(DEMO), "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "Upcycling demonstration" in out.stdout
    assert "--report-dir" in out.stdout
    bad = subprocess.run([sys.executable, str(DEMO), "dense", "bogus"], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "unknown stage 'bogus'" in bad.stderr


def test_report_goes_beside_the_script_only_for_the_committed_settings(monkeypatch, tmp_path):
    runs = tmp_path / "runs"
    demo = load(monkeypatch, RUNS=str(runs), DEMO_N="300", DEMO_M="300")
    assert demo.report_dir(None) == DEMO.parent
    demo = load(monkeypatch, RUNS=str(runs), DEMO_N="20", DEMO_M="10")
    assert demo.report_dir(None) == runs / "report"
    assert demo.report_dir(str(tmp_path / "mine")) == tmp_path / "mine"
