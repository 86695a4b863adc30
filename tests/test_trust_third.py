"""Trust, third round: what a careless user or an attacker tries, refused by name or answered right.

Each family is closed by one design decision, tested here on the cases that found it:
* a decimal in a record is reproduced to the record's own last digit (`records.decimals_agree`), so a fresh
  run that prints fewer digits cannot pass a stale record;
* the local docs server serves only regular files whose real path lies inside its folder, lists nothing, and
  answers every request;
* switches are real booleans and seeds real integers, everywhere in the public API (`refimpl._lib.values`);
* every router validates its scaling factor with one function;
* a dtype cast of weights is checked for overflow in one place, and a dtype is checked where it is taken;
* numbers at the edges (value ranges, big-endian arrays, a zero step) are refused or computed, never a raw
  error from below;
* files and command lines: a link in a checkpoint folder, an edited balancer file, a held folder.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
from conftest import ServedSite
from records import decimals_agree, same_by_meaning

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------
# The records comparator: the tolerance is the record's own last digit
# ---------------------------------------------------------------------------

@pytest.mark.parametrize(("recorded", "fresh"), [
    ("1e-12", "1e-11"), ("1e-11", "1e-12"),
    ("0.001", "0.01"), ("0.01", "0.001"),
    ("0.02", "1"), ("1", "0.02"),
    ("0.02", "0.1"),  # the fresh run prints one digit fewer: its unit gives no tolerance
    ("2.716", "2.7"), ("4.3e-10", "4e-10"),
    ("2.716", "2.7175"), ("0.5", "0.56"),
])
def test_a_decimal_printed_with_fewer_or_other_digits_does_not_pass_a_stale_record(recorded, fresh):
    assert not decimals_agree(recorded, fresh)
    assert same_by_meaning(f"error {recorded} at step 3", f"error {fresh} at step 3", "") != []


@pytest.mark.parametrize(("recorded", "fresh"), [
    ("2.716", "2.717"), ("2.716", "2.715"),  # a value on a rounding boundary prints either neighbour
    ("9.99", "10.00"), ("1.0e-11", "1.1e-11"), ("4.3e-10", "4.4e-10"),
    ("0.1", "0.10000000000000002"),  # the same number printed with all its digits
    ("2.716", "2.7165"), ("2.716", "2.71649"),  # more digits of a value that rounds to the record's
    ("1,048.5", "1,048.6"), ("-0.000", "0.000"),
])
def test_genuine_rounding_differences_agree(recorded, fresh):
    assert decimals_agree(recorded, fresh)
    assert same_by_meaning(f"error {recorded} at step 3", f"error {fresh} at step 3", "") == []


def test_an_examples_rounding_tolerance_still_widens_its_lines_only():
    line = "   largest relative difference: {}"
    assert same_by_meaning(line.format("6.4e-10"), line.format("8.6e-10"), "60_backward_by_hand") == []
    assert same_by_meaning(line.format("6.4e-10"), line.format("8.6e-10"), "") != []


# ---------------------------------------------------------------------------
# The local docs server serves only the regular files inside its folder, and answers every request
# ---------------------------------------------------------------------------

def small_site(folder: Path) -> Path:
    (folder / "assets").mkdir(parents=True)
    (folder / "page").mkdir()
    (folder / "bare").mkdir()  # a folder without index.html
    (folder / "bare" / "note.txt").write_text("inside", encoding="utf-8")
    (folder / "index.html").write_text("<p>home</p>", encoding="utf-8")
    (folder / "page" / "index.html").write_text("<p>a page</p>", encoding="utf-8")
    (folder / "assets" / "style.css").write_text("p {}", encoding="utf-8")
    (folder / "404.html").write_text("<p>not here</p>", encoding="utf-8")
    return folder


def raw_request(base: str, target: bytes) -> bytes:
    """The raw answer to `GET target`, sent byte for byte (no client library refuses or rewrites it)."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        connection.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    return answer


