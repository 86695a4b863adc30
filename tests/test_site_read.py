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

import html
import re
from html.parser import HTMLParser
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


# ---------------------------------------------------------------------------
# The generator's rules that keep pages whole, on made-up inputs
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("source, formula, after", [
    ("9-6. $$y = y_s + y_r$$, then the up-projection and the norm.", "y = y_s + y_r,",
     "then the up-projection and the norm."),
    ("The mistake: $$z = \\operatorname{bf16}(x)$$, the GEMM's result rounded.", "z = \\operatorname{bf16}(x),",
     "the GEMM's result rounded."),
    ("$$u_i = \\sum_p u^{(p)}_i$$; in rank order", "u_i = \\sum_p u^{(p)}_i;", "in rank order"),
    ("The sum $$a\nb$$, then c.", "b,", "then c."),  # a formula over two lines
    ("At the end: $$x = 1$$.", "x = 1.", ""),
])
def test_a_sentence_stays_whole_around_its_display_formula(gen, source, formula, after):
    """The punctuation after a formula goes inside the display; the text after it reads on, never opening a
    paragraph with ", then ..."."""
    out = gen.normalize_display_math(source)
    lines = out.split("\n")
    closing = len(lines) - 1 - lines[::-1].index("$$")
    assert lines[closing - 1] == formula, out
    assert "\n".join(lines[closing + 1:]).strip() == after, out
    assert not re.search(r"^\s*[,;:.]", out, flags=re.M), out


def test_a_formula_followed_by_words_keeps_them(gen):
    out = gen.normalize_display_math("where $$x$$ is the input and $$y$$ the output")
    assert out.split("\n") == ["where", "", "$$", "x", "$$", "", "is the input and", "", "$$", "y", "$$", "",
                               "the output"]


def test_one_line_between_rulers_is_a_heading_however_long(gen):
    """A comment line framed by rulers is a section's title, so it is in the page's table of contents."""
    rule = "# " + "-" * 75
    title = "Stage 2 differentiated: the weights through renormalization and scaling"
    source = f'"""A module."""\n\n{rule}\n# {title}\n{rule}\n\nX = 1\n'
    assert f"## {title}\n" in gen.literate(source).body


def test_a_long_output_is_shown_in_a_box_that_says_how_long(gen):
    short = gen.output_markdown("a\n" * gen.LONG_OUTPUT_LINES)
    long = gen.output_markdown("a\n" * (gen.LONG_OUTPUT_LINES + 1))
    assert "refimpl-output--long" not in short and "lines" not in short
    assert 'class="refimpl-output refimpl-output--long"' in long
    assert f"It printed {gen.LONG_OUTPUT_LINES + 1} lines" in long
    css = (ROOT / "docs" / "assets" / "stylesheets" / "extra.css").read_text(encoding="utf-8")
    rule = re.search(r"\.refimpl-output--long pre > code \{(.*?)\}", css, flags=re.S).group(1)
    assert "max-height" in rule and "overflow-y: auto" in rule and "pre-wrap" in rule


def test_the_kits_page_is_made_without_the_puzzles_files(gen):
    """The puzzles have pages of their own; the kit's page, which prints its files' source, leaves them out."""
    files = gen.discover_modules()["testing"].files
    assert files and not [p for p in files if "puzzles" in p.relative_to(ROOT / "refimpl" / "testing").parts]


# ---------------------------------------------------------------------------
# The built site
# ---------------------------------------------------------------------------

class SidebarLinks(HTMLParser):
    """Counts the navigation links of the left sidebar, and those of a table of contents folded into it."""

    VOID = {"br", "img", "input", "meta", "link", "hr", "source", "wbr"}

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.sidebar_depth: int | None = None
        self.toc_depth: int | None = None
        self.links = 0
        self.toc_links = 0

    def handle_starttag(self, tag, attrs):
        if tag in self.VOID:
            return
        self.depth += 1
        classes = (dict(attrs).get("class") or "").split()
        if self.sidebar_depth is None and "md-sidebar--primary" in classes:
            self.sidebar_depth = self.depth
        elif self.sidebar_depth is not None and self.toc_depth is None and "md-nav--secondary" in classes:
            self.toc_depth = self.depth
        if tag == "a" and self.sidebar_depth is not None and "md-nav__link" in classes:
            self.links += 1
            self.toc_links += self.toc_depth is not None

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        if self.toc_depth == self.depth:
            self.toc_depth = None
        if self.sidebar_depth == self.depth:
            self.sidebar_depth = None
        self.depth -= 1


def sidebar_links(markup: str) -> SidebarLinks:
    counter = SidebarLinks()
    counter.feed(markup)
    return counter


def test_the_sidebar_counter_counts_a_folded_table_of_contents():
    """The counter on made-up markup: two navigation links, one of them inside a folded table of contents."""
    markup = ('<div class="md-sidebar md-sidebar--primary"><nav class="md-nav md-nav--primary"><ul><li>'
              '<a class="md-nav__link" href="a/">A</a><br><nav class="md-nav md-nav--secondary"><ul><li>'
              '<a class="md-nav__link" href="#x">x</a></li></ul></nav></li></ul></nav></div>'
              '<div class="md-sidebar md-sidebar--secondary"><a class="md-nav__link" href="#y">y</a></div>')
    counted = sidebar_links(markup)
    assert (counted.links, counted.toc_links) == (2, 1)


def site_pages(site: Path) -> dict[str, str]:
    """Every page of the built site, by its path, with its markup."""
    return {path.parent.relative_to(site).as_posix(): path.read_text(encoding="utf-8")
            for path in sorted(site.rglob("index.html"))}


