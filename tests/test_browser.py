"""The built site in a real browser: every page, as a reader opens it, with no network.

The site built by `test_docs_build.py` is served on 127.0.0.1 from a thread,
and headless Chromium, driven by Playwright, opens every page on a 1280-pixel
screen. Each page must answer 200, log no console error, request nothing
outside 127.0.0.1, render every formula with KaTeX and no error, load every
image, and link only to pages and anchors that exist; no navigation label or
table of contents shows raw LaTeX, and no code line of up to 110 characters
scrolls sideways. What a reader sees is checked too:

* every content figure has a caption and an alt text of several words, and is
  shown at 0.6 of its natural width or more; nothing in the text column
  (table, code, figure) reaches past it, except inside a box that scrolls;
* the left sidebar holds at most 60 links, none to the same page twice, and no
  label longer than two lines; no floating button covers the text;
* no page cites the team's working papers (see `test_docs_build.OUTSIDE_WORDS`);
* the conformance kit's page is at most 25,000 pixels tall, opens with how to
  install the kit, and ends with its API reference and source;
* the benchmark page leads with a plot per benchmark.

The reading path is followed from the landing page to its last page with the
"next" links, every example's "Download as notebook" link is followed (the
notebook holds no path of the machine that built it), search is tried
offline, printing is checked, and the landing, Eq. (11), kit, "Why Stable"
and one example page are looked at on a phone's screen as well. Screenshots
of those pages at both widths, and a PDF print of the Eq. (11) page, are saved
into the build output (`<site>/screenshots/`).

Chromium is looked for in `$CHROMIUM`, then as Debian's `/usr/bin/chromium`,
then on the `PATH`; when there is none, these tests skip and say why.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from test_docs_build import OUTSIDE_WORDS, build_site

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]

#: Flags that keep Chromium from reaching for the network or the GPU on its own.
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-default-apps", "--disable-extensions"]


def find_chromium() -> str | None:
    """A Chromium (or Chrome) executable, or None."""
    candidates = [os.environ.get("CHROMIUM"), "/usr/bin/chromium", "/usr/bin/chromium-browser"]
    candidates += [shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome",
                                                   "google-chrome-stable")]
    for candidate in candidates:
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


CHROMIUM = find_chromium()
if CHROMIUM is None:
    pytest.skip("no Chromium executable found (install Debian's `chromium` package, e.g. "
                "`apt-get install chromium`, or set CHROMIUM=/path/to/chrome): browser tests skipped",
                allow_module_level=True)

# Playwright drives Chromium; it comes with the `browser` extra, which `make test` installs.
sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (the `browser` extra: "
                               "pip install -e '.[browser]'): browser tests skipped")
sync_playwright = sync_api.sync_playwright


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002  (the base class's parameter name)
        pass


class QuietServer(ThreadingHTTPServer):
    """Python's threading server, without a traceback for each file Chromium stops reading (a page left
    before its fonts arrive): the test's log keeps only errors of the server's own."""

    def handle_error(self, request, client_address) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):  # BrokenPipeError, ConnectionResetError, ...
            return
        super().handle_error(request, client_address)


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    """The built site served on 127.0.0.1 from a thread: (base URL, site folder)."""
    site = build_site(request.config, tmp_path_factory).require()
    httpd = QuietServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(site)))
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/", site
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        yield chromium
        chromium.close()


class Visitor:
    """One browser tab that records, per page, everything the tests look at."""

    def __init__(self, browser, base: str, width: int = 1280):
        self.base = base
        self.context = browser.new_context(viewport={"width": width, "height": 900})
        self.outside: list[str] = []
        self.console: list[str] = []
        self.context.route("**/*", self._route)
        self.page = self.context.new_page()
        self.page.on("console", lambda m: self.console.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.console.append(f"uncaught: {e}"))

    def _route(self, route):
        url = route.request.url
        if urlsplit(url).hostname == "127.0.0.1":
            route.continue_()
        else:
            self.outside.append(url)
            route.abort()

    def visit(self, path: str) -> dict:
        """Open a page and report what a reader would have seen."""
        self.outside.clear()
        self.console.clear()
        response = self.page.goto(self.base + path, wait_until="load")
        try:  # KaTeX typesets on Material's `document$`, just after the load event
            self.page.wait_for_function(
                "() => [...document.querySelectorAll('.arithmatex')].every(e => e.querySelector('.katex'))",
                timeout=10_000)
        except Exception:
            pass  # reported below as unrendered formulas
        report = self.page.evaluate(r"""() => ({
            formulas: document.querySelectorAll('.arithmatex').length,
            unrendered: [...document.querySelectorAll('.arithmatex')]
                .filter(e => !e.querySelector('.katex')).map(e => e.textContent.slice(0, 80)),
            math_errors: [...document.querySelectorAll('.katex-error, mjx-merror')]
                .map(e => e.getAttribute('title') || e.textContent.slice(0, 80)),
            images: document.images.length,
            broken_images: [...document.images].filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src),
            links: [...document.querySelectorAll('a[href]')].map(a => a.href),
            ids: [...document.querySelectorAll('[id]')].map(e => e.id),
            h1: (document.querySelector('h1') || {}).textContent || '',
            raw_tex_labels: [...document.querySelectorAll('.md-nav__link, .md-header__topic, .md-footer__title')]
                .map(e => e.textContent.replace(/\s+/g, ' ').trim()).filter(t => t.includes('\\(')),
            scrolling_code: [...document.querySelectorAll('.md-content pre > code')]
                .filter(e => Math.max(...e.textContent.split('\n').map(l => l.length)) <= 110)
                .filter(e => e.scrollWidth > e.clientWidth + 1)
                .map(e => e.textContent.split('\n').reduce((a, b) => (b.length > a.length ? b : a))),
        })""")
        report.update(self.page.evaluate(LOOK))
        report.update(path=path, status=response.status if response else None,
                      console=list(self.console), outside=list(self.outside))
        return report


#: What a reader sees on a page, beyond what loads: figures, what sticks out of the column, the sidebar.
LOOK = r"""() => {
    const article = document.querySelector('.md-content article') || document.querySelector('.md-content');
    const column = article.getBoundingClientRect();
    const figures = [...article.querySelectorAll('img')].map(img => {
        const figure = img.closest('figure');
        const caption = figure && figure.querySelector('figcaption');
        return {src: img.getAttribute('src'), alt: img.getAttribute('alt') || '',
                caption: caption ? caption.textContent.trim() : '',
                natural: img.naturalWidth, shown: img.getBoundingClientRect().width};
    });
    const scrolls = e => ['auto', 'scroll'].includes(getComputedStyle(e).overflowX);
    // Material's table wrapper scrolls with a margin of -0.8rem on each side: that much is by design.
    const slack = 0.8 * parseFloat(getComputedStyle(document.documentElement).fontSize) + 1;
    const scrolledInside = e => {
        for (let up = e; up && up !== article.parentElement; up = up.parentElement) {
            if (scrolls(up) && up.getBoundingClientRect().right <= column.right + slack) return true;
        }
        return false;
    };
    const sticking = [...article.querySelectorAll('table, pre, img, figure, .katex-display')]
        .filter(e => e.getBoundingClientRect().right > column.right + slack && !scrolledInside(e))
        .map(e => `${e.tagName.toLowerCase()} ${Math.round(e.getBoundingClientRect().right - column.right)} px: `
                  + e.textContent.slice(0, 60));
    const primary = document.querySelector('.md-sidebar--primary');
    const nav = primary ? [...primary.querySelectorAll('a.md-nav__link[href]')]
        .filter(a => !a.closest('.md-nav--secondary')) : [];
    const tall_labels = nav.filter(a => a.offsetParent !== null).filter(a => {
        const line = parseFloat(getComputedStyle(a).lineHeight) || 16;
        return a.getBoundingClientRect().height > 2.5 * line;
    }).map(a => a.textContent.trim());
    const top = document.querySelector('.md-top');
    return {
        figures, sticking,
        nav_links: nav.map(a => a.href), tall_labels,
        floating_top: !!(top && getComputedStyle(top).display !== 'none'),
        text: (document.querySelector('.md-content') || document.body).innerText,
        height: document.documentElement.scrollHeight,
        headings: [...article.querySelectorAll('h2')].map(h => [h.textContent.replace('¶', '').trim(),
                                                              h.getBoundingClientRect().top + window.scrollY]),
        page_overflow: document.documentElement.scrollWidth - window.innerWidth,
    };
}"""

#: The pages a reader is shown first, looked at on a phone's screen as well.
LOOKED_AT = ["", "paper/latent_moe/", "paper/testing/", "pages/why-stable/", "examples/10_qb_by_hand/"]


def site_pages(site: Path) -> list[str]:
    """Every page of the site as a URL path relative to its root (404.html is for the host, not a page)."""
    pages = []
    for html in sorted(site.rglob("*.html")):
        rel = html.relative_to(site).as_posix()
        if rel == "404.html" or rel.startswith("screenshots/"):
            continue
        pages.append(rel[: -len("index.html")] if rel.endswith("index.html") else rel)
    return pages


@pytest.fixture(scope="module")
def visits(server, browser):
    """Every page of the site, opened once."""
    base, site = server
    visitor = Visitor(browser, base)
    reports = {path: visitor.visit(path) for path in site_pages(site)}
    visitor.context.close()
    return reports


def html_ids(path: Path) -> set[str]:
    return set(re.findall(r"""\b(?:id|name)=["']([^"']+)["']""", path.read_text(encoding="utf-8")))


def test_every_page_answers_200(visits):
    assert len(visits) > 10
    assert {p: r["status"] for p, r in visits.items() if r["status"] != 200} == {}


def test_no_page_logs_a_console_error(visits):
    assert {p: r["console"] for p, r in visits.items() if r["console"]} == {}


def test_no_page_requests_anything_outside_127_0_0_1(visits):
    assert {p: r["outside"] for p, r in visits.items() if r["outside"]} == {}


def test_every_formula_is_rendered_without_error(visits):
    assert {p: r["unrendered"] for p, r in visits.items() if r["unrendered"]} == {}
    assert {p: r["math_errors"] for p, r in visits.items() if r["math_errors"]} == {}
    assert visits[""]["formulas"] > 10 and visits["paper/latent_moe/"]["formulas"] > 10


def test_every_image_loads(visits):
    assert {p: r["broken_images"] for p, r in visits.items() if r["broken_images"]} == {}
    assert visits[""]["images"] >= 1  # the block diagram


def test_no_label_shows_raw_latex(visits):
    """Headings with math reach the table of contents and the navigation typeset, not as `\\(...\\)`."""
    assert {p: r["raw_tex_labels"] for p, r in visits.items() if r["raw_tex_labels"]} == {}
    balancing = visits.get("paper/balancing/")
    if balancing is not None:
        assert "the-atom-of-ties-at-b_j" in balancing["ids"]


def test_code_lines_of_110_characters_show_whole(visits):
    """On a 1280-pixel screen no code block whose lines fit the project's 110 characters scrolls sideways."""
    assert {p: r["scrolling_code"] for p, r in visits.items() if r["scrolling_code"]} == {}


