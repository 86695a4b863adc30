"""The documentation site: the page generator's rules, and a strict build that contains every promised page.

The generator (`docs/gen_pages.py`) is tested first on small made-up inputs,
where the expected Markdown is known by hand. Then the whole site is built
once with `mkdocs build --strict` (any warning fails it) into a temporary
folder, and the build is inspected: every module, example and test file has its
page, the literate pages carry rendered code and math, the K3 numbers on the
landing page are right, and nothing is loaded from outside the site. The
browser tests (`test_browser.py`) reuse the same build.
"""

from __future__ import annotations

import ast
import base64
import html
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import ServedSite, load_script

ROOT = Path(__file__).resolve().parents[1]
READING_ORDER = ["latent_moe", "activations", "routing", "config", "backward", "accounting", "mx", "checkpoint",
                 "balancing", "dual", "histogram", "baselines", "expert_parallel", "train", "testing"]
#: The stand-alone pages that open the "Studies" section, in this order (any other follows alphabetically).
STUDIES = ["why-stable", "balance-is-speed", "report-card"]


# ---------------------------------------------------------------------------
# The build, shared with the browser tests
# ---------------------------------------------------------------------------

class SiteBuild:
    """One run of `mkdocs build --strict`: where it went and what it printed."""

    def __init__(self, site: Path, returncode: int, output: str):
        self.site = site
        self.returncode = returncode
        self.output = output

    def require(self) -> Path:
        """The site folder, or a test failure that shows the build's output."""
        if self.returncode != 0:
            pytest.fail(f"mkdocs build --strict failed (exit {self.returncode}):\n{self.output[-6000:]}")
        return self.site


