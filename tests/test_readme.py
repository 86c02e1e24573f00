"""The README's Python examples run as written, and its command list matches the CLI."""

import re
from pathlib import Path

from moeify.cli.main import COMMANDS

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_python_examples_run():
    blocks = python_blocks()
    assert blocks, "the README has no Python example"
    for code in blocks:
        exec(compile(code, "README.md", "exec"), {})


def test_readme_opens_with_the_two_setup_commands():
    text = README.read_text()
    first_block = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1)
    assert "make train" in first_block and "make test" in first_block
    assert "make test" in (README.parent / ".ci" / "run").read_text()


def test_every_subcommand_is_documented():
    text = README.read_text()
    missing = [c for c in COMMANDS if f"moeify {c}" not in text]
    assert not missing, f"README does not mention: {missing}"