def test_every_content_figure_has_a_caption_and_an_alt_text(visits):
    """Each image of a page's text sits in a figure with a caption, and its alt text is several words."""
    bad = {p: [(f["src"], f["alt"][:40], f["caption"][:40]) for f in r["figures"]
               if not f["caption"] or len(f["alt"].split()) < 4] for p, r in visits.items()}
    assert {p: b for p, b in bad.items() if b} == {}
    assert sum(len(r["figures"]) for r in visits.values()) > 40


def test_every_figure_is_shown_at_six_tenths_of_its_width_or_more(visits):
    """At 1280 pixels a figure is legible: shown at 0.6 of its natural width at least (one point per figure)."""
    small = {p: [(f["src"], f["natural"], round(f["shown"])) for f in r["figures"]
                 if f["natural"] and f["shown"] < 0.6 * f["natural"]] for p, r in visits.items()}
    assert {p: s for p, s in small.items() if s} == {}


def test_nothing_reaches_past_the_text_column(visits):
    """Tables, code, formulas and figures fit the column, or scroll inside a box of their own that does."""
    assert {p: r["sticking"] for p, r in visits.items() if r["sticking"]} == {}


def test_the_sidebar_holds_at_most_60_links_each_page_once_in_short_labels(visits):
    for path, report in visits.items():
        links = [link.split("#")[0] for link in report["nav_links"]]
        assert len(links) <= 60, (path, len(links))
        assert len(links) == len(set(links)), (path, sorted(link for link in links if links.count(link) > 1))
        assert report["tall_labels"] == [], (path, report["tall_labels"])
        assert not report["floating_top"], path  # no "Back to top" pill over the text
    assert len(visits[""]["nav_links"]) >= 20