def build_site(config: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> SiteBuild:
    """Build the site once per test session (cached on the pytest config, so every test file shares it)."""
    cached = getattr(config, "_refimpl_site_build", None)
    if cached is not None:
        return cached
    site = tmp_path_factory.mktemp("docs") / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", DISABLE_MKDOCS_2_WARNING="true")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    build = SiteBuild(site, proc.returncode, proc.stdout + proc.stderr)
    config._refimpl_site_build = build
    return build


@pytest.fixture(scope="session")
def site_build(request, tmp_path_factory) -> SiteBuild:
    return build_site(request.config, tmp_path_factory)


@pytest.fixture(scope="session")
def site(site_build) -> Path:
    return site_build.require()


# ---------------------------------------------------------------------------
# What the repository says the site must contain
# ---------------------------------------------------------------------------

def existing_modules() -> list[str]:
    """Modules and subpackages of `refimpl/`, found by looking at the files."""
    names = [p.stem for p in (ROOT / "refimpl").glob("*.py") if p.stem != "__init__"]
    names += [p.parent.name for p in (ROOT / "refimpl").glob("*/__init__.py")]
    return sorted(names)


def module_docstring(name: str) -> str:
    path = ROOT / "refimpl" / f"{name}.py"
    if not path.is_file():
        path = ROOT / "refimpl" / name / "__init__.py"
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""


def examples() -> list[Path]:
    return sorted((ROOT / "examples").glob("[0-9][0-9]_*.py"))


def sources_of_tests() -> list[Path]:
    return sorted((ROOT / "tests").glob("test_*.py"))


def page(site: Path, *parts: str) -> str:
    return (site.joinpath(*parts) / "index.html").read_text(encoding="utf-8")


def visible_text(markup: str) -> str:
    """The text of an HTML fragment, tags removed, entities decoded, whitespace collapsed."""
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", markup))).strip()


# ---------------------------------------------------------------------------
# The generator's rules, on made-up inputs
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gen():
    """`docs/gen_pages.py`, imported without running it."""
    return load_script(ROOT / "docs" / "gen_pages.py", "refimpl_docs_gen_pages")


SAMPLE = textwrap.dedent('''\
    r"""Eq. (99): a sample module.

    Prose of the module, with $x^2$.
    """

    import math

    # ---------------------------------------------------------------------------
    # Helpers
    # ---------------------------------------------------------------------------

    def double(x: float) -> float:
        """Twice `x`.

        Parameters
        ----------
        x : float
            The value.
        """
        # The factor: $$y = 2x$$
        y = 2 * x  # a trailing comment stays in the code
        return y


    def _private(z):
        return math.sqrt(z)
    ''')


def test_literate_title_and_intro_come_from_the_module_docstring(gen):
    page = gen.literate(SAMPLE)
    assert page.title == "Eq. (99): a sample module"
    assert "Prose of the module, with $x^2$." in page.intro


def test_the_reading_path_says_each_reference_once(gen):
    """A line of the landing page's reading path does not repeat its label ("Configuration: Configuration: ...")."""
    assert gen.without_repeated_head("Configuration", "Configuration: the numbers") == "the numbers"
    assert gen.without_repeated_head("Eq. (13): routing", "Eq. (13): sigmoid scores") == "sigmoid scores"
    assert gen.without_repeated_head("Eq. (12) & App. B: SiTU-GLU", "Eq. (12) and Appendix B: SiTU-GLU, bounded") \
        == "bounded"
    assert gen.without_repeated_head("The layer: Eqs. (11)-(13)", "The layer: Eqs. (11)-(13), the block") == "the block"
    assert gen.without_repeated_head("Accounting", "The other routers and balancers") == \
        "The other routers and balancers"
    assert gen.without_repeated_head("The layer", "Eq. (11): the forward pass") == "Eq. (11): the forward pass"
    text = gen.reading_path(gen.discover_modules(), compare=False)
    repeats = [line for line in text.splitlines()  # the label, then a first clause that the label already holds
               if (m := re.match(r"1\. \[([^\]]+)\]\([^)]*\): (.+?)(?:[:,] |\.$)", line)) and m[2] in m[1]]
    assert "[Configuration]" in text and repeats == []


def test_learning_the_layer_starts_at_eq_11_and_measures_after_the_equations(gen):
    """The first reading path opens with Eq. (11); "Why Stable" comes after Eqs. (11)-(13), which it measures."""
    heading, _, steps = gen.START_HERE[0]
    names = [name for _, name, _ in steps]
    assert heading == "Learning the layer" and names[0] == "latent_moe"
    assert all(names.index(eq) < names.index("why-stable") for eq in ("latent_moe", "activations", "routing"))


def test_literate_standalone_comments_become_prose_and_display_math(gen):
    body = gen.literate(SAMPLE).body
    assert "The factor:\n\n$$\ny = 2x\n$$" in body
    code_blocks = re.findall(r"```python\n(.*?)```", body, flags=re.S)
    assert any("y = 2 * x  # a trailing comment stays in the code" in block for block in code_blocks)
    assert not any("The factor" in block for block in code_blocks)


def test_literate_ruler_comments_become_a_section_heading(gen):
    body = gen.literate(SAMPLE).body
    assert "## Helpers" in body
    assert "# ----" not in body


def test_literate_docstrings_become_prose_under_a_linkable_heading(gen):
    body = gen.literate(SAMPLE).body
    heading = body.index("### `double` { #double }")
    prose = body.index("Twice `x`.")
    code = body.index("def double(x: float) -> float:")
    assert heading < prose < code
    assert '"""Twice' not in body
    assert "**Parameters**" in body and "- `x` (*float*): The value." in body
    assert "_private" in body and "### `_private`" not in body  # private names get no heading


def test_literate_pages_fold_the_opening_imports_to_the_end(gen):
    """The import block does not open the page: the first code is the first idea, the imports come last, folded."""
    body = gen.literate(SAMPLE).body
    assert body.index("## Helpers") < body.index("def double") < body.index("import math")
    fold = body[body.index('??? note "The imports and exports this file opens with"'):]
    assert "    ```python\n    import math\n    ```" in fold
    assert "import math" not in gen.literate(SAMPLE, fold_preamble=False).body.split("## Helpers")[1]


def test_an_all_list_after_other_code_is_folded_too(gen):
    source = 'import math\n\nArray = float  # a type alias\n\n__all__ = ["Array"]\n\n\ndef f():\n    return 1\n'
    body = gen.literate(source).body
    fold = body.index("??? note")
    assert "Array = float" in body[:fold] and "__all__" not in body[:fold]
    assert "import math" in body[fold:] and '__all__ = ["Array"]' in body[fold:]


def test_study_pages_come_in_the_defined_order_then_alphabetically(gen, tmp_path, monkeypatch):
    for slug in ("zeta", "report-card", "alpha", "why-stable"):
        (tmp_path / f"{slug}.md").write_text(f"# Title of {slug}\n\nText.\n", encoding="utf-8")
    (tmp_path / "untitled.md").write_text("No title line.\n", encoding="utf-8")
    monkeypatch.setattr(gen, "PAGES", tmp_path)
    pages = gen.study_pages()
    assert list(pages) == ["why-stable", "report-card", "alpha", "zeta"]
    assert pages["alpha"][0] == "Title of alpha"


def test_start_here_links_only_to_pages_that_exist(gen):
    modules = {name: gen.Module(name, [gen.PACKAGE / f"{name}.py"]) for name in ("routing", "balancing")}
    text = gen.start_here(modules, {"10_qb_by_hand"}, {"report-card": ("The report card", Path("x.md"))})
    assert '=== "Learning the layer"' in text and '=== "Studying balancing"' in text
    assert "(paper/routing.md)" in text and "(paper/balancing.md)" in text
    assert "(examples/10_qb_by_hand.md)" in text and "(pages/report-card.md)" in text
    assert "paper/checkpoint.md" not in text and "examples/01_forward_by_hand.md" not in text
    assert "pages/why-stable.md" not in text


def test_literate_test_methods_get_class_qualified_anchors(gen):
    source = textwrap.dedent('''\
        class TestThing:
            def test_one(self):
                """One holds."""
                assert 1
        ''')
    body = gen.literate(source, test_file=True).body
    assert "#### `TestThing.test_one` { #TestThing-test_one }" in body


def test_display_math_inside_a_list_item_stays_in_the_item(gen):
    text = "* a point:\n  $$a = b$$\n  more."
    assert gen.normalize_display_math(text) == "* a point:\n\n    $$\n    a = b\n    $$\n\n    more."


def test_multiline_display_math_gets_blank_lines_around_it(gen):
    text = "Text before\n$$\nx = 1\n$$\nText after"
    assert gen.normalize_display_math(text) == "Text before\n\n$$\nx = 1\n$$\n\nText after"


def test_fence_outgrows_backticks_in_the_text(gen):
    assert gen.fence("a ```b``` c", "text").startswith("````text\n")


def test_test_cases_are_listed_with_their_first_docstring_line(gen, tmp_path):
    path = tmp_path / "test_sample.py"
    path.write_text('def test_a():\n    """A holds.\n\n    More."""\n\ndef test_b_c():\n    pass\n\n'
                    'class TestX:\n    def test_y(self):\n        pass\n', encoding="utf-8")
    cases = [(c.qualname, c.anchor, c.summary) for c in gen.cases_in(path)]
    assert cases == [("test_a", "test_a", "A holds."), ("test_b_c", "test_b_c", "B c"),
                     ("TestX.test_y", "TestX-test_y", "Y")]


def test_docstrings_have_no_escape_accidents():
    """LaTeX in a docstring needs a raw string: in a plain one `\\alpha` becomes a bell character and `lpha`."""
    accidents = []
    for path in sorted([*(ROOT / "refimpl").rglob("*.py"), *(ROOT / "examples").glob("*.py")]):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node, clean=False) or ""
                if re.search(r"[\x07\x08\x0b\x0c]", doc):
                    accidents.append(f"{path.relative_to(ROOT)}: {getattr(node, 'name', 'module docstring')}")
    assert accidents == []