def status_of(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1."), answer[:200]  # an HTTP answer, not a dropped connection
    return int(answer.split(b" ", 2)[1])


def test_links_out_of_the_site_are_not_followed(tmp_path):
    site = small_site(tmp_path / "site")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("secret", encoding="utf-8")
    (outside / "index.html").write_text("secret page", encoding="utf-8")
    (site / "leak.txt").symlink_to(outside / "secret.txt")
    (site / "leakdir").symlink_to(outside, target_is_directory=True)
    (site / "assets" / "up").symlink_to(tmp_path, target_is_directory=True)
    # A link that stays inside the site is a file of the site.
    (site / "alias.css").symlink_to(site / "assets" / "style.css")
    with ServedSite(site, "/refimpl/") as running:
        for path in ("/refimpl/leak.txt", "/refimpl/leakdir/secret.txt", "/refimpl/leakdir/", "/refimpl/leakdir",
                     "/refimpl/assets/up/outside/secret.txt", "/refimpl/assets/up/"):
            status, _, body = running.get(path)
            assert (status, body) == (404, b"<p>not here</p>"), path
        assert running.get("/refimpl/alias.css")[::2] == (200, b"p {}")


def test_a_404_page_that_leads_out_of_the_site_is_not_shown(tmp_path):
    site = small_site(tmp_path / "site")
    (tmp_path / "secret.html").write_text("secret", encoding="utf-8")
    (site / "404.html").unlink()
    (site / "404.html").symlink_to(tmp_path / "secret.html")
    with ServedSite(site, "/refimpl/") as running:
        status, _, body = running.get("/refimpl/missing")
        assert status == 404 and b"secret" not in body


def test_a_folder_without_index_html_is_not_listed(tmp_path):
    with ServedSite(small_site(tmp_path / "site"), "/refimpl/") as running:
        for path in ("/refimpl/bare/", "/refimpl/bare", "/refimpl/assets/", "/refimpl/assets"):
            status, _, body = running.get(path)
            assert (status, body) == (404, b"<p>not here</p>"), path
        assert running.get("/refimpl/bare/note.txt")[::2] == (200, b"inside")
        assert running.get("/refimpl/page")[::2] == (200, b"<p>a page</p>")  # a folder with its page: redirected


def test_what_is_not_a_regular_file_is_not_served(tmp_path):
    site = small_site(tmp_path / "site")
    os.mkfifo(site / "pipe.html")  # opening it for reading would wait for a writer
    (site / "null.html").symlink_to("/dev/null")
    with ServedSite(site, "/refimpl/") as running:
        for path in ("/refimpl/pipe.html", "/refimpl/null.html"):
            assert running.get(path)[0] == 404, path


@pytest.mark.parametrize(("target", "statuses"), [
    (b"/refimpl/%00", {400}),
    (b"/refimpl/index.html%00.css", {400}),
    (b"/refimpl/%ff%fe", {400}),  # not UTF-8 once decoded
    (b"/refimpl/%c0%ae%c0%ae/secret.txt", {400}),  # an overlong UTF-8 encoding of '..'
    (b"/refimpl/%zz", {404}),
    (b"/refimpl/" + b"a" * 5000, {404}),  # a name longer than the file system allows
    (b"/refimpl/" + b"a/" * 3000, {404}),  # a path longer than the file system allows
    (b"/refimpl/" + b"a" * 70000, {414}),  # longer than a request line may be
    (b"/refimpl/../../../../etc/passwd", {404}),
    (b"/refimpl/%2e%2e/%2e%2e/etc/passwd", {404}),
    (b"//etc/passwd", {404}),
    (b"/refimpl/page/index.html", {200}),
])
def test_every_request_gets_an_answer(tmp_path, target, statuses):
    with ServedSite(small_site(tmp_path / "site"), "/refimpl/") as running:
        answer = raw_request(running.base, target)
        assert status_of(answer) in statuses, answer[:300]
        assert b"root:" not in answer
        # and the server still serves after it
        assert running.get("/refimpl/")[:1] == (200,)
