"""Shared plotting plumbing: a lazily imported, headless matplotlib and PNGs that say what they
hold.

matplotlib is an optional dependency (the ``plot`` extra); it is imported only when a plot is
drawn, on the Agg backend so that no display is needed. Every PNG written here carries a
``moeify:panels`` text chunk (a JSON list of panel titles), so tests and tools can check which
panels an image has without looking at pixels.
"""

from __future__ import annotations

import json
from pathlib import Path

from moeify.data.cache import atomic_write
from moeify.errors import MoeifyError, install_hint

PANELS_KEY = "moeify:panels"


def pyplot():
    """matplotlib.pyplot on the Agg backend, or a MoeifyError naming the extra to install."""
    try:
        import matplotlib
    except ImportError as e:
        raise MoeifyError(f"plotting needs matplotlib: {install_hint('plot')}") from e
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, out: str | Path, panels: list[str], *, dpi: int = 110) -> Path:
    """Write ``fig`` as a PNG with its panel titles in the metadata, then close it. The PNG is
    written under a temporary name and renamed: a failure (a full disk) leaves the old file."""
    out = Path(out)
    if out.suffix.lower() != ".png":
        raise ValueError(f"plots are written as PNG: give an output path ending in .png, "
                         f"got {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    plt = pyplot()
    try:
        with atomic_write(out, "wb") as f:
            fig.savefig(f, format="png", dpi=dpi, metadata={PANELS_KEY: json.dumps(panels)})
    finally:
        plt.close(fig)
    return out


def read_panels(path: str | Path) -> list[str]:
    """The panel titles stored in a PNG written by ``save_figure``."""
    try:
        from PIL import Image
    except ImportError as e:  # Pillow comes with matplotlib
        raise MoeifyError(f"reading plot metadata needs Pillow: {install_hint('plot')}") from e
    with Image.open(path) as im:
        text = getattr(im, "text", None) or im.info
        if PANELS_KEY not in text:
            raise MoeifyError(f"{path} has no {PANELS_KEY} metadata: it was not written by moeify")
        return json.loads(text[PANELS_KEY])
