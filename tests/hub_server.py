"""A local stand-in for the Hugging Face Hub on 127.0.0.1: serves one folder as a model repo the way the Hub
does (model info, tree listing with LFS sha256, resolve URLs with the Hub's headers and Range), and can cut a
download mid-file or send damaged bytes, for the tests of ``deltafin pull``."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class Hub:
    def __init__(self, repo_id: str, folder: str, token: str | None = None):
        self.repo_id, self.folder, self.token = repo_id, folder, token
        self.cut: dict[str, list] = {}  # file -> [bytes sent before the connection drops, GETs left to cut]
        self.corrupt: dict[str, int] = {}  # file -> GETs left that carry a flipped byte
        self.log: list[tuple[str, str, str]] = []  # (method, path, Range header)
        self.lock = threading.Lock()
        self.files = {}
        for name in sorted(os.listdir(folder)):
            p = os.path.join(folder, name)
            if os.path.isfile(p):
                with open(p, "rb") as f:
                    data = f.read()
                self.files[name] = data
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> Hub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def gets(self, name: str) -> list[str]:
        """Range headers of the GETs of one file ('' for a whole-file GET)."""
        return [r for m, p, r in self.log if m == "GET" and p.endswith("/" + name) and "/resolve/" in p]

    def entry(self, name: str) -> dict:
        data = self.files[name]
        git_oid = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        e = {"type": "file", "path": name, "size": len(data), "oid": git_oid}
        if name.endswith(".safetensors"):
            e["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return e

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def _auth_ok(self) -> bool:
                if hub.token is None or self.headers.get("Authorization") == f"Bearer {hub.token}":
                    return True
                self._json({"error": "Invalid credentials"}, 401)
                return False

            def _json(self, doc, status=200) -> None:
                body = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("X-Error-Message", doc.get("error", "")) if isinstance(doc, dict) else None
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def do_HEAD(self):
                self.do_GET()

            def do_POST(self):
                self.do_GET()

            def do_GET(self):
                path = unquote(urlparse(self.path).path)
                with hub.lock:
                    hub.log.append((self.command, path, self.headers.get("Range", "")))
                if self.command == "POST":
                    self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if not self._auth_ok():
                    return
                api = f"/api/models/{hub.repo_id}"
                if path.startswith(api + "/revision/") or path == api:
                    siblings = [{"rfilename": n} for n in hub.files]
                    return self._json({"id": hub.repo_id, "modelId": hub.repo_id, "sha": COMMIT,
                                       "siblings": siblings, "private": False})
                if path.startswith(api + "/tree/"):
                    return self._json([hub.entry(n) for n in hub.files])
                if path.startswith(api + "/paths-info/"):
                    return self._json([hub.entry(n) for n in hub.files])
                prefix = f"/{hub.repo_id}/resolve/"
                if path.startswith(prefix):
                    name = path[len(prefix):].split("/", 1)[1]
                    return self._file(name)
                self._json({"error": f"not found: {path}"}, 404)

            def _file(self, name: str) -> None:
                if name not in hub.files:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                data, e = hub.files[name], hub.entry(name)
                etag = e.get("lfs", {}).get("oid") or e["oid"]
                start, status = 0, 200
                rng = self.headers.get("Range")
                if rng and rng.startswith("bytes="):
                    a, _, b = rng[6:].partition("-")
                    start = int(a)
                    end = int(b) + 1 if b else len(data)
                    body, status = data[start:end], 206
                else:
                    body = data
                if self.command == "GET":
                    with hub.lock:
                        if hub.corrupt.get(name, 0) > 0 and not rng:  # a whole-file download
                            hub.corrupt[name] -= 1
                            body = bytearray(body)
                            body[len(body) // 2] ^= 0xFF
                            body = bytes(body)
                        cut = hub.cut.get(name)
                        # only a transfer that reaches the cut point drops (a header's small range is served whole
                        # on a connection that stays open: closing it raced the client's next request on it)
                        drop = cut is not None and cut[1] > 0 and start + len(body) > cut[0]
                        if drop:
                            cut[1] -= 1
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("ETag", f'"{etag}"')
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("Accept-Ranges", "bytes")
                if "lfs" in e:
                    self.send_header("X-Linked-Etag", f'"{etag}"')
                    self.send_header("X-Linked-Size", str(len(data)))
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{start + len(body) - 1}/{len(data)}")
                self.end_headers()
                if self.command != "GET":
                    return
                if drop:  # send part of the file, then drop the connection
                    self.wfile.write(body[: max(cut[0] - start, 1)])
                    self.wfile.flush()
                    self.close_connection = True
                    import socket

                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.wfile.write(body)

        return Handler
