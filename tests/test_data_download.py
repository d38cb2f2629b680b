"""Resumable, checksummed downloads against a local HTTP server (127.0.0.1, in a thread)."""

from __future__ import annotations

import hashlib
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmforge.data import download as dl
from lmforge.utils.errors import LmforgeError

PAYLOAD = bytes(range(256)) * 4096  # 1 MiB


class _Server:
    """A tiny Range-capable server; ``cut_after`` makes the next responses stop early."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {"/data.bin": PAYLOAD}
        self.cut_after: list[int] = []  # per request, in order: stop after this many body bytes
        self.ignore_range = False
        self.requests: list[str | None] = []  # the Range header of each GET
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a: object) -> None:
                pass

            def do_GET(self) -> None:
                outer.requests.append(self.headers.get("Range"))
                body = outer.files.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                start = 0
                rng = self.headers.get("Range")
                if rng and not outer.ignore_range:
                    start = int(rng.removeprefix("bytes=").split("-")[0])
                    if start >= len(body):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(body)}")
                        self.end_headers()
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                else:
                    self.send_response(200)
                chunk = body[start:]
                self.send_header("Content-Length", str(len(chunk)))
                self.end_headers()
                if outer.cut_after:
                    chunk = chunk[: outer.cut_after.pop(0)]
                    self.wfile.write(chunk)
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(chunk)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server() -> Iterator[_Server]:
    s = _Server()
    yield s
    s.close()


def test_download_verifies_and_records_sidecar(server: _Server, tmp_path: Path) -> None:
    sha = hashlib.sha256(PAYLOAD).hexdigest()
    out = dl.download_file(f"{server.url}/data.bin", tmp_path / "d.bin", sha256=sha, progress=False)
    assert out.read_bytes() == PAYLOAD
    assert (tmp_path / "d.bin.sha256").read_text().split()[0] == sha
    assert not (tmp_path / "d.bin.part").exists()
    # A second call verifies the file and does not fetch again.
    n = len(server.requests)
    dl.download_file(f"{server.url}/data.bin", tmp_path / "d.bin", sha256=sha, progress=False)
    assert len(server.requests) == n


def test_interrupted_download_resumes_with_range(server: _Server, tmp_path: Path) -> None:
    server.cut_after = [300_000]
    dest = tmp_path / "d.bin"
    # No retries: the call fails, leaving the .part for the next run.
    with pytest.raises(LmforgeError, match="rerun to resume"):
        dl.download_file(f"{server.url}/data.bin", dest, retries=0, progress=False)
    part = tmp_path / "d.bin.part"
    assert part.stat().st_size == 300_000 and not dest.exists()
    dl.download_file(f"{server.url}/data.bin", dest, retries=0, progress=False)
    assert dest.read_bytes() == PAYLOAD
    assert server.requests == [None, "bytes=300000-"]


def test_resume_within_one_call_and_server_ignoring_range(server: _Server, tmp_path: Path) -> None:
    server.cut_after = [100_000, 200_000]
    dest = tmp_path / "a.bin"
    dl.download_file(f"{server.url}/data.bin", dest, retries=3, progress=False)
    assert dest.read_bytes() == PAYLOAD
    assert server.requests == [None, "bytes=100000-", "bytes=300000-"]
    # A server that ignores Range answers 200: the download restarts from zero, still correct.
    server.ignore_range = True
    server.cut_after = [50_000]
    dest2 = tmp_path / "b.bin"
    dl.download_file(f"{server.url}/data.bin", dest2, retries=2, progress=False)
    assert dest2.read_bytes() == PAYLOAD


def test_checksum_mismatch_fails_cleanly(server: _Server, tmp_path: Path) -> None:
    dest = tmp_path / "d.bin"
    with pytest.raises(LmforgeError) as e:
        dl.download_file(f"{server.url}/data.bin", dest, sha256="0" * 64, progress=False)
    msg = str(e.value)
    assert "checksum mismatch" in msg and "\n" not in msg
    assert not dest.exists() and not (tmp_path / "d.bin.part").exists()


def test_size_mismatch_and_sidecar_trust_on_first_use(server: _Server, tmp_path: Path) -> None:
    with pytest.raises(LmforgeError, match="expected"):
        dl.download_file(
            f"{server.url}/data.bin", tmp_path / "s.bin", size=len(PAYLOAD) + 1, progress=False
        )
    assert not (tmp_path / "s.bin").exists()
    dest = tmp_path / "t.bin"
    dl.download_file(f"{server.url}/data.bin", dest, progress=False)  # records the sidecar
    dest.write_bytes(PAYLOAD[:-1] + b"x")  # corrupted later
    with pytest.raises(LmforgeError, match="does not match recorded"):
        dl.download_file(f"{server.url}/data.bin", dest, progress=False)


def test_http_error_is_one_line(server: _Server, tmp_path: Path) -> None:
    with pytest.raises(LmforgeError, match="HTTP 404"):
        dl.download_file(f"{server.url}/missing.bin", tmp_path / "m.bin", progress=False)


def test_cli_download_with_mirror_url(
    server: _Server, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from lmforge.cli import main

    rc = main(
        ["data", "download", "tinystories-valid", "--out", str(tmp_path),
         "--url", f"{server.url}/data.bin"]
    )  # fmt: skip
    assert rc == 0
    assert (tmp_path / "TinyStoriesV2-GPT4-valid.txt").read_bytes() == PAYLOAD
    assert main(["data", "download", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown dataset 'nope'" in capsys.readouterr().err
    assert main(["data", "download", "--list"]) == 0
    assert "fineweb-edu-sample" in capsys.readouterr().out