PNG_1x1 = bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010806000000"
                        "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082")


def made_up_record(folder: Path) -> Path:
    """A made-up example whose script fails when run, and its record (a notebook with text and a figure)."""
    script = folder / "09_demo.py"
    script.write_text('r"""A demo.\n\nIts intro.\n"""\n\nraise SystemExit("examples are never run to build the site")\n',
                      encoding="utf-8")
    figure = {"output_type": "display_data", "data": {"image/png": base64.b64encode(PNG_1x1).decode(),
                                                       "text/plain": "<plot.png>"},
              "metadata": {"refimpl": {"filename": "plot.png", "caption": "What to see in the plot.",
                                       "alt": "A plot of one thing against another"}}}
    caption = {"output_type": "display_data", "data": {"text/markdown": "*What to see in the plot.*"},
               "metadata": {"refimpl": {"caption_of": "plot.png"}}}
    cells = [
        {"cell_type": "markdown", "metadata": {}, "source": "# A demo\n\nIts intro."},
        {"cell_type": "markdown", "metadata": {"refimpl": "note"}, "source": "*Made from the script.*"},
        {"cell_type": "code", "metadata": {}, "execution_count": 1, "outputs": [],
         "source": "def helper(x):\n    return 2 * x"},
        {"cell_type": "markdown", "metadata": {"refimpl": "step"}, "source": "## Step 1: the table"},
        {"cell_type": "code", "metadata": {}, "execution_count": 2, "source": "print('printed')",
         "outputs": [{"output_type": "stream", "name": "stdout", "text": "printed\n"}, figure, caption]},
        {"cell_type": "code", "metadata": {}, "execution_count": 3, "source": "print(report)",
         "outputs": [{"output_type": "stream", "name": "stdout",
                      "text": "Summary line\nrow 1\n\n" + "=" * 20 + "\nA mistake: its doc\n" + "=" * 20 +
                              "\nits report\n"}]},
    ]
    record = {"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    script.with_suffix(".ipynb").write_text(json.dumps(record), encoding="utf-8")
    return script


def test_an_example_page_is_rendered_from_its_record_without_running_it(gen, tmp_path, monkeypatch):
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    script = made_up_record(tmp_path)
    record = gen.read_record(script)
    assert record.stdout.startswith("printed\n") and list(record.figures) == ["plot.png"]
    assert record.figures["plot.png"].data == PNG_1x1 and (record.figures["plot.png"].width,
                                                            record.figures["plot.png"].height) == (1, 1)
    page = gen.example_page(script, record)
    assert page.startswith("# A demo\n") and "Its intro." in page and "Made from the script" not in page
    assert "[Download as notebook](09_demo.ipynb)" in page
    assert "### Step 1: the table" in page  # steps sit under "The run, step by step"
    assert page.index("print('printed')") < page.index("```text\nprinted\n```") < page.index("plot.png")
    assert '<figure class="refimpl-figure" markdown="span">' in page
    assert '![A plot of one thing against another](09_demo/plot.png){ width="1" height="1" }' in page
    assert "<figcaption>What to see in the plot.</figcaption>" in page
    assert page.count("What to see in the plot.") == 1  # the notebook's caption output is not shown twice
    assert '??? abstract "Defines `helper`"' in page  # a cell of definitions only is folded
    assert "examples are never run" in page.split("## Source")[1]  # the script's source comes last


def test_a_missing_record_is_a_warning_that_says_how_to_make_it(gen, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    script = made_up_record(tmp_path)
    script.with_suffix(".ipynb").unlink()
    with caplog.at_level("WARNING"):
        assert gen.read_record(script) is None
    assert "make records" in caplog.text and "09_demo" in caplog.text


def test_markers_embed_what_the_records_hold(gen, tmp_path, monkeypatch):
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    record = gen.read_record(made_up_record(tmp_path))
    text = ("A <!-- refimpl:example-output 09_demo -->\n"
            "B <!-- refimpl:example-figure 09_demo/plot.png -->\n"
            "C <!-- refimpl:example-block 09_demo \"A mistake\" -->\n"
            "    <!-- refimpl:example-block 09_demo \"Summary\" -->\n")
    out = gen.expand_markers(text, {"09_demo": record}, "page.md", prefix="../")
    assert out.startswith("A ```text\nprinted\nSummary line\n")
    assert "![A plot of one thing against another](../examples/09_demo/plot.png)" in out
    assert "C ```text\nits report\n```" in out
    assert "    ```text\n    Summary line\n    row 1\n    ```" in out  # an indented marker stays indented


def test_navigation_labels_of_examples_are_short(gen):
    assert gen.nav_label(Path("10_qb_by_hand.py"), "Quantile Balancing by hand: twelve tokens") == \
        "10 Quantile Balancing by hand"
    assert gen.nav_label(Path("99_x.py"), "Error against the number of bins, and bytes against the batch size") == \
        "99 Error against the number of bins"
    for path in examples():
        title = gen.example_title(path)[0]
        assert len(gen.nav_label(path, title)) <= 34, title


def test_benchmark_json_becomes_tables(gen):
    text = gen.json_to_markdown({"machine": "box", "runs": [{"m": 1, "s": 0.5}, {"m": 2, "s": 0.25}]})
    assert "| machine | box |" in text
    assert "| m | s |" in text and "| 2 | 0.25 |" in text


# ---------------------------------------------------------------------------
# The built site
# ---------------------------------------------------------------------------

@pytest.mark.slow
def test_the_site_builds_with_no_warning(site_build):
    site_build.require()
    warnings = [line for line in site_build.output.splitlines() if re.match(r"^(WARNING|ERROR)\s+-", line)]
    assert warnings == []


@pytest.mark.slow
def test_every_expected_page_exists(site):
    modules = existing_modules()
    expected = ["", "examples", "reference", "benchmark-results"]
    expected += [f"paper/{m.lstrip('_')}" for m in modules] + [f"reference/{m.lstrip('_')}" for m in modules]
    expected += [f"examples/{p.stem}" for p in examples()] + [f"tests/{p.stem}" for p in sources_of_tests()]
    missing = [p for p in expected if not (site / p / "index.html").is_file()]
    assert missing == []
    assert (site / "404.html").is_file()
    index = json.loads((site / "search" / "search_index.json").read_text(encoding="utf-8"))
    assert {"paper/latent_moe/", "paper/routing/"} <= {doc["location"].split("#")[0] for doc in index["docs"]}


@pytest.mark.slow
def test_the_navigation_follows_the_reading_order(site):
    markup = page(site, "")
    present = [m for m in READING_ORDER if m in existing_modules()]
    positions = [markup.index(f'href="paper/{m}/"') for m in present]
    assert positions == sorted(positions)


@pytest.mark.slow
@pytest.mark.parametrize("module", [m for m in existing_modules()])
def test_literate_pages_show_prose_code_and_math(site, module):
    markup = page(site, "paper", module.lstrip("_"))
    doc = module_docstring(module)
    title = doc.split("\n")[0].strip().rstrip(".")
    h1 = re.search(r"<h1[^>]*>(.*?)</h1>", markup, flags=re.S)
    assert h1 and visible_text(h1.group(1)).rstrip("¶").strip() == visible_text(html.escape(title)) or not title
    assert 'class="language-python highlight"' in markup or '<div class="language-python highlight">' in markup
    if "$" in doc:
        assert 'class="arithmatex"' in markup


@pytest.mark.slow
def test_module_pages_link_every_test_to_its_anchor(site):
    for module in existing_modules():
        slug = module.lstrip("_")
        for path in sorted({*(ROOT / "tests").glob(f"test_{slug}.py"), *(ROOT / "tests").glob(f"test_{slug}_*.py")}):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            names = [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test")]
            markup = page(site, "paper", slug)
            target = page(site, "tests", path.stem)
            assert "Properties the tests check" in markup
            for name in names:
                assert f'href="../../tests/{path.stem}/#{name}"' in markup, (module, name)
                assert f'id="{name}"' in target, (path.name, name)


@pytest.mark.slow
def test_section_fragments_are_appended_to_their_module_page(site):
    for fragment in sorted((ROOT / "docs" / "sections").glob("*.md")):
        module = fragment.stem
        if module not in {m.lstrip("_") for m in existing_modules()}:
            continue
        headings = re.findall(r"^#{1,6} (.+)$", fragment.read_text(encoding="utf-8"), flags=re.M)
        markup = visible_text(page(site, "paper", module))
        for heading in headings[:3]:
            words = re.sub(r"[`*_$\\{}]", "", heading).split()[:4]
            assert " ".join(words) in re.sub(r"[`*_$\\{}]", "", markup), (fragment.name, heading)


@pytest.mark.slow
@pytest.mark.parametrize("script", examples(), ids=lambda p: p.stem)
def test_example_pages_show_their_record(site, script):
    """The page shows what the record printed and every figure it holds, each with its caption."""
    markup = page(site, "examples", script.stem)
    assert 'id="the-run"' in markup and 'class="language-text highlight"' in markup
    record = json.loads(script.with_suffix(".ipynb").read_text(encoding="utf-8"))
    printed = [o["text"] if isinstance(o["text"], str) else "".join(o["text"]) for c in record["cells"]
               if c["cell_type"] == "code" for o in c["outputs"] if o.get("name") == "stdout"]
    shown = visible_text(markup)
    for text in printed:
        first = next((line for line in text.split("\n") if line.strip()), "")
        assert visible_text(html.escape(first)) in shown, first
    figures = [o["metadata"]["refimpl"] for c in record["cells"] if c["cell_type"] == "code"
               for o in c["outputs"] if o.get("metadata", {}).get("refimpl", {}).get("filename")]
    for meta in figures:
        assert f'src="{meta["filename"]}"' in markup, meta["filename"]
        assert (site / "examples" / script.stem / meta["filename"]).is_file()
        assert visible_text(html.escape(meta["caption"])) in shown
    if script.stem == "40_compare_variants":
        assert sorted(m["filename"] for m in figures) == ["half_precision.png", "output_scale.png"]


@pytest.mark.slow
def test_literate_pages_open_with_an_idea_not_with_imports(site):
    """Outside the folded block, no code on a module's page is the file's opening import block or `__all__`."""
    for module in existing_modules():
        path = ROOT / "refimpl" / f"{module}.py"
        path = path if path.is_file() else ROOT / "refimpl" / module / "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"))
        statements = tree.body[1:] if ast.get_docstring(tree) is not None else tree.body
        if not statements or not isinstance(statements[0], ast.Import | ast.ImportFrom):
            continue
        opening = ast.unparse(statements[0])
        markup = page(site, "paper", module.lstrip("_"))
        article = markup[markup.index("<article"):]
        unfolded = re.sub(r"<details.*?</details>", "", article, flags=re.S)
        blocks = [visible_text(b) for b in re.findall(r'<div class="language-python highlight">(.*?)</div>',
                                                       unfolded, flags=re.S)]
        assert not any(b.startswith(visible_text(opening)) for b in blocks), module
        assert not any("__all__ =" in b for b in blocks), module
        folded = re.findall(r"<details.*?</details>", article, flags=re.S)
        assert any(visible_text(opening) in visible_text(d) for d in folded), module


@pytest.mark.slow
@pytest.mark.parametrize("script", examples(), ids=lambda p: p.stem)
def test_example_pages_offer_their_record_as_the_notebook(site, script):
    markup = page(site, "examples", script.stem)
    assert f'download="{script.stem}.ipynb" href="../{script.stem}.ipynb"' in markup
    assert "Download as notebook" in markup
    served = site / "examples" / f"{script.stem}.ipynb"
    assert served.read_bytes() == script.with_suffix(".ipynb").read_bytes()


@pytest.mark.slow
def test_the_build_runs_no_example_and_says_what_it_does(site_build):
    """The generator logs its stages, and builds every example page from its record (no example is run)."""
    output = site_build.output
    assert "no example is run" in output and "mkdocs now renders the pages" in output
    assert re.search(r"rendered \d+ of \d+ pages", output)


@pytest.mark.slow
def test_study_pages_are_built_and_listed_in_order(site):
    slugs = sorted(p.stem for p in (ROOT / "docs" / "pages").glob("*.md")) if (ROOT / "docs" / "pages").is_dir() else []
    order = [s for s in STUDIES if s in slugs] + [s for s in slugs if s not in STUDIES]
    markup = page(site, "")
    for slug in order:
        assert (site / "pages" / slug / "index.html").is_file(), slug
        assert "refimpl:example-" not in page(site, "pages", slug)  # every marker expanded
    positions = [markup.index(f'href="pages/{slug}/"') for slug in order]
    assert positions == sorted(positions)


@pytest.mark.slow
def test_landing_page_offers_three_reading_paths(site):
    text = visible_text(page(site, ""))
    for path in ("Learning the layer", "Porting it to your framework", "Studying balancing"):
        assert path in text
    assert text.index("Start here") < text.index("Why a latent routed path")


@pytest.mark.slow
def test_landing_page_numbers_are_the_k3_numbers(site):
    """Checked against the arithmetic of the configuration, done here by hand."""
    d, ell, n, k, f, shared, layers = 7168, 3584, 896, 16, 3072, 2 * 3072, 92
    expert = 3 * ell * f
    activated = k * expert + 3 * d * shared + 2 * d * ell
    text = visible_text(page(site, ""))
    for value in (expert, n * expert, layers * n * expert, activated, n * d, k * ell, 2 * k * ell):
        assert f"{value:,}" in text, value
    assert "33.86 vs. 33.15" in text
    assert 'src="assets/stable-latent-moe.svg"' in page(site, "")


@pytest.mark.slow
def test_the_site_loads_nothing_from_outside(site):
    """No script, style, font or image comes from another host; the KaTeX fonts are all there."""
    external = re.compile(r"""<(?:script|img|iframe|source)\b[^>]*\bsrc=["'](?:https?:)?//|"""
                          r"""<link\b(?![^>]*rel="canonical")[^>]*\bhref=["'](?:https?:)?//""", re.I)
    offenders = [str(p.relative_to(site)) for p in site.rglob("*.html")
                 if external.search(p.read_text(encoding="utf-8"))]
    assert offenders == []
    for css in site.rglob("*.css"):
        assert not re.search(r"url\(\s*[\"']?(?:https?:)?//", css.read_text(encoding="utf-8")), css
    katex_css = (site / "assets" / "katex" / "katex.min.css").read_text(encoding="utf-8")
    fonts = set(re.findall(r"url\((fonts/[^)]+)\)", katex_css))
    assert fonts and all((site / "assets" / "katex" / font).is_file() for font in fonts)


# ---------------------------------------------------------------------------
# Words from outside the project, and the kit's page
# ---------------------------------------------------------------------------

#: The words that cite documents a reader of the site does not have: the project's own plan (its name in
#: capitals, its section numbers) and the notes the project grew from (the textbook one, its checklist, its
#: source tag). A paper's own section, "Switch Transformers (JMLR 2022), \u00a72.2", is a citation a reader
#: can follow. The words are spelled in pieces here, so that this file's own page does not cite them.
CAPS, SECTION, SEED, SPEC_WORD = "SP" + "EC", "\u00a7", "se" + "ed", "sp" + "ec"
OUTSIDE_WORDS = re.compile(
    rf"(?-i:\b{CAPS}\b)|(?<!\), ){SECTION}\s*\d|\bof the {SPEC_WORD}\b|textbook {SEED}|{SEED} documents?"
    rf"|(?<=\s)\[{SEED}\]|\bK3 {SEED}\b|\bthe {SEED}s'|\b{SEED}s' other"
    rf"|\b{SEED}'s (checklist|claim|asserts?|sketch|chapter|notes)"
    rf"|\bthe {SEED}s? (notes?|refers|says|do(es)? not (say|state)|asserts?|pins|gives|reports|summarizes)\b",
    re.I)


def outside_words_in(markup: str) -> list[str]:
    """The words of a page's text (scripts and tags left out) that cite a document the reader does not have."""
    text = visible_text(re.sub(r"<script.*?</script>", " ", markup, flags=re.S))
    return sorted({m.group(0) for m in OUTSIDE_WORDS.finditer(text)})


def test_the_outside_words_are_recognized():
    for text in (f"see {CAPS} {SECTION}3", f"the textbook {SEED} says", f"the {SEED}'s checklist",
                 f"not published [{SEED}]", f"{SECTION}9.1 of the {SPEC_WORD}", f"the {SEED}s' other systems",
                 f"the {SEED} refers to MegaMoE", f"the {SEED}s do not state one"):
        assert outside_words_in(f"<p>{text}</p>"), text
    for text in ("from seeds 0, 1 and 2", "the seed sets the initial weights", "runs[label][seed]",
                 f"Switch Transformers (JMLR 2022), {SECTION}2.2", "a spec sheet", "the random seed of the weights",
                 "spectrum", "the OCP Microscaling specification"):
        assert not outside_words_in(f"<p>{text}</p>"), text


def test_hand_written_pages_show_example_figures_through_the_marker():
    """A figure of an example comes from its record (with its caption and alt text), never from a bare image link."""
    bare = {}
    for path in sorted([*(ROOT / "docs" / "pages").glob("*.md"), *(ROOT / "docs" / "sections").glob("*.md")]):
        links = re.findall(r"!\[[^\]]*\]\([^)]*examples/[^)]*\)", path.read_text(encoding="utf-8"))
        if links:
            bare[path.name] = links
    assert bare == {}, "use <!-- refimpl:example-figure NN_slug/name.png --> instead of: " + repr(bare)


@pytest.mark.slow
def test_no_page_cites_a_document_the_reader_lacks(site):
    found = {}
    for path in sorted(site.rglob("*.html")):
        rel = path.relative_to(site).as_posix()
        key = rel[: -len("index.html")] if rel.endswith("index.html") else rel
        words = outside_words_in(path.read_text(encoding="utf-8"))
        if words:
            found[key] = words
    assert found == {}


@pytest.mark.slow
def test_the_kit_page_opens_with_installing_it_and_ends_with_its_reference_and_source(site):
    markup = page(site, "paper", "testing")
    headings = [visible_text(h).rstrip("¶").strip() for h in re.findall(r"<h2[^>]*>(.*?)</h2>", markup, flags=re.S)]
    assert headings[:2] == ["Install the kit in your own project", "A complete test file"], headings[:3]
    assert headings[-2:] == ["API reference", "The source"], headings[-3:]
    text = visible_text(markup[markup.index("<article"):])  # the page's text, not its table of contents
    assert text.index('pip install "refimpl[testing]"') < text.index("A complete test file")
    # The kit's source is folded at the end: no code of checks.py before "The source".
    code = re.search(r"def\s+check_router\s*\(", text)
    assert code and code.start() > text.rindex("The source")


def test_the_kit_pages_complete_test_file_passes_under_pytest(tmp_path):
    """The test file the kit's page tells a user to save runs, with pytest, in a folder of its own."""
    fragment = (ROOT / "docs" / "sections" / "testing.md").read_text(encoding="utf-8")
    section = fragment.split("## A complete test file", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_my_router.py").write_text(code, encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "2 passed" in proc.stdout


def test_generated_tables_are_tables_on_the_page(site):
    """The blocks that print a table from the code (the catalogue, the configuration synonyms) are replaced by
    the table they print: no page shows the block's source."""
    from refimpl.config import HF_SYNONYMS
    from refimpl.testing.conventions import CATALOGUE

    pages = [p for p in site.rglob("index.html") if "tests" not in p.relative_to(site).parts[:1]]
    assert not [p for p in pages if 'exec="on"' in p.read_text(encoding="utf-8")]  # (test pages quote it)
    conventions = next(p for p in pages if p.parent.name == "conventions").read_text(encoding="utf-8")
    assert "<table>" in conventions
    assert all(f"<code>{entry.name}</code>" in conventions for entry in CATALOGUE)
    config_pages = [p.read_text(encoding="utf-8") for p in pages if "HF_SYNONYMS" in p.read_text(encoding="utf-8")]
    found = next(iter(HF_SYNONYMS))
    assert any(f"<td><code>{found}</code></td>" in page for page in config_pages)


#: The main function of each page of the paper's equations: the page reads top-down when it comes first.
MAIN_FUNCTIONS = {"layer/routing.py": "route", "layer/latent_moe.py": "stable_latent_moe",
                  "layer/activations.py": "situ_glu", "layer/backward.py": "stable_latent_moe_vjp",
                  "balancing/quantile.py": "quantile_balancing_update", "balancing/histogram.py": "BiasHistogram"}


@pytest.mark.parametrize("module", sorted(MAIN_FUNCTIONS))
def test_a_paper_page_opens_with_its_main_function_before_its_helpers(module):
    """The literate page follows the file: the first definition of the file is the one the section is about."""
    import ast

    tree = ast.parse((ROOT / "refimpl" / module).read_text(encoding="utf-8"))
    first = next(node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.ClassDef))
    assert first == MAIN_FUNCTIONS[module]


#: Words a reader cannot follow: the host's load, the history of the code, a target without its owner.
#: (Split in two, so that this file's own page, which shows its source, does not hold them.)
UNFOLLOWABLE = tuple(" ".join(pair) for pair in (("load", "average"), ("spec", "section"), ("used to", "select"),
                                                   ("an earlier", "reading"), ("this", "release's"),
                                                   ("target is", "met")))


@pytest.mark.slow
def test_no_page_speaks_of_the_hosts_load_or_the_codes_history(site):
    found = {}
    for path in sorted(site.rglob("*.html")):
        if path.name == "404.html":
            continue
        article = path.read_text(encoding="utf-8")
        start = article.find("<article")
        text = visible_text(article[start:] if start >= 0 else article).lower()
        words = [w for w in UNFOLLOWABLE if w in text]
        if words:
            found[path.relative_to(site).as_posix()] = words
    assert found == {}


def _prose_of(markup: str) -> str:
    """A page's visible prose: its article without code, math, scripts or the table of contents."""
    start = markup.find("<article")
    article = markup[start:] if start >= 0 else markup
    for tag in ("pre", "code", "script", "style"):
        article = re.sub(rf"<{tag}\b.*?</{tag}>", " ", article, flags=re.S)
    article = re.sub(r'<span class="arithmatex">.*?</span>', " ", article, flags=re.S)
    article = re.sub(r'<div class="arithmatex">.*?</div>', " ", article, flags=re.S)
    return visible_text(article)


@pytest.mark.slow
def test_no_page_shows_raw_markdown_outside_code(site):
    """A fence, a bold marker, a link's bracket-paren or an exec block left as text means a page did not render."""
    raw = re.compile(r"```|\*\*\S|\S\*\*|\]\(|exec=\"on\"")
    found = {}
    for path in sorted(site.rglob("index.html")):
        rel = path.relative_to(site).as_posix()
        if rel.startswith("tests/"):
            continue  # a test page shows its source, which quotes such text on purpose
        hits = [m.group(0) for m in raw.finditer(_prose_of(path.read_text(encoding="utf-8")))]
        if hits:
            found[rel] = hits[:5]
    assert found == {}


@pytest.mark.slow
def test_each_report_box_of_the_kit_page_holds_its_own_entrys_report(site, gen):
    """Each "The report the kit prints" box shows the report example 31 printed under its own section's title."""
    record = gen.read_record(ROOT / "examples" / "31_mistakes_the_kit_catches.py")
    markup = page(site, "paper", "testing")
    sections = re.split(r"(?=<h[23][ >])", markup)  # each section from its heading to the next
    boxes = [(re.match(r"<h3[^>]*>(.*?)</h3>", part, flags=re.S).group(1),
              re.search(r"<summary>The report the kit prints</summary>(.*?)</details>", part, flags=re.S).group(1))
             for part in sections if part.startswith("<h3") and "<summary>The report the kit prints</summary>" in part]
    assert len(boxes) >= 10
    for heading, box in boxes:
        # The section's title as the example prints it: math rendered on the page is plain text in a console.
        title = re.sub(r"\\\(|\\\)", "", visible_text(heading).rstrip("¶")).replace(" -th", "-th").strip()
        own = gen.output_block(record.stdout, title)
        assert own is not None, title
        assert visible_text(box) == visible_text(html.escape(own)), (title, visible_text(box)[:120])
    assert len({visible_text(box) for _, box in boxes}) == len(boxes)  # no two boxes show the same report


@pytest.mark.slow
def test_the_404_page_loads_everything_it_links_when_served_as_make_serve_serves_it(site):
    """`404.html` links absolutely (`/refimpl/...`); under `make serve`'s server each link of it answers."""
    with ServedSite(site) as served:
        status, _, body = served.get("/refimpl/paper/no-such-page/")
        assert status == 404
        text = body.decode("utf-8")
        assert "404" in visible_text(text)
        links = sorted(set(re.findall(r'(?:href|src)="(/refimpl/[^"#?]*)', text)))
        assert any(link.endswith(".css") for link in links) and any(link.endswith(".js") for link in links)
        broken = [(link, code) for link in links if (code := served.get(link)[0]) != 200]
        assert broken == []
