"""`make serve`'s server (`docs/serve.py`), third round: its redirects stay on it, and a file is not a folder.

* a request may name any host in its target (`GET http://elsewhere/refimpl/page HTTP/1.1`, or a path that
  opens with `//`): the redirect that gives a folder its slash names this server's path alone, never another
  host;
* a path ending in `/` (or `/.`) names a folder, as on the host: a regular file asked for that way
  (`page.html/`, `page/index.html/`) is answered with 404 and `404.html`, not with the file.

The requests are written on a socket, as a client sends them, since urllib rewrites an absolute-form target.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from conftest import ServedSite


def small_site(folder: Path) -> Path:
    (folder / "page").mkdir(parents=True)
    (folder / "elsewhere.example" / "page").mkdir(parents=True)
    (folder / "index.html").write_text("<p>home</p>", encoding="utf-8")
    (folder / "a.html").write_text("<p>page a</p>", encoding="utf-8")
    (folder / "page" / "index.html").write_text("<p>a page</p>", encoding="utf-8")
    (folder / "elsewhere.example" / "page" / "index.html").write_text("<p>deep</p>", encoding="utf-8")
    (folder / "404.html").write_text("<p>not here</p>", encoding="utf-8")
    return folder


def raw(running: ServedSite, method: str, target: str) -> tuple[str, dict[str, str], bytes]:
    """The status line, the headers (lower-case names) and the body the server answers to `target`."""
    port = running.server.server_address[1]
    with socket.create_connection(("127.0.0.1", port), timeout=30) as client:
        client.sendall(f"{method} {target} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n"
                       .encode())
        data = b""
        while chunk := client.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    return status, headers, body


@pytest.mark.parametrize("target, location", [
    ("http://elsewhere.example/refimpl/page", "/refimpl/page/"),
    ("http://elsewhere.example/refimpl/page?x=1", "/refimpl/page/?x=1"),
    ("/refimpl/page", "/refimpl/page/"),
])
def test_a_folders_redirect_names_this_servers_path_alone(tmp_path, target, location):
    with ServedSite(small_site(tmp_path / "site"), "/refimpl/") as running:
        status, headers, _ = raw(running, "GET", target)
    assert status.split()[1] == "301" and headers["location"] == location, (status, headers)


@pytest.mark.parametrize("prefix, target", [("/", "////elsewhere.example/page"), ("/", "//elsewhere.example/page"),
                                            ("/refimpl/", "//elsewhere.example/refimpl/page")])
def test_a_path_that_opens_with_two_slashes_is_not_sent_to_another_host(tmp_path, prefix, target):
    """A target that opens with `//` must never be answered with a `Location` that does too, which a browser
    takes for another host (`//elsewhere.example/page/`). (Python's own handler already folds the leading
    slashes of such a path; the redirect keeps one slash whatever it is given.)"""
    with ServedSite(small_site(tmp_path / "site"), prefix) as running:
        _, headers, _ = raw(running, "GET", target)
    assert not headers.get("location", "/").startswith("//"), headers


@pytest.mark.parametrize("method", ["GET", "HEAD"])
@pytest.mark.parametrize("target", ["/refimpl/a.html/", "/refimpl/page/index.html/", "/refimpl/a.html/.",
                                    "/refimpl/a.html%2F"])
def test_a_file_asked_for_as_a_folder_is_missing(tmp_path, method, target):
    with ServedSite(small_site(tmp_path / "site"), "/refimpl/") as running:
        status, _, body = raw(running, method, target)
    assert status.split()[1] == "404", status
    assert body == (b"<p>not here</p>" if method == "GET" else b"")


def test_files_and_folders_are_still_served(tmp_path):
    with ServedSite(small_site(tmp_path / "site"), "/refimpl/") as running:
        assert running.get("/refimpl/a.html") == (200, running.base + "/refimpl/a.html", b"<p>page a</p>")
        assert running.get("/refimpl/page/")[::2] == (200, b"<p>a page</p>")
        assert running.get("/refimpl/page/index.html")[::2] == (200, b"<p>a page</p>")
        assert running.get("/refimpl/page") == (200, running.base + "/refimpl/page/", b"<p>a page</p>")
        assert running.get("/refimpl/")[::2] == (200, b"<p>home</p>")
