"""Progress of a site build: a line every few pages, so that a long `mkdocs build` says where it is.

mkdocs runs these hooks (`hooks:` in `mkdocs.yml`). The page generator (`docs/gen_pages.py`) logs its own
stages first; then mkdocs renders every page (Markdown, code highlighting, the API reference), which is
most of the time, and this file counts them.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import time

log = logging.getLogger("mkdocs.hooks.progress")

#: Log a line every this many pages.
EVERY = 40

_state = {"start": 0.0, "done": 0, "total": 0}


def on_pre_build(config, **kwargs) -> None:
    _state["start"] = time.perf_counter()
    log.info("building the site: generating its pages from the repository")


def on_files(files, config, **kwargs):
    _state["total"] = sum(1 for f in files if f.is_documentation_page())
    _state["done"] = 0
    return files


#: A fenced Python block whose printed output replaces it on the page (a table generated from the code).
_EXEC_BLOCK = re.compile(r'^```python exec="on"\n(.*?)^```[ \t]*$', re.M | re.S)


def render_exec_blocks(markdown: str, where: str) -> str:
    """Replace each ```` ```python exec="on" ```` block by what its code prints (Markdown, e.g. a table).

    The tables of the conventions catalogue and of the configuration synonyms are printed by a few lines
    that read the repository's own objects, so the page and the code cannot drift apart. A block that
    raises stops the build with the page's name, rather than leaving source text on the page.
    """
    def run(match: re.Match) -> str:
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                exec(compile(match.group(1), f"<{where}: generated table>", "exec"), {})
        except Exception as error:
            raise RuntimeError(f"{where}: the generated-table block raised {error!r}") from error
        return out.getvalue()

    return _EXEC_BLOCK.sub(run, markdown)


def on_page_markdown(markdown, page, config, files, **kwargs):
    markdown = render_exec_blocks(markdown, page.file.src_uri)
    _state["done"] += 1
    done, total = _state["done"], _state["total"]
    if done == 1 or done % EVERY == 0 or done == total:
        log.info("rendered %d of %d pages (%.0f s since the build started)", done, total,
                 time.perf_counter() - _state["start"])
    return markdown


def on_post_build(config, **kwargs) -> None:
    log.info("site written in %.0f s", time.perf_counter() - _state["start"])
