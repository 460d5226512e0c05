"""A local Hugging Face Hub for tests: a real HTTP server speaking the parts of the Hub API huggingface_hub uses.

The one place the project stands in for an external service. It is not a Python mock: huggingface_hub's own
``create_repo``, ``create_branch``, ``create_commit``, ``snapshot_download`` and ``hf_hub_download`` talk to it over
HTTP on 127.0.0.1, exactly as they talk to huggingface.co, and get the answers (status codes, ``X-Error-Code``,
``ETag`` / ``X-Repo-Commit`` headers) they branch on. Protocol read from huggingface_hub 2.4 (hf_api.py,
_commit_api.py, file_download.py, _snapshot_download.py).

    POST /api/repos/create                              create a repo (an initial commit with .gitattributes)
    POST /api/validate-yaml                             model card metadata check (create_commit sends README.md)
    POST /api/models/{repo}/branch/{branch}             create a branch at main (or at "startingPoint")
    GET  /api/agent-harnesses                           huggingface_hub's AI-agent registry (served empty)
    POST /api/models/{repo}/preupload/{rev}             upload mode per file: always "regular" (base64 in the commit)
    POST /api/models/{repo}/commit/{rev}                NDJSON: header line, then "file" / "deletedFile" lines
    GET  /api/models/{repo}[/revision/{rev}]            repo info: sha of the revision, siblings, private
    GET  /api/models/{repo}/tree/{rev}[/{path}]         file listing, recursive (oid = git blob sha1, size)
    HEAD|GET /{repo}/resolve/{rev}/{path}               a file, with ETag (blob sha1) and X-Repo-Commit

Files are always "regular" (git blobs sent base64 inside the commit): huggingface_hub uploads LFS files through Xet
when hf_xet is installed, which needs a CAS service this server does not have. The real Hub stores safetensors via
LFS/Xet; that part of the transfer is huggingface_hub's own code and is not exercised here.

Auth, as the Hub does it: writes need ``Authorization: Bearer <token>`` of the test user (401 without, 403 outside
the user's namespace); a wrong token is refused (401) on every request; private repos answer 401 "RepoNotFound" to
anyone else; public repos can be read anonymously.

Faults for tests: ``server.fail_next("commit", "500")`` answers the next commit with a 500 (nothing committed);
``"drop"`` reads half the request body and closes the connection without answering.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

TOKEN = "hf_selfspec_test_token"
USER = "tester"
GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a file (what the Hub reports as a regular file's oid and ETag)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Commit:
    oid: str
    parent: str | None
    message: str
    files: dict[str, bytes]


@dataclass
class Repo:
    repo_id: str
    private: bool
    commits: dict[str, Commit] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    """branch name -> commit oid."""

    def commit(self, parent: str | None, message: str, files: dict[str, bytes]) -> Commit:
        digest = hashlib.sha1(f"{parent}\n{message}\n{len(self.commits)}".encode())
        for path in sorted(files):
            digest.update(path.encode() + git_blob_sha1(files[path]).encode())
        commit = Commit(digest.hexdigest(), parent, message, dict(files))
        self.commits[commit.oid] = commit
        return commit

    def resolve(self, revision: str) -> Commit | None:
        oid = self.branches.get(revision, revision)
        return self.commits.get(oid)


class _Dropped(Exception):
    """The connection was closed on purpose (a fault): there is nothing left to answer."""


class HttpError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None,
                 body: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}
        self.body = {"error": message, **(body or {})}


class HubServer:
    """A Hub on 127.0.0.1 and a free port, served from a thread. Use as a context manager or start() / stop()."""

    def __init__(self, token: str = TOKEN, user: str = USER):
        self.token, self.user = token, user
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []
        """(method, path) of every request received, in order (rejected ones included)."""
        self._faults: dict[str, str] = {}
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._httpd.hub = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hub-server", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "HubServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> "HubServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def fail_next(self, endpoint: str, how: str) -> None:
        """Make the next request to ``endpoint`` ("commit", "preupload", "create") fail: how = "500" or "drop"."""
        if how not in ("500", "drop"):
            raise ValueError(f"how must be '500' or 'drop', found {how!r}")
        self._faults[endpoint] = how

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """The files of a repo at a revision (what a download would see)."""
        commit = self.repos[repo_id].resolve(revision)
        if commit is None:
            raise KeyError(f"{repo_id} has no revision {revision!r}")
        return commit.files


# ------------------------------------------------------------------------------------------------- the handler
_REPO = r"(?P<repo>[^/]+/[^/]+)"
ROUTES = [  # (method, compiled path regex, handler method name)
    ("POST", r"/api/repos/create", "create_repo"),
    ("POST", r"/api/validate-yaml", "validate_yaml"),
    ("GET", r"/api/agent-harnesses", "agent_harnesses"),
    ("POST", rf"/api/models/{_REPO}/branch/(?P<branch>[^/]+)", "create_branch"),
    ("POST", rf"/api/models/{_REPO}/preupload/(?P<rev>[^/]+)", "preupload"),
    ("POST", rf"/api/models/{_REPO}/commit/(?P<rev>[^/]+)", "commit"),
    ("GET", rf"/api/models/{_REPO}(?:/revision/(?P<rev>[^/]+))?", "repo_info"),
    ("GET", rf"/api/models/{_REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.+))?", "tree"),
    ("GET", rf"/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)", "resolve"),
    ("HEAD", rf"/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)", "resolve"),
]
ROUTES = [(method, re.compile(pattern + r"/?"), name) for method, pattern, name in ROUTES]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as huggingface_hub's connection pool expects

    def log_message(self, format, *args) -> None:  # quiet: tests read hub.requests instead
        return None

    @property
    def hub(self) -> HubServer:
        return self.server.hub  # type: ignore[attr-defined]

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    # --------------------------------------------------------------------------------------- plumbing
    def _dispatch(self, method: str) -> None:
        split = urlsplit(self.path)
        self._body: bytes | None = None  # one handler serves every request of a keep-alive connection
        self.query = {k: v[-1] for k, v in parse_qs(split.query).items()}
        with self.hub._lock:
            self.hub.requests.append((method, split.path))
        for route_method, pattern, name in ROUTES:
            match = pattern.fullmatch(split.path)
            if route_method == method and match:
                args = {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
                break
        else:
            self._drain()
            return self._send_json(404, {"error": f"no such endpoint: {method} {split.path}"})
        try:
            user = self._user()
            with self.hub._lock:
                getattr(self, "h_" + name)(user, **args)
        except HttpError as err:
            self._drain()
            headers = {"X-Error-Message": err.message, **err.headers}
            if err.code:
                headers["X-Error-Code"] = err.code
            self._send_json(err.status, err.body, headers)
        except _Dropped:
            return None

    def _drain(self) -> bytes:
        """Read the request body (once): keep-alive connections must not carry it over into the next request."""
        if self._body is None:
            length = int(self.headers.get("Content-Length") or 0)
            self._body = self.rfile.read(length) if length else b""
        return self._body

    def _json(self) -> dict:
        try:
            return json.loads(self._drain() or b"{}")
        except json.JSONDecodeError as err:
            raise HttpError(400, f"invalid JSON body: {err}") from err

    def _send(self, status: int, body: bytes, headers: dict[str, str], head_only: bool = False) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head_only and self.command != "HEAD":  # an answer to HEAD has no body, errors included (keep-alive)
            self.wfile.write(body)

    def _send_json(self, status: int, payload, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(payload).encode(), {"Content-Type": "application/json", **(headers or {})})

    def _user(self):
        header = self.headers.get("Authorization")
        if header is None:
            return None
        if header == f"Bearer {self.hub.token}":
            return self.hub.user
        raise HttpError(401, "Invalid credentials in Authorization header")

    def _fault(self, endpoint: str) -> None:
        how = self.hub._faults.pop(endpoint, None)
        if how == "500":
            raise HttpError(500, "Internal Error - We're working hard to fix this as soon as possible!")
        if how == "drop":
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length // 2)
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            raise _Dropped()

    def _writable(self, user, repo_id: str) -> None:
        if user is None:
            raise HttpError(401, "You must be authenticated to write to a repo: pass a token")
        namespace = repo_id.split("/")[0]
        if namespace != user:
            raise HttpError(403, f"You don't have the rights to write to {repo_id}: "
                                 f"the namespace {namespace!r} is not yours")

    def _readable(self, user, repo_id: str) -> Repo:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            raise HttpError(404, "Repository not found", "RepoNotFound")
        if repo.private and user is None:
            raise HttpError(401, "Repository not found", "RepoNotFound")
        return repo

    def _revision(self, repo: Repo, revision: str) -> Commit:
        commit = repo.resolve(revision)
        if commit is None:
            raise HttpError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return commit

    # --------------------------------------------------------------------------------------- endpoints
    def h_create_repo(self, user) -> None:
        body = self._json()
        repo_id = f"{body.get('organization') or user}/{body.get('name')}"
        self._writable(user, repo_id)
        self._fault("create")
        if body.get("type", "model") != "model":
            raise HttpError(400, "this test Hub serves model repos only")
        if repo_id in self.hub.repos:
            raise HttpError(409, "You already created this model repo", body={"url": f"{self.hub.url}/{repo_id}"})
        repo = Repo(repo_id, private=body.get("visibility") == "private" or bool(body.get("private")))
        repo.branches["main"] = repo.commit(None, "initial commit", {".gitattributes": GITATTRIBUTES}).oid
        self.hub.repos[repo_id] = repo
        self._send_json(200, {"url": f"{self.hub.url}/{repo_id}", "name": repo_id, "id": repo_id})

    def h_validate_yaml(self, user) -> None:
        content = self._json().get("content", "")
        parts = content.split("---\n", 2) if content.startswith("---\n") else []
        try:
            meta = yaml.safe_load(parts[1]) if len(parts) == 3 else {}
        except yaml.YAMLError as err:
            return self._send_json(400, {"errors": [{"message": f"invalid YAML: {err}"}], "warnings": []})
        if meta is not None and not isinstance(meta, dict):
            return self._send_json(400, {"errors": [{"message": "metadata must be a YAML mapping"}], "warnings": []})
        self._send_json(200, {"errors": [], "warnings": []})

    def h_agent_harnesses(self, user) -> None:
        self._send_json(200, {"standardEnvVars": [], "harnesses": {}})

    def h_create_branch(self, user, repo: str, branch: str) -> None:
        self._writable(user, repo)
        state = self._readable(user, repo)
        start = self._json().get("startingPoint") or "main"
        if branch in state.branches:
            raise HttpError(409, "Reference already exists")
        state.branches[branch] = self._revision(state, start).oid
        self._send_json(200, {})

    def h_preupload(self, user, repo: str, rev: str) -> None:
        self._writable(user, repo)
        self._fault("preupload")
        files = self._revision(self._readable(user, repo), rev).files
        answer = []
        for item in self._json().get("files", []):
            existing = files.get(item["path"])
            answer.append({"path": item["path"], "uploadMode": "regular", "shouldIgnore": False,
                           "oid": None if existing is None else git_blob_sha1(existing)})
        self._send_json(200, {"files": answer})

    def h_commit(self, user, repo: str, rev: str) -> None:
        self._writable(user, repo)
        state = self._readable(user, repo)
        self._fault("commit")
        if self.query.get("create_pr"):
            raise HttpError(400, "this test Hub does not open pull requests")
        if rev not in state.branches:
            raise HttpError(404, f"Invalid rev id: {rev} (commits go to a branch)", "RevisionNotFound")
        lines = [json.loads(line) for line in self._drain().splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HttpError(400, "the commit payload must start with a header line")
        header, head = lines[0]["value"], state.branches[rev]
        if header.get("parentCommit") not in (None, head):
            raise HttpError(412, "A commit has happened since. Please refresh and try again.")
        files = dict(state.commits[head].files)
        for line in lines[1:]:
            key, value = line.get("key"), line.get("value", {})
            if key == "file":
                if value.get("encoding") != "base64":
                    raise HttpError(400, f"unsupported encoding {value.get('encoding')!r}")
                files[value["path"]] = base64.b64decode(value["content"])
            elif key == "deletedFile":
                files.pop(value["path"], None)
            elif key == "deletedFolder":
                files = {p: d for p, d in files.items() if not p.startswith(value["path"].rstrip("/") + "/")}
            else:
                raise HttpError(400, f"this test Hub stores regular files only; found a {key!r} operation")
        commit = state.commit(head, header.get("summary", ""), files)
        state.branches[rev] = commit.oid
        self._send_json(200, {"commitUrl": f"{self.hub.url}/{repo}/commit/{commit.oid}", "commitOid": commit.oid,
                              "pullRequestUrl": None, "success": True})

    def h_repo_info(self, user, repo: str, rev: str = "main") -> None:
        state = self._readable(user, repo)
        commit = self._revision(state, rev)
        self._send_json(200, {
            "id": repo, "author": repo.split("/")[0], "sha": commit.oid, "private": state.private, "disabled": False,
            "gated": False, "tags": [], "siblings": [{"rfilename": path} for path in sorted(commit.files)],
        })

    def h_tree(self, user, repo: str, rev: str, path: str = "") -> None:
        """Every file under ``path`` (the recursive listing snapshot_download asks for; repos here have no folders)."""
        commit = self._revision(self._readable(user, repo), rev)
        prefix = path.rstrip("/") + "/" if path else ""
        entries = [{"type": "file", "oid": git_blob_sha1(data), "size": len(data), "path": name}
                   for name, data in sorted(commit.files.items()) if name.startswith(prefix)]
        if path and not entries:
            raise HttpError(404, f"{path} does not exist at {rev}", "EntryNotFound")
        self._send_json(200, entries)

    def h_resolve(self, user, repo: str, rev: str, path: str) -> None:
        commit = self._revision(self._readable(user, repo), rev)
        data = commit.files.get(path)
        if data is None:
            raise HttpError(404, "Entry not found", "EntryNotFound", {"X-Repo-Commit": commit.oid})
        headers = {"Content-Type": "application/octet-stream", "ETag": f'"{git_blob_sha1(data)}"',
                   "X-Repo-Commit": commit.oid, "Accept-Ranges": "bytes"}
        self._send(200, data, headers, head_only=self.command == "HEAD")


# ------------------------------------------------------------------------------------- pointing clients at it
def use_hub(monkeypatch, hub: HubServer, home, token: str | None = TOKEN) -> None:
    """Point huggingface_hub, in this process and in subprocesses, at ``hub`` with a fresh HF_HOME ``home``.

    huggingface_hub reads HF_ENDPOINT / HF_HOME / HF_HUB_OFFLINE once, at import: the environment variables are set
    for subprocesses, and the constants derived from them are patched here for this process. ``token`` goes into
    HF_TOKEN (None: no token anywhere, since the fresh HF_HOME holds no saved login).
    """
    from huggingface_hub import constants

    for name in ("HF_HUB_CACHE", "HF_TOKEN_PATH", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN",
                 "HUGGING_FACE_HUB_TOKEN", "HF_XET_CACHE", "HF_ASSETS_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HOME", str(home))
    if token is not None:
        monkeypatch.setenv("HF_TOKEN", token)
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_HOME", hub.url + "/")
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    import transformers.utils.hub as transformers_hub  # transformers keeps one HfApi, its endpoint fixed at first use

    monkeypatch.setattr(transformers_hub, "_hf_api", None, raising=False)
    default_home = constants.HF_HOME
    for name in dir(constants):  # every path derived from HF_HOME at import (cache, token, xet, agent registry ...)
        value = getattr(constants, name)
        if name.isupper() and isinstance(value, str) and value.startswith(default_home):
            monkeypatch.setattr(constants, name, str(home) + value[len(default_home):])
    for name, sub in (("HF_HUB_CACHE", "hub"), ("HF_TOKEN_PATH", "token"), ("HF_XET_CACHE", "xet"),
                      ("HF_ASSETS_CACHE", "assets")):  # these four may have been set apart from HF_HOME
        monkeypatch.setattr(constants, name, str(home / sub))
