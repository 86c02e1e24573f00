"""The README's Python examples run as written, and its command list matches the CLI."""

import re
from pathlib import Path

from moeify.cli.main import COMMANDS

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_python_examples_run(tmp_path, monkeypatch):
    """Every block, in a fresh namespace, with a private cache; a block that imports
    transformers is skipped (and said) where the hf extra is not installed."""
    import importlib.util

    import torch

    blocks = python_blocks()
    assert blocks, "the README has no Python example"
    assert any("load_trained" in b and "train_from" in b and "upcycle" in b for b in blocks)
    assert any("import_hf" in b and "export_hf" in b for b in blocks)
    monkeypatch.setenv("MOEIFY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    skipped = []
    try:
        for code in blocks:
            if "import transformers" in code and importlib.util.find_spec("transformers") is None:
                skipped.append(code.splitlines()[0])
                continue
            exec(compile(code, "README.md", "exec"), {})
    finally:
        torch.set_num_threads(threads)
    if skipped:
        import pytest

        pytest.skip(f"transformers is not installed (pip install -e '.[hf]'): skipped the "
                    f"README block starting {skipped[0]!r}")


def test_readme_opens_with_the_two_setup_commands():
    text = README.read_text()
    first_block = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1)
    assert "make train" in first_block and "make test" in first_block
    assert "make test" in (README.parent / ".ci" / "run").read_text()


def test_every_subcommand_is_documented():
    text = README.read_text()
    missing = [c for c in COMMANDS if f"moeify {c}" not in text]
    assert not missing, f"README does not mention: {missing}"