def test_no_page_cites_a_document_the_reader_lacks(visits):
    found = {p: sorted({m.group(0) for m in OUTSIDE_WORDS.finditer(r["text"])}) for p, r in visits.items()}
    found = {p: words for p, words in found.items() if words}
    assert found == {}, f"pages that cite a document the reader does not have: {found}"


def test_the_kit_page_opens_with_installing_it_and_ends_with_its_reference(visits):
    report = visits["paper/testing/"]
    assert report["height"] <= 25_000, report["height"]
    headings = [text for text, _ in report["headings"]]
    top = dict(report["headings"])
    assert headings[0] == "Install the kit in your own project", headings[:3]
    assert top["Install the kit in your own project"] < report["height"] / 4
    assert report["text"].index('pip install "refimpl[testing]"') < len(report["text"]) / 4
    assert headings.index("A complete test file") == 1
    assert headings[-2:] == ["API reference", "The source"], headings[-4:]


def test_the_benchmark_page_leads_with_a_plot_per_benchmark(visits):
    report = visits["benchmark-results/"]
    headings = [text for text, _ in report["headings"]]
    assert headings[0] == "At a glance" and "The recorded results" in headings
    plotted = [f for f in report["figures"] if f["src"].endswith(".png")]
    benchmarks = sorted((ROOT / "docs" / "benchmarks").glob("*.json"))
    assert len(plotted) >= len(benchmarks) - 1 >= 7  # one plot per benchmark (a benchmark may have none)
    assert dict(report["headings"])["At a glance"] < dict(report["headings"])["The recorded results"]


