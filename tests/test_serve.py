"""`make serve`'s server (`docs/serve.py`): the site under the path of `site_url`, `404.html` for what is missing.

MkDocs writes `404.html` with absolute links (`/refimpl/...`) so that the host can show it at any depth. These
tests serve a small site and the real one and follow those links: the page the server sends for a missing
address must load its stylesheets and scripts, as it does on the host.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import ServedSite, load_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def serve():
    return load_script(ROOT / "docs" / "serve.py", "refimpl_docs_serve")


def small_site(folder: Path) -> Path:
    (folder / "assets").mkdir(parents=True)
    (folder / "page").mkdir()
    (folder / "index.html").write_text("<p>home</p>", encoding="utf-8")
    (folder / "page" / "index.html").write_text("<p>a page</p>", encoding="utf-8")
    (folder / "assets" / "style.css").write_text("p {}", encoding="utf-8")
    (folder / "404.html").write_text('<link rel="stylesheet" href="/refimpl/assets/style.css"><p>not here</p>',
                                     encoding="utf-8")
    return folder


def test_the_prefix_is_the_path_of_site_url(serve, tmp_path):
    assert serve.site_prefix() == "/refimpl/"  # mkdocs.yml's site_url is https://refimpl.github.io/refimpl/
    config = tmp_path / "mkdocs.yml"
    for url, prefix in (("https://example.org/", "/"), ("https://example.org", "/"),
                        ("https://example.org/a/b", "/a/b/"), ("http://127.0.0.1:8000/docs/", "/docs/")):
        config.write_text(f"site_name: x\nsite_url: {url}\n", encoding="utf-8")
        assert serve.site_prefix(config) == prefix, url
    config.write_text("site_name: x\n", encoding="utf-8")
    assert serve.site_prefix(config) == "/"


def test_pages_are_served_under_the_prefix_and_root_is_sent_there(tmp_path):
    with ServedSite(small_site(tmp_path / "site"), "/refimpl/") as running:
        assert running.get("/refimpl/")[:1] == (200,)
        assert running.get("/refimpl/page/")[2] == b"<p>a page</p>"
        status, url, body = running.get("/")
        assert (status, url, body) == (200, running.base + "/refimpl/", b"<p>home</p>")
        assert running.get("/refimpl")[1] == running.base + "/refimpl/"
        assert running.get("/refimpl/page")[1] == running.base + "/refimpl/page/"  # a folder gets its slash


def test_a_missing_page_gets_404_html_whose_links_work(tmp_path):
    with ServedSite(small_site(tmp_path / "site"), "/refimpl/") as running:
        for missing in ("/refimpl/no/such/page/", "/refimpl/nothing.html", "/page/", "/other/index.html"):
            status, _, body = running.get(missing)
            assert status == 404, missing
            assert b"not here" in body, missing
            href = re.search(rb'href="([^"]+)"', body).group(1).decode()
            assert running.get(href)[:1] == (200,), href


def test_the_server_refuses_a_folder_that_holds_no_site_and_a_bad_port(serve, tmp_path):
    with pytest.raises(FileNotFoundError, match="no index.html"):
        serve.make_server(tmp_path, 0)
    site = small_site(tmp_path / "site")
    for port in (-1, 65536, 80.0, "8000", True):
        with pytest.raises(ValueError, match=r"port must be an integer from 0 to 65535, got"):
            serve.make_server(site, port)
    assert serve.main(["--site", str(tmp_path / "nothing"), "--port", "0"]) == 1  # a message, not a traceback


def test_nothing_outside_the_site_is_served(tmp_path):
    site = small_site(tmp_path / "site")
    (tmp_path / "secret.txt").write_text("secret", encoding="utf-8")
    with ServedSite(site, "/refimpl/") as running:
        for path in ("/refimpl/../secret.txt", "/refimpl/%2e%2e/secret.txt", "/secret.txt"):
            status, _, body = running.get(path)
            assert b"secret" not in body, path


def test_a_reader_who_leaves_mid_page_costs_no_traceback(tmp_path, capfd):
    """A browser that closes its connection while a file is still being sent (a tab closed, a link followed
    before the page finished) is no error of the server's: `make serve` prints nothing for it, where Python's
    server prints a traceback for each such request. An error of the server's own is still printed."""
    import socket
    import struct
    import threading
    import time

    site = small_site(tmp_path / "site")
    (site / "assets" / "large.bin").write_bytes(bytes(16 << 20))  # more than any socket buffer holds
    with ServedSite(site, "/refimpl/") as running:
        port = running.server.server_address[1]
        for _ in range(3):
            client = socket.create_connection(("127.0.0.1", port), timeout=30)
            client.sendall(b"GET /refimpl/assets/large.bin HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert client.recv(64).startswith(b"HTTP/1.0 200")
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
            client.close()
        assert running.get("/refimpl/page/")[2] == b"<p>a page</p>"  # still serving
        deadline = time.monotonic() + 30
        while any("process_request_thread" in thread.name for thread in threading.enumerate()):
            assert time.monotonic() < deadline, "a request's thread still runs after 30 s"
            time.sleep(0.01)  # each interrupted send has ended, and said what it says
        try:
            raise RuntimeError("an error of the server's own")
        except RuntimeError:
            running.server.handle_error(None, ("127.0.0.1", 1))
    err = capfd.readouterr().err
    assert "BrokenPipeError" not in err and "ConnectionResetError" not in err, err
    assert err.count("Traceback") == 1 and "RuntimeError: an error of the server's own" in err, err
