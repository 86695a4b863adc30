"""The site as a learner reads it: where the reading path starts, and pages that fit the screen.

The reading path starts where the paper does, at Eq. (11), and runs it by hand
(example 01) before the pieces and the numbers; the landing page's first
"Start here" path and the navigation agree; every page that lists modules links
them; the puzzles are found from the README and the landing page, with what
they need to run. The rest reads the built site's HTML (the same build as
`test_docs_build.py`, made once per session): the sidebar holds at most 60
links on every page, every section heading is in the page's table of contents,
no paragraph opens with the tail of a sentence cut by a display equation, long
printed output is folded, and no page outside the puzzles prints a puzzle's
answer.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import load_script
from test_docs_build import build_site, page, visible_text

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gen():
    """`docs/gen_pages.py`, imported without running it."""
    return load_script(ROOT / "docs" / "gen_pages.py", "refimpl_docs_gen_pages")


@pytest.fixture(scope="session")
def site(request, tmp_path_factory) -> Path:
    return build_site(request.config, tmp_path_factory).require()


# ---------------------------------------------------------------------------
# A learner's path
# ---------------------------------------------------------------------------

def test_the_reading_path_starts_at_eq_11_and_its_example(gen):
    """The first page of the path is Eq. (11), followed by example 01 that runs it by hand."""
    assert gen.READING_PATH[0][0] == "latent_moe"
    assert gen.PATH_EXAMPLES["latent_moe"] == "01_forward_by_hand"
    order = [name for name, _ in gen.READING_PATH]
    assert order.index("activations") < order.index("config") and order.index("routing") < order.index("config")


def test_start_here_follows_the_reading_path(gen):
    """The learner's "Start here" path lists the pages of the reading path in the navigation's order."""
    heading, _, steps = gen.START_HERE[0]
    path = []
    for name, _ in gen.READING_PATH:
        path.append(name)
        if name in gen.PATH_EXAMPLES:
            path.append(gen.PATH_EXAMPLES[name])
    on_path = [name for kind, name, _ in steps if kind in ("paper", "example") and name in path]
    assert heading == "Learning the layer" and on_path[:2] == ["latent_moe", "01_forward_by_hand"]
    assert on_path == sorted(on_path, key=path.index)
    assert any(kind == "puzzles" for kind, _, _ in steps)


def test_a_package_table_of_modules_becomes_links(gen):
    """Each row of a package's table of modules links the module: its own page, or its part of this page."""
    layer = gen.discover_modules()["layer"]
    intro = "| module | what |\n|---|---|\n| `refimpl.layer.routing` | Eq. (13) |\n| `refimpl.layer.nothing` | x |"
    text, complete = gen.linked_module_table(layer, intro)
    assert "| [`refimpl.layer.routing`](routing.md) | Eq. (13) |" in text
    assert "| `refimpl.layer.nothing` | x |" in text and not complete
    balancing = gen.discover_modules()["balancing"]
    text, _ = gen.linked_module_table(balancing, "| `refimpl.balancing.quantile` | Eq. (14) |")
    assert text == "| [`refimpl.balancing.quantile`](#file-quantile) | Eq. (14) |"  # shown on the room's page


def test_the_readme_points_to_the_puzzles_and_says_how_to_change_the_port():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "examples/puzzles/" in readme and "jupyter" in readme.lower()
    assert "make serve PORT=" in readme


@pytest.mark.slow
def test_the_navigation_reads_eq_11_then_example_01_then_the_pieces(site):
    sidebar = primary_sidebar(page(site, ""))
    hrefs = re.findall(r'href="([^"]+)"', sidebar)
    order = ["paper/latent_moe/", "examples/01_forward_by_hand/", "paper/activations/", "paper/routing/",
             "paper/config/", "paper/layer/"]
    assert [h for h in hrefs if h in order] == order  # each once, in this order


@pytest.mark.slow
def test_the_configuration_page_opens_with_the_numbers_and_the_notation(site):
    """The K3 numbers and the notation come first; reading a `config.json` (synonyms, checks) is the reference
    part after them."""
    text = visible_text(article(page(site, "paper", "config")))
    assert text.index("7168") < text.index("The notation of the whole site") < text.index("Reference: reading")
    assert text.index("Reference: reading") < text.index("num_local_experts")  # the synonyms table
    assert text.index("Reference: reading") < text.index("named when it is wrong")


@pytest.mark.slow
def test_the_layer_page_links_every_module_it_lists(site):
    markup = page(site, "paper", "layer")
    table = re.search(r"<table>(.*?)</table>", markup, flags=re.S).group(1)
    rows = re.findall(r"<tr>(.*?)</tr>", table, flags=re.S)[1:]
    assert len(rows) >= 7
    for row in rows:
        first = re.search(r"<td>(.*?)</td>", row, flags=re.S).group(1)
        link = re.search(r'<a href="([^"]+)"', first)
        assert link, row
        assert (site / "paper" / "layer" / link.group(1) / "index.html").resolve().is_file(), link.group(1)


@pytest.mark.slow
def test_the_landing_page_and_the_puzzles_say_how_to_start(site):
    assert 'href="puzzles/"' in page(site, "")
    text = visible_text(article(page(site, "puzzles")))
    assert "Jupyter" in text and "git+https://github.com/refimpl/refimpl" in text and "git clone" in text


# ---------------------------------------------------------------------------
# Helpers that read the built HTML
# ---------------------------------------------------------------------------

def primary_sidebar(markup: str) -> str:
    """The markup of the left sidebar (the site's navigation)."""
    start = markup.index('md-sidebar md-sidebar--primary')
    return markup[start: markup.index('md-sidebar md-sidebar--secondary', start)]


def article(markup: str) -> str:
    """The markup of the page's content, without the navigation and the table of contents."""
    return re.search(r"<article\b.*?</article>", markup, flags=re.S).group(0)