@pytest.mark.slow
def test_every_sidebar_holds_at_most_60_links_and_no_table_of_contents(site):
    counts = {path: sidebar_links(markup) for path, markup in site_pages(site).items()}
    assert len(counts) > 100 and counts["."].links >= 20
    too_many = {path: c.links for path, c in counts.items() if c.links > 60}
    folded = {path: c.toc_links for path, c in counts.items() if c.toc_links}
    assert too_many == {} and folded == {}


@pytest.mark.slow
def test_no_paragraph_opens_with_the_tail_of_a_sentence_after_a_formula(site):
    """A paragraph right after a display formula never starts with ", then ..." or another punctuation mark."""
    orphans = {}
    for path, markup in site_pages(site).items():
        found = re.findall(r'<div class="arithmatex">.*?</div>\s*<p>\s*([,;:.][^<]{0,40})', markup, flags=re.S)
        if found:
            orphans[path] = found
    assert orphans == {}


@pytest.mark.slow
def test_every_section_heading_is_in_the_table_of_contents(site):
    missing = {}
    for path, markup in site_pages(site).items():
        content = article(markup)
        toc = markup[markup.index("md-sidebar--secondary"):] if "md-sidebar--secondary" in markup else ""
        listed = {html.unescape(h) for h in re.findall(r'href="#([^"]+)"', toc)}
        headings = re.findall(r"<h([23])([^>]*)>(.*?)</h\1>", content, flags=re.S)
        lost = [visible_text(text)[:60] for _, attrs, text in headings
                if html.unescape((re.search(r'id="([^"]+)"', attrs) or [None, ""])[1]) not in listed]
        if lost:
            missing[path] = lost
    assert missing == {}
    assert "Stage 2 differentiated" in visible_text(page(site, "paper", "backward").split("md-sidebar--secondary")[1])


def answer_runs(answer_source: str, text: str, run: int = 3) -> list[str]:
    """The runs of `run` consecutive code lines of a puzzle's answer (its docstring and comments left out) that
    `text` holds in the same order, line after line: a line or two of an answer may be any NumPy code's
    (`raw = np.take_along_axis(scores, index, axis=1)`), three in a row copy the answer."""
    import ast

    tree = ast.parse(answer_source)
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            skip.update(range(node.lineno, node.end_lineno + 1))
    code = [line.split("  #")[0].strip() for number, line in enumerate(answer_source.splitlines(), start=1)
            if number not in skip and line.strip() and not line.strip().startswith(("#", "def ", "@"))]
    held = "\n".join(line.split("  #")[0].strip() for line in text.splitlines() if line.strip())
    return ["\n".join(code[i: i + run]) for i in range(len(code) - run + 1) if "\n".join(code[i: i + run]) in held]


def test_a_copied_answer_is_found_and_a_shared_idiom_is_not():
    answer = '''def f(scores, bias, top_k):
    """Doc."""
    biased = scores + bias[None, :]  # the choice
    index = np.argsort(-biased, axis=1, kind="stable")[:, :top_k]
    return index
'''
    copied = "x = 1\n    biased = scores + bias[None, :]\nindex = np.argsort(-biased, axis=1, kind=\"stable\")[:, :top_k]\n" \
             "return index\n"
    assert answer_runs(answer, copied) and not answer_runs(answer, "biased = scores + bias[None, :]\nreturn index")


@pytest.mark.slow
def test_the_kit_page_prints_no_puzzles_answer(site):
    """No answer of a puzzle is on the kit's page: not the puzzles' source, not three lines of an answer in a
    row, and its test file computes nothing the puzzles ask for: it checks refimpl's own functions in place of
    the reader's (it once held a whole router and Eq. (14), the answers of puzzles 1, 2 and 6)."""
    from refimpl.testing.puzzles import PUZZLES

    text = html.unescape(re.sub(r"<[^>]+>", "", article(page(site, "paper", "testing"))))
    given_away = {p.name: runs for p in PUZZLES.values() if (runs := answer_runs(p.answer_source, text))}
    assert given_away == {}
    assert "refimpl/testing/puzzles/" not in text
    fragment = (ROOT / "docs" / "sections" / "testing.md").read_text(encoding="utf-8")
    test_file = re.search(r"```python\n(.*?)```", fragment.split("## A complete test file", 1)[1], flags=re.S)
    worked = re.findall(r"\b(?:argsort|argpartition|partition|sort|take_along_axis|quantile|exp|tanh)\(",
                        test_file.group(1))
    assert worked == [], "the page's test file computes what the puzzles ask for"


@pytest.mark.slow
def test_example_31s_long_output_is_in_a_box_of_its_own(site):
    markup = page(site, "examples", "31_mistakes_the_kit_catches")
    assert 'class="refimpl-output refimpl-output--long"' in markup
    assert re.search(r"It printed \d{3} lines", markup)


@pytest.mark.slow
def test_no_prose_says_a_target_is_met_without_its_owner(site):
    """A bound called met says nothing to a reader who is not told whose bound it is and why. The benchmark
    page's recorded tables, which name their script, and printed output are left out."""
    said = {}
    for path, markup in site_pages(site).items():
        if path.startswith("benchmark-results"):
            continue
        prose = visible_text(re.sub(r"<pre\b.*?</pre>", " ", article(markup), flags=re.S))
        found = re.findall(r"[^.]{0,40}\btargets? (?:are |is |were )?met\b", prose, flags=re.I)
        if found:
            said[path] = found
    assert said == {}