def test_the_first_pages_read_on_a_phone(server, browser):
    """On a 390-pixel screen the first pages do not scroll sideways and their figures fit."""
    base, site = server
    visitor = Visitor(browser, base, width=390)
    shots = site / "screenshots"
    shots.mkdir(exist_ok=True)
    for path in LOOKED_AT:
        report = visitor.visit(path)
        name = path.strip("/").replace("/", "-") or "landing"
        visitor.page.screenshot(path=str(shots / f"phone-{name}.png"), full_page=False)
        assert report["page_overflow"] <= 1, (path, report["page_overflow"])
        assert report["sticking"] == [], (path, report["sticking"])
        assert all(f["shown"] <= 390 for f in report["figures"]), path
    assert visitor.outside == [] and visitor.console == []
    visitor.context.close()


def test_every_example_page_downloads_its_notebook(server, browser):
    """The "Download as notebook" link of each example page serves a valid notebook with outputs, and no path
    of the machine that built it."""
    base, site = server
    visitor = Visitor(browser, base)
    pages = sorted(p.parent.name for p in (site / "examples").glob("[0-9][0-9]_*/index.html"))
    assert pages
    for stem in pages:
        visitor.visit(f"examples/{stem}/")
        link = visitor.page.query_selector("a[download]")
        assert link is not None, stem
        href = link.evaluate("a => a.href")
        assert href == f"{base}examples/{stem}.ipynb"
        response = visitor.page.request.get(href)
        assert response.status == 200, stem
        notebook = json.loads(response.body())
        assert notebook["nbformat"] == 4
        outputs = [o for c in notebook["cells"] if c["cell_type"] == "code" for o in c["outputs"]]
        assert any(o["output_type"] == "stream" for o in outputs), stem
        text = response.body().decode("utf-8")
        assert not re.search(r"/tmp/|/root\b|/home/|/work/|ipykernel_\d+|argv = \[", text), stem
        assert str(ROOT) not in text, stem
        with visitor.page.expect_download() as download:
            link.click()
        assert download.value.suggested_filename == f"{stem}.ipynb"
    assert visitor.outside == [] and visitor.console == []
    visitor.context.close()


def test_start_here_tabs_lead_to_their_pages(server, browser):
    """Each of the landing page's three reading paths is a tab whose first link opens a page of the site."""
    base, _ = server
    visitor = Visitor(browser, base)
    visitor.visit("")
    labels = visitor.page.eval_on_selector_all(".tabbed-labels label", "ls => ls.map(l => l.textContent.trim())")
    assert labels[:3] == ["Learning the layer", "Porting it to your framework", "Studying balancing"]
    for index in range(3):
        visitor.page.click(f".tabbed-labels label >> nth={index}")
        link = visitor.page.query_selector(f".tabbed-content .tabbed-block:nth-child({index + 1}) a")
        assert link is not None and link.is_visible()
        target = link.evaluate("a => a.href")
        assert target.startswith(base)
        assert visitor.page.request.get(target).status == 200
    assert visitor.outside == [] and visitor.console == []
    visitor.context.close()


