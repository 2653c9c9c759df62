"""A local fake of the Hugging Face Hub's file API on 127.0.0.1, for the model-fetch init container.

Serves one directory as one model repo: ``GET /api/models/{repo}/revision/{rev}`` (repo info:
commit sha and file list), ``GET /api/models/{repo}/tree/{rev}`` (file listing), and
``HEAD``/``GET /{repo}/resolve/{rev}/{file}`` with the headers huggingface_hub reads
(``X-Repo-Commit``, ``ETag``, ``Content-Length``). With ``token`` set, every request must carry
``Authorization: Bearer <token>`` (else 401, as for a gated repo). Every request is recorded.
"""

from __future__ import annotations

import hashlib
import pathlib
from dataclasses import dataclass, field

import aiohttp.web

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class FakeHub:
    repo_id: str
    root: pathlib.Path
    token: str | None = None
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    port: int = 0
    _runner: aiohttp.web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def files(self) -> list[str]:
        return sorted(str(p.relative_to(self.root)) for p in self.root.rglob("*") if p.is_file())

    async def start(self) -> FakeHub:
        app = aiohttp.web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = aiohttp.web.AppRunner(app)
        await self._runner.setup()
        site = aiohttp.web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        auth = request.headers.get("Authorization")
        self.requests.append((request.method, request.path, auth))
        if self.token is not None and auth != f"Bearer {self.token}":
            return aiohttp.web.json_response({"error": "Invalid credentials"}, status=401)
        path = request.path
        api = f"/api/models/{self.repo_id}/"
        if path.startswith(api + "revision/"):
            siblings = [{"rfilename": f} for f in self.files()]
            return aiohttp.web.json_response(
                {"id": self.repo_id, "modelId": self.repo_id, "sha": COMMIT, "siblings": siblings, "private": False})
        if path.startswith(api + "tree/"):
            return aiohttp.web.json_response([
                {"type": "file", "path": f, "size": (self.root / f).stat().st_size, "oid": _etag(self.root / f)}
                for f in self.files()
            ])
        prefix = f"/{self.repo_id}/resolve/"
        if path.startswith(prefix):
            _, _, filename = path[len(prefix):].partition("/")
            file = self.root / filename
            if not file.is_file() or ".." in filename.split("/"):
                return aiohttp.web.json_response({"error": "Entry not found"}, status=404,
                                                 headers={"X-Error-Code": "EntryNotFound"})
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{_etag(file)}"',
                       "Content-Length": str(file.stat().st_size)}
            if request.method == "HEAD":
                return aiohttp.web.Response(status=200, headers=headers)
            return aiohttp.web.Response(body=file.read_bytes(), headers=headers)
        return aiohttp.web.json_response({"error": f"fake hub: no route {request.method} {path}"}, status=404)


def _etag(file: pathlib.Path) -> str:
    return hashlib.sha1(file.read_bytes()).hexdigest()
