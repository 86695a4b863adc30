"""Serve the built site the way its host does: under the path of `site_url`, with `404.html` for a missing page.

MkDocs writes `404.html` with absolute links (`/refimpl/assets/...`), because the host shows that one page at
whatever address was not found, at any depth, and only an absolute link works from every depth. Python's
`http.server` would serve the site at `/` and answer a missing page with its own one-line error, so the
links of `404.html` would never be tried. This server puts the site where `site_url` puts it
(`http://127.0.0.1:8000/refimpl/`), sends `/` there, and answers a missing page with `404.html`, as the host
does; what works here works there. Like the host, it serves only the files of the site: a symbolic link that
leads out of the site, a folder without `index.html` (no listings) and anything that is not a regular file
are answered with 404, and so is a file asked for as a folder (`page.html/`); a path no file can have (an
encoded NUL, bytes that are not UTF-8) is answered with 400. A redirect stays on this server whatever host the
request's target names.
A browser that leaves before a file is sent (a tab closed mid-page) is not reported: it is no error.

    python docs/serve.py [--site site] [--port 8000] [--bind 127.0.0.1]
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import stat
import sys
from http import HTTPStatus
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

ROOT = Path(__file__).resolve().parents[1]


def site_prefix(config: Path = ROOT / "mkdocs.yml") -> str:
    """The path part of `site_url` in `config`, with a slash at each end (`/refimpl/`); `/` when there is none."""
    match = re.search(r"^site_url:\s*(\S+)\s*$", config.read_text(encoding="utf-8"), re.M)
    path = urlsplit(match.group(1)).path if match else "/"
    return "/" + path.strip("/") + "/" if path.strip("/") else "/"


class SiteHandler(SimpleHTTPRequestHandler):
    """Files of `directory` under `prefix`; a redirect from `/` to `prefix`; `404.html` for what is missing."""

    def __init__(self, *args, directory: str, prefix: str, **kwargs) -> None:
        self.prefix = prefix
        super().__init__(*args, directory=directory, **kwargs)

    def do_GET(self) -> None:
        if self._redirected():
            return
        super().do_GET()

    def do_HEAD(self) -> None:
        if self._redirected():
            return
        super().do_HEAD()

    def _redirected(self) -> bool:
        """Send `/` (and the prefix without its last slash) to the site's own address."""
        path = urlsplit(self.path).path
        if self.prefix != "/" and path in ("/", self.prefix.rstrip("/")):
            self.send_response(HTTPStatus.FOUND)
            self.send_header("Location", self.prefix)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return True
        return False

    def send_head(self):
        """The response's head for the file `self.path` names, and the open file; or an error already answered.

        Only a regular file whose real path (every symbolic link followed) lies inside the site is served, as
        the host serves only what was uploaded: a link out of the site, a folder without `index.html` (never a
        listing), a FIFO or a device is answered as missing, and so is a file asked for as a folder (a path
        ending in `/`). A path no file can have (an encoded NUL, bytes that are not UTF-8) is a bad request.
        A folder's redirect names this server's path alone (`local_location`). Every request gets an answer,
        never a dropped connection.
        """
        parts = urlsplit(self.path)
        try:
            name = self.site_path(parts.path)
        except ValueError as exc:
            self.send_error(HTTPStatus.BAD_REQUEST, str(exc))
            return None
        if name is None:
            self.send_error(HTTPStatus.NOT_FOUND)
            return None
        try:
            if os.path.isdir(name):
                if not parts.path.endswith("/"):  # a folder gets its slash, as on the host
                    index = self.open_inside(os.path.join(name, "index.html"))
                    if index is None:
                        self.send_error(HTTPStatus.NOT_FOUND)
                        return None
                    index.close()
                    self.send_response(HTTPStatus.MOVED_PERMANENTLY)
                    self.send_header("Location", self.local_location(parts.path + "/", parts.query))
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return None
                name = os.path.join(name, "index.html")
            elif self.names_folder(parts.path):  # a file asked for as a folder (`page.html/`): the host has none
                self.send_error(HTTPStatus.NOT_FOUND)
                return None
            file = self.open_inside(name)
        except OSError:  # a name too long for the file system, or one that vanished meanwhile
            file = None
        if file is None:
            self.send_error(HTTPStatus.NOT_FOUND)
            return None
        try:
            size = os.fstat(file.fileno()).st_size
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", self.guess_type(name))
            self.send_header("Content-Length", str(size))
            self.send_header("Last-Modified", self.date_time_string(int(os.fstat(file.fileno()).st_mtime)))
            self.end_headers()
        except BaseException:
            file.close()
            raise
        return file

    @staticmethod
    def names_folder(path: str) -> bool:
        """Whether the URL path `path` names a folder: its last part, decoded, is empty (a trailing slash) or
        `.`. Such a path is a folder's address on the host, never a file's: `a.html/` is not `a.html`."""
        last = unquote(path, errors="replace").rsplit("/", 1)[-1]
        return last in ("", ".")

    @staticmethod
    def local_location(path: str, query: str = "") -> str:
        """A redirect's `Location` on this server: the path (with one leading slash, so that `//host/...`
        cannot name another host) and the query, never the scheme or host of the request's target. A request
        may name any host in its target (`GET http://elsewhere/refimpl/page`); the answer stays on this one."""
        location = "/" + path.lstrip("/")
        return f"{location}?{query}" if query else location

    def site_path(self, path: str) -> str | None:
        """The file name in the site for the URL path `path`; None when `path` is outside the prefix.

        Raises ValueError for a path no file can have: bytes that are not UTF-8 once decoded, or a NUL."""
        if not path.startswith(self.prefix):
            return None
        try:
            relative = unquote(path[len(self.prefix):], errors="strict")
        except UnicodeDecodeError as exc:
            raise ValueError(f"the path is not UTF-8 once decoded: {exc.reason}") from None
        if "\0" in relative:
            raise ValueError("the path holds a NUL character")
        parts = [part for part in relative.split("/") if part not in ("", ".", "..")]
        return os.path.join(self.directory, *parts)

    def open_inside(self, name: str):
        """`name` opened for reading when its real path is a regular file inside the site; None otherwise.

        The file is opened without blocking (a FIFO would wait for a writer) and checked again once open, so
        that what is read is what was checked."""
        real = os.path.realpath(name)
        site = os.path.realpath(self.directory)
        if os.path.commonpath([real, site]) != site:
            return None
        try:
            descriptor = os.open(real, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            return None
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            os.close(descriptor)
            return None
        os.set_blocking(descriptor, True)
        return os.fdopen(descriptor, "rb")

    def list_directory(self, path):
        """No listings: the host answers a folder without `index.html` with 404."""
        self.send_error(HTTPStatus.NOT_FOUND)
        return None

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        page = self.open_inside(os.path.join(self.directory, "404.html")) if code == HTTPStatus.NOT_FOUND else None
        if page is None:
            super().send_error(code, message, explain)
            return
        with page:
            body = page.read()
        self.send_response(code, message)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        """Log only the requests that failed: a page the site lacks is worth a line, each asset served is not."""
        if str(int(code) if isinstance(code, int) else code).startswith(("4", "5")):
            super().log_request(code, size)


class SiteServer(ThreadingHTTPServer):
    """Python's threading server, quiet when a reader's browser leaves before a file is sent."""

    def handle_error(self, request, client_address) -> None:
        # A tab closed or a link followed mid-page drops the connection while a file is being written to it:
        # no error of the server's, and Python's server would print a traceback for each one.
        if isinstance(sys.exc_info()[1], ConnectionError):  # BrokenPipeError, ConnectionResetError, ...
            return
        super().handle_error(request, client_address)


def make_server(site: Path, port: int, bind: str = "127.0.0.1", prefix: str | None = None) -> ThreadingHTTPServer:
    """An HTTP server for the built site in `site` (not yet serving); port 0 takes a free port."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an integer from 0 to 65535, got {port!r}")
    site = Path(site)
    if not (site / "index.html").is_file():
        raise FileNotFoundError(f"site: {site} holds no index.html; build the site first (make docs)")
    handler = functools.partial(SiteHandler, directory=str(site), prefix=prefix or site_prefix())
    return SiteServer((bind, port), handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", type=Path, default=ROOT / "site", help="the built site (default: site/)")
    parser.add_argument("--port", type=int, default=8000, help="the port (default: 8000)")
    parser.add_argument("--bind", default="127.0.0.1", help="the address to listen on (default: 127.0.0.1)")
    args = parser.parse_args(argv)
    try:
        server = make_server(args.site, args.port, args.bind)
    except (ValueError, OSError) as exc:  # a bad port, no built site, or an address already in use
        print(f"docs/serve.py: {exc}", file=sys.stderr)
        return 1
    host, port = server.server_address[:2]
    print(f"Serving the site on http://{host}:{port}{site_prefix()} (Ctrl-C stops it)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