def test_internal_links_and_anchors_resolve(visits, server):
    base, site = server
    ids_cache: dict[Path, set[str]] = {}
    broken: list[str] = []
    for path, report in visits.items():
        for link in report["links"]:
            if not link.startswith(base):
                continue  # the repository host and other sites are links, not requests
            parts = urlsplit(link)
            target = site / unquote(parts.path[len(urlsplit(base).path):])
            if target.is_dir() or parts.path.endswith("/"):
                target = target / "index.html"
            if not target.is_file():
                broken.append(f"{path} -> {link} (no such file)")
                continue
            fragment = unquote(parts.fragment)
            if not fragment:
                continue
            if target == site / (path + "index.html" if path.endswith("/") or not path else path):
                known = set(report["ids"])  # the live page, after its scripts ran
            else:
                known = ids_cache.setdefault(target, html_ids(target)) if target.suffix == ".html" else set()
            if target.suffix == ".html" and fragment not in known:
                broken.append(f"{path} -> {link} (no anchor #{fragment})")
    assert broken == []


def test_the_reading_path_leads_from_the_landing_page_to_its_end(server, browser):
    """Follow the footer's "next" link from the landing page; the paper's pages come in reading order."""
    base, site = server
    order = ["latent_moe", "activations", "routing", "config", "backward", "accounting", "mx", "checkpoint",
             "balancing", "dual", "histogram", "baselines", "expert_parallel", "train", "testing"]
    expected = [f"paper/{m}/" for m in order if (site / "paper" / m / "index.html").is_file()]
    visitor = Visitor(browser, base)
    visitor.visit("")
    seen = [""]
    while expected[-1] not in seen and len(seen) < 40:
        nxt = visitor.page.query_selector("a.md-footer__link--next")
        if nxt is None:
            break
        # Follow the link's own address: a click returns before its navigation starts, and a query made
        # in between meets a page that is going away.
        href = nxt.evaluate("a => a.href")
        assert href.startswith(base), href
        visitor.visit(href[len(base):])
        seen.append(visitor.page.url[len(base):])
        assert visitor.console == [] and visitor.outside == [], (seen[-1], visitor.console, visitor.outside)
    visitor.context.close()
    assert [p for p in seen if p in expected] == expected, seen
    if (site / "paper" / "histogram" / "index.html").is_file():
        assert "paper/histogram/" in seen


@pytest.mark.parametrize("query, expected", [("RMSNorm", None), ("quantile", "paper/balancing/")])
def test_search_works_offline(server, browser, query, expected):
    """Typing a word into the search box finds the page about it, with every request answered by the site."""
    base, _ = server
    visitor = Visitor(browser, base)
    visitor.visit("")
    visitor.page.click("input.md-search__input")
    visitor.page.keyboard.type(query)
    visitor.page.wait_for_selector(".md-search-result__item", timeout=15_000)
    hits = visitor.page.eval_on_selector_all(".md-search-result__item a", "links => links.map(a => a.href)")
    assert hits and all(hit.startswith(base) for hit in hits)
    if expected is not None:  # a hit is the page's address, with `?h=<query>` for highlighting and an anchor
        assert any(urlsplit(hit).path == urlsplit(base + expected).path for hit in hits), hits[:10]
    assert visitor.outside == [] and visitor.console == []
    visitor.context.close()


def test_screenshots_and_print(server, browser):
    """Screenshots of the landing and Eq. (11) pages; the Eq. (11) page prints without navigation, code wrapped."""
    base, site = server
    shots = site / "screenshots"
    shots.mkdir(exist_ok=True)
    visitor = Visitor(browser, base)
    visitor.visit("")
    visitor.page.screenshot(path=str(shots / "landing.png"), full_page=True)
    report = visitor.visit("paper/latent_moe/")
    assert "Eq. (11)" in report["h1"]
    visitor.page.screenshot(path=str(shots / "eq11-latent_moe.png"), full_page=True)
    visitor.page.emulate_media(media="print")
    printed = visitor.page.evaluate("""() => ({
        sidebars: [...document.querySelectorAll('.md-sidebar, .md-header, .md-footer')]
            .filter(e => getComputedStyle(e).display !== 'none').length,
        clipped_code: [...document.querySelectorAll('pre > code')]
            .filter(e => e.scrollWidth > e.clientWidth + 1).length,
    })""")
    assert printed == {"sidebars": 0, "clipped_code": 0}
    visitor.page.pdf(path=str(shots / "eq11-latent_moe.pdf"), format="A4")
    visitor.page.emulate_media(media="screen")
    for path in LOOKED_AT[2:]:
        visitor.visit(path)
        visitor.page.screenshot(path=str(shots / f"desk-{path.strip('/').replace('/', '-')}.png"), full_page=True)
    visitor.context.close()
    for name in ("landing.png", "eq11-latent_moe.png", "eq11-latent_moe.pdf"):
        assert (shots / name).stat().st_size > 10_000
