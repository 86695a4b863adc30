"""Progress of a site build: a line every few pages, so that a long `mkdocs build` says where it is.

mkdocs runs these hooks (`hooks:` in `mkdocs.yml`). The page generator (`docs/gen_pages.py`) logs its own
stages first; then mkdocs renders every page (Markdown, code highlighting, the API reference), which is
most of the time, and this file counts them.
"""

from __future__ import annotations

import logging
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


def on_page_markdown(markdown, page, config, files, **kwargs):
    _state["done"] += 1
    done, total = _state["done"], _state["total"]
    if done == 1 or done % EVERY == 0 or done == total:
        log.info("rendered %d of %d pages (%.0f s since the build started)", done, total,
                 time.perf_counter() - _state["start"])
    return markdown


def on_post_build(config, **kwargs) -> None:
    log.info("site written in %.0f s", time.perf_counter() - _state["start"])
