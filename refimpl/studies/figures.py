r"""Figures of the worked examples: drawn once, saved as PNG or shown under the notebook cell that drew them.

Every worked example (`examples/NN_slug.py`) draws its figures with
matplotlib and hands each one to `show_figure`, with a file name, a caption
that says what to see in it and an alternative text that describes it for
a reader who cannot see it:

```python
if figures_wanted(args.out):
    show_figure(plot_loads(loads), args.out, "loads.png",
                caption="Quantile Balancing brings every expert to the target load q.",
                alt="Bar chart of the tokens each of four experts receives, before and after the update")
```

* Run as a script with `--out DIR`, the figure is saved as `DIR/loads.png`
  (written to a temporary name in the same folder and renamed, so a reader
  never finds half a file).
* Run in a Jupyter kernel (the example's notebook), the figure is shown under
  the cell, followed by its caption. The image output carries the file name,
  caption and alternative text in its metadata (`"refimpl"`), which is how the
  site turns a recorded notebook into a figure with a caption.
* Run as a script without `--out`, nothing is drawn: `figures_wanted` is
  false, and the example does not even import matplotlib.

matplotlib is needed only to draw (`pip install matplotlib`); the rest of
refimpl does not use it.
"""

from __future__ import annotations

import base64
import io
import struct
import sys
from pathlib import Path
from typing import Any

from .._lib.files import write_atomically

__all__ = ["DPI", "figures_wanted", "in_notebook", "png_size", "show_figure"]

#: Resolution of every saved and shown figure, in dots per inch.
DPI = 110


def in_notebook() -> bool:
    """Whether this code runs in a Jupyter kernel (IPython with a kernel attached), without importing IPython."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return shell is not None and getattr(shell, "kernel", None) is not None


def figures_wanted(out: str | Path | None) -> bool:
    """Whether to draw the figures at all: when they will be saved (`out` given) or shown (in a notebook)."""
    return out is not None or in_notebook()


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height in pixels of PNG data, read from its header."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        raise ValueError("not PNG data: the file does not start with the PNG signature and an IHDR chunk")
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def show_figure(fig: Any, out: str | Path | None, name: str, *, caption: str, alt: str, dpi: int = DPI) -> None:
    """Save the matplotlib figure `fig` as `out/name` and, in a notebook, show it with its caption; then close it.

    `caption` says what the figure shows and what to see in it; `alt` describes the picture in words
    (both are required: the site shows them with the figure, and its tests check they say something).
    `fig` may also be PNG data already drawn (`bytes`), for a figure another process saved.
    """
    if not isinstance(name, str) or Path(name).name != name or not name.lower().endswith(".png"):
        raise ValueError(f"name must be a file name ending in .png, got {name!r}")
    for label, text in (("caption", caption), ("alt", alt)):
        if not isinstance(text, str) or len(text.split()) < 4:
            raise ValueError(f"{label} of {name} must be a sentence of at least four words, got {text!r}")
    if isinstance(fig, bytes):
        data = fig
        png_size(data)  # refuses data that is not PNG
    else:
        import matplotlib.pyplot as plt

        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=dpi)
        plt.close(fig)
        data = buffer.getvalue()
    if out is not None:
        write_atomically(Path(out) / name, data, make_folder=True)
    if in_notebook():
        from IPython.display import display

        meta = {"filename": name, "caption": caption, "alt": alt}
        display({"image/png": base64.b64encode(data).decode("ascii"), "text/plain": f"<{name}: {alt}>"}, raw=True,
                metadata={"refimpl": meta})
        display({"text/markdown": f"*{caption}*", "text/plain": caption}, raw=True,
                metadata={"refimpl": {"caption_of": name}})
