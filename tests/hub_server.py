"""A small Hugging Face Hub-compatible HTTP server for offline round-trip tests.

Standard library only. It speaks enough of the Hub protocol for the real `huggingface_hub`
client (create_repo, upload_folder/create_commit over the legacy LFS path, repo_info,
list_repo_tree, hf_hub_download, snapshot_download) to work against it unchanged.

Storage (under `root`): content-addressed blobs in `blobs/<sha256>`, and one
`repos/<type>/<repo_id>/repo.json` per repo with its branches and commits. Every commit
gets a 40-hex sha; a branch maps to a commit sha; a revision in a URL may be a branch
name (URL-quoted, e.g. `refs%2Fpr%2F1`) or a commit sha of that repo.

Routes (`{type}s` is `models`, `datasets` or `spaces`; `{repo}` is `name` or `org/name`;
`[{type}s/]` is the `datasets/` or `spaces/` prefix, absent for models):

    GET      /api/whoami-v2                                    the test user
    POST     /api/repos/create                                 409 if the repo exists
    POST     /api/validate-yaml                                README front matter check
    GET      /api/{type}s/{repo}[/revision/{rev}]              repo info: id, sha, siblings
    GET      /api/{type}s/{repo}/tree/{rev}[/{path}]?recursive= tree listing (one page)
    POST     /api/{type}s/{repo}/branch/{branch}               create a branch (409 if it exists)
    POST     /api/{type}s/{repo}/preupload/{rev}               "lfs" or "regular" per file
    POST     /api/{type}s/{repo}/commit/{rev}[?create_pr=1]    NDJSON commit, 412 on stale parentCommit
    POST     /[{type}s/]{repo}.git/info/lfs/objects/batch      LFS batch API, "basic" transfer
    PUT      /lfs/upload/{oid}                                 LFS upload href given by the batch API
    POST     /lfs/verify/{oid}                                 LFS verify href given by the batch API
    HEAD|GET /[{type}s/]{repo}/resolve/{rev}/{path}            file metadata / bytes, Range support

A 404 carries `X-Error-Code` RepoNotFound, RevisionNotFound or EntryNotFound, which the
client maps to its typed errors. Write routes require an `Authorization: Bearer` header (any
token); repo visibility is recorded, not enforced.

LFS rule (on the Hub the server decides, the client only asks `preupload`): a file goes
to LFS if its path matches a `filter=lfs` pattern of the repo's `.gitattributes` at that
revision (a new repo gets the Hub's default one, with `*.safetensors`, `*.bin`, ...) or
if it is larger than 10 MiB. The client itself forces empty files to "regular".

`HubServer.log` records `"METHOD /path"` for every request, to see which routes ran.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import os
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

USER = "test-user"
LFS_SIZE_THRESHOLD = 10 * 1024 * 1024
LFS_PATTERNS = [  # the Hub's default .gitattributes for a new repo
    "*.7z",
    "*.arrow",
    "*.bin",
    "*.bz2",
    "*.ckpt",
    "*.ftz",
    "*.gz",
    "*.h5",
    "*.joblib",
    "*.model",
    "*.msgpack",
    "*.npy",
    "*.npz",
    "*.onnx",
    "*.ot",
    "*.parquet",
    "*.pb",
    "*.pickle",
    "*.pkl",
    "*.pt",
    "*.pth",
    "*.rar",
    "*.safetensors",
    "saved_model/**/*",
    "*.tar.*",
    "*.tflite",
    "*.tgz",
    "*.wasm",
    "*.xz",
    "*.zip",
    "*.zst",
    "*tfevents*",
]
DEFAULT_GITATTRIBUTES = "".join(f"{pattern} filter=lfs diff=lfs merge=lfs -text\n" for pattern in LFS_PATTERNS)
TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}
SHA_RE = re.compile(r"[0-9a-f]{40}")
_REPO = r"(?P<repo>[^/]+(?:/[^/]+)?)"
API_RE = re.compile(
    rf"/api/(?P<type>models|datasets|spaces)/{_REPO}"
    r"(?:/(?P<action>revision|tree|branch|preupload|commit)/(?P<rev>[^/]+)(?P<path>/.*)?)?"
)
RESOLVE_RE = re.compile(rf"/(?:(?P<type>datasets|spaces)/)?{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)")
LFS_BATCH_RE = re.compile(rf"/(?:(?P<type>datasets|spaces)/)?{_REPO}\.git/info/lfs/objects/batch")


class HubError(Exception):
    """An HTTP error answer: status, message, and optional `X-Error-Code`."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None, **body):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}
        self.body = {"error": message, **body}


def git_oid(data: bytes) -> str:
    """Git blob id of `data` (what the Hub reports as `oid` / ETag of a regular file)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())


class HubServer:
    """Hub-compatible server on 127.0.0.1:`port`, storing repos under `root`."""

    def __init__(self, root: Path, port: int):
        self.root, self.port = Path(root), port
        self.blobs = self.root / "blobs"
        self.blobs.mkdir(parents=True, exist_ok=True)
        self.lock = threading.RLock()
        self.log: list[str] = []
        self.repos: dict[tuple[str, str], dict] = {}  # (repo_type, repo_id) -> repo record
        for meta in (self.root / "repos").glob("*/*/*/repo.json"):  # reload a previous run
            record = json.loads(meta.read_text())
            self.repos[(record["type"], record["id"])] = record
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> HubServer:
        self._httpd = ThreadingHTTPServer(("127.0.0.1", self.port), _Handler)
        self._httpd.daemon_threads = True
        self._httpd.hub = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), name="hub-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    # -- storage -------------------------------------------------------------------------

    def put_blob(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        target = self.blobs / sha
        if not target.exists():
            tmp = target.with_name(f"{sha}.{threading.get_ident()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, target)
        return sha

    def repo(self, rtype: str, repo_id: str) -> dict:
        record = self.repos.get((rtype, repo_id))
        if record is None:
            raise HubError(404, f"Repository {repo_id} not found", "RepoNotFound")
        return record

    def resolve(self, record: dict, rev: str) -> str:
        """Commit sha of a branch name or of a commit sha; RevisionNotFound otherwise."""
        if rev in record["branches"]:
            return record["branches"][rev]
        if SHA_RE.fullmatch(rev) and rev in record["commits"]:
            return rev
        raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")

    def files(self, record: dict, sha: str) -> dict[str, dict]:
        return record["commits"][sha]["files"]

    def save(self, record: dict) -> None:
        path = self.root / "repos" / record["type"] / record["id"] / "repo.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record))

    def add_commit(self, record: dict, branch: str, parent: str | None, message: str, files: dict) -> str:
        payload = json.dumps([record["id"], parent, message, files, time.time_ns()], sort_keys=True)
        sha = hashlib.sha1(payload.encode()).hexdigest()
        record["commits"][sha] = {"parent": parent, "message": message, "date": now(), "files": files}
        record["branches"][branch] = sha
        self.save(record)
        return sha

    def file_record(self, data: bytes) -> dict:
        """A regular (non-LFS) file of a commit; `oid` is its git blob id."""
        return {"sha256": self.put_blob(data), "size": len(data), "lfs": False, "oid": git_oid(data)}

    def lfs_record(self, sha256: str, size: int) -> dict:
        """An LFS file of a commit; `oid` is the git blob id of its pointer file."""
        return {"sha256": sha256, "size": size, "lfs": True, "oid": git_oid(lfs_pointer(sha256, size))}

    def is_lfs(self, files: dict, path: str, size: int) -> bool:
        if size > LFS_SIZE_THRESHOLD:
            return True
        attributes = files.get(".gitattributes")
        text = (self.blobs / attributes["sha256"]).read_text() if attributes else ""
        for line in text.splitlines():
            parts = line.split()
            if len(parts) > 1 and "filter=lfs" in parts[1:]:
                pattern = parts[0]
                target = path if "/" in pattern else path.rsplit("/", 1)[-1]
                if fnmatch.fnmatchcase(target, pattern):
                    return True
        return False


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # else each small response waits ~40 ms for a delayed ACK

    def log_message(self, *args) -> None:  # keep test output quiet; see HubServer.log
        pass

    do_GET = do_HEAD = do_POST = do_PUT = lambda self: self._dispatch()

    # -- plumbing ------------------------------------------------------------------------

    @property
    def hub(self) -> HubServer:
        return self.server.hub  # type: ignore[attr-defined]

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while (size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)) > 0:
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                pass
            return b"".join(chunks)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None) -> None:
        headers = {"Content-Type": "application/json", "Content-Length": str(len(body)), **(headers or {})}
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, obj: object, status: int = 200, headers: dict | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), headers)

    def _require_token(self) -> None:
        if not self.headers.get("Authorization", "").startswith("Bearer "):
            raise HubError(401, "Invalid credentials in Authorization header")

    def _dispatch(self) -> None:
        url = urlsplit(self.path)
        self.query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        self.body = self._read_body() if self.command in ("POST", "PUT") else b""
        self.hub.log.append(f"{self.command} {url.path}")
        routes = [
            ("GET", re.compile(r"/api/whoami-v2"), self.whoami),
            ("POST", re.compile(r"/api/repos/create"), self.create_repo),
            ("POST", re.compile(r"/api/validate-yaml"), self.validate_yaml),
            ("PUT", re.compile(r"/lfs/upload/(?P<oid>[0-9a-f]{64})"), self.lfs_upload),
            ("POST", re.compile(r"/lfs/verify/(?P<oid>[0-9a-f]{64})"), self.lfs_verify),
            ("POST", LFS_BATCH_RE, self.lfs_batch),
            ("GET POST", API_RE, self.api),
            ("GET HEAD", RESOLVE_RE, self.resolve_file),
        ]
        try:
            for methods, regex, handler in routes:
                match = regex.fullmatch(url.path)
                if match and self.command in methods.split():
                    args = {k: unquote(v) if v else v for k, v in match.groupdict().items()}
                    with self.hub.lock:
                        return handler(**args)
            raise HubError(404, f"No route for {self.command} {url.path}")
        except HubError as err:
            headers = {"X-Error-Message": err.message.encode("ascii", "replace").decode(), **err.headers}
            if err.code:
                headers["X-Error-Code"] = err.code
            self._json(err.body, err.status, headers)
        except Exception as err:  # a bug here: answer it rather than drop the connection
            self._json({"error": f"hub_server: {err!r}"}, 500)

    def _locate(self, type: str | None, repo: str, rev: str | None = None) -> tuple[dict, str | None]:
        record = self.hub.repo(TYPES[type or "models"], repo)
        return record, (self.hub.resolve(record, rev) if rev is not None else None)

    # -- routes --------------------------------------------------------------------------

    def whoami(self) -> None:
        self._require_token()
        self._json({"type": "user", "name": USER, "orgs": [], "auth": {"accessToken": {"role": "write"}}})

    def create_repo(self) -> None:
        self._require_token()
        payload = json.loads(self.body)
        rtype = payload.get("type") or "model"
        repo_id = f"{payload.get('organization') or USER}/{payload['name']}"
        url = f"{self.hub.url}/{PREFIX[rtype]}{repo_id}"
        if (rtype, repo_id) in self.hub.repos:
            raise HubError(409, f"You already created this {rtype} repo: {repo_id}", url=url)  # client reads url
        private = bool(payload.get("private")) or payload.get("visibility") == "private"
        record = {"type": rtype, "id": repo_id, "private": private, "created": now(), "branches": {}, "commits": {}}
        files = {".gitattributes": self.hub.file_record(DEFAULT_GITATTRIBUTES.encode())}
        self.hub.add_commit(record, "main", None, "initial commit", files)
        self.hub.repos[(rtype, repo_id)] = record
        self._json({"url": url, "name": repo_id, "id": repo_id})

    def validate_yaml(self) -> None:
        # No YAML parser in the standard library: only check that front matter is closed.
        content = json.loads(self.body).get("content", "")
        if content.startswith("---") and "\n---" not in content[3:]:
            self._json({"errors": [{"message": "Unclosed YAML front matter"}], "warnings": []}, 400)
        else:
            self._json({"errors": [], "warnings": []})

    def api(self, type: str, repo: str, action: str | None, rev: str | None, path: str | None) -> None:
        if self.command == "GET" and action in (None, "revision"):
            return self.repo_info(type, repo, rev or "main")
        if self.command == "GET" and action == "tree":
            return self.tree(type, repo, rev, (path or "").strip("/"))
        if self.command == "POST" and action in ("branch", "preupload", "commit") and not path:
            self._require_token()
            return getattr(self, action)(type, repo, rev)
        raise HubError(404, f"No route for {self.command} {self.path}")

    def repo_info(self, type: str, repo: str, rev: str) -> None:
        record, sha = self._locate(type, repo, rev)
        files = self.hub.files(record, sha)
        info = {"id": record["id"], "author": record["id"].split("/")[0], "sha": sha, "private": record["private"]}
        info.update(createdAt=record["created"], lastModified=record["commits"][sha]["date"])
        self._json({**info, "siblings": [{"rfilename": name} for name in sorted(files)]})

    def tree(self, type: str, repo: str, rev: str, path: str) -> None:
        record, sha = self._locate(type, repo, rev)
        prefix = f"{path}/" if path else ""
        below = {name: f for name, f in self.hub.files(record, sha).items() if name.startswith(prefix)}
        if path and not below:
            raise HubError(404, f"{path} does not exist on {rev}", "EntryNotFound", {"X-Repo-Commit": sha})
        recursive = self.query.get("recursive", "").lower() in ("1", "true")
        entries: dict[str, dict] = {}
        for name, f in sorted(below.items()):
            parts = name[len(prefix) :].split("/")
            for depth in range(1, len(parts)):  # the folders on the way
                folder = prefix + "/".join(parts[:depth])
                if recursive or depth == 1:
                    oid = hashlib.sha1(f"{sha}:{folder}".encode()).hexdigest()
                    entries.setdefault(folder, {"type": "directory", "oid": oid, "size": 0, "path": folder})
            if recursive or len(parts) == 1:
                entry = {"type": "file", "oid": f["oid"], "size": f["size"], "path": name}
                if f["lfs"]:
                    pointer = len(lfs_pointer(f["sha256"], f["size"]))
                    entry["lfs"] = {"oid": f["sha256"], "size": f["size"], "pointerSize": pointer}
                entries[name] = entry
        self._json(list(entries.values()))

    def branch(self, type: str, repo: str, branch: str) -> None:
        record, _ = self._locate(type, repo)
        if branch in record["branches"]:
            raise HubError(409, f"Branch {branch} already exists")
        start = json.loads(self.body or b"{}").get("startingPoint") or "main"
        record["branches"][branch] = self.hub.resolve(record, start)
        self.hub.save(record)
        self._json({})

    def preupload(self, type: str, repo: str, rev: str) -> None:
        record, sha = self._locate(type, repo, rev)
        files = self.hub.files(record, sha)
        answer = []
        for item in json.loads(self.body)["files"]:
            mode = "lfs" if self.hub.is_lfs(files, item["path"], item["size"]) else "regular"
            existing = files.get(item["path"])
            oid = (existing["sha256"] if existing["lfs"] else existing["oid"]) if existing else None
            answer.append({"path": item["path"], "uploadMode": mode, "shouldIgnore": False, "oid": oid})
        self._json({"files": answer, "commitOid": sha})

    def commit(self, type: str, repo: str, rev: str) -> None:
        record, base = self._locate(type, repo, rev)
        lines = [json.loads(line) for line in self.body.splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "The first NDJSON line must be the commit header")
        header = lines[0]["value"]
        branch, pr_num = rev, None
        if self.query.get("create_pr") in ("1", "true"):
            pr_num = 1 + sum(name.startswith("refs/pr/") for name in record["branches"])
            branch = f"refs/pr/{pr_num}"
        elif rev not in record["branches"]:
            raise HubError(400, f"Can only commit to a branch, not to {rev}")
        parent = header.get("parentCommit")
        if parent is not None and pr_num is None and parent != base:
            raise HubError(412, f"A commit has happened since. Parent {parent} is not the head {base} of {rev}")
        files = dict(self.hub.files(record, base))
        for line in lines[1:]:
            key, value = line["key"], line["value"]
            path = value["path"]
            if key == "file":
                files[path] = self.hub.file_record(base64.b64decode(value["content"]))
            elif key == "lfsFile":
                blob = self.hub.blobs / value["oid"]
                if not blob.exists() or ("size" in value and blob.stat().st_size != value["size"]):
                    raise HubError(422, f"LFS object {value['oid']} for {path} was not uploaded")
                files[path] = self.hub.lfs_record(value["oid"], blob.stat().st_size)
            elif key in ("deletedFile", "deletedFolder"):
                folder = path.rstrip("/") + "/"
                doomed = [n for n in files if n == path or (key == "deletedFolder" and n.startswith(folder))]
                if not doomed:
                    raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
                for name in doomed:
                    del files[name]
            else:
                raise HubError(400, f"Unsupported commit operation {key!r}")
        message = header.get("summary") or "commit"
        sha = self.hub.add_commit(record, branch, base, message, files)
        base_url = f"{self.hub.url}/{PREFIX[record['type']]}{record['id']}"
        pr_url = f"{base_url}/discussions/{pr_num}" if pr_num else None
        self._json(
            {"success": True, "commitOid": sha, "commitUrl": f"{base_url}/commit/{sha}", "pullRequestUrl": pr_url}
        )

    def lfs_batch(self, type: str | None, repo: str) -> None:
        self._require_token()
        self._locate(type, repo)
        payload = json.loads(self.body)
        if payload.get("operation") != "upload":
            raise HubError(400, "Only the upload operation is supported")
        objects = []
        for obj in payload["objects"]:
            answer = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            if not (self.hub.blobs / obj["oid"]).exists():  # else: already stored, nothing to send
                answer["actions"] = {
                    "upload": {"href": f"{self.hub.url}/lfs/upload/{obj['oid']}", "header": {}},
                    "verify": {"href": f"{self.hub.url}/lfs/verify/{obj['oid']}", "header": {}},
                }
            objects.append(answer)
        self._json(
            {"transfer": "basic", "objects": objects, "hash_algo": "sha256"},
            headers={"Content-Type": "application/vnd.git-lfs+json"},
        )

    def lfs_upload(self, oid: str) -> None:
        if hashlib.sha256(self.body).hexdigest() != oid:
            raise HubError(400, f"Uploaded content does not match sha256 {oid}")
        self.hub.put_blob(self.body)
        self._send(200)

    def lfs_verify(self, oid: str) -> None:
        blob = self.hub.blobs / oid
        if not blob.exists() or blob.stat().st_size != json.loads(self.body).get("size"):
            raise HubError(404, f"LFS object {oid} not found")
        self._json({"success": True})

    def resolve_file(self, type: str | None, repo: str, rev: str, path: str) -> None:
        record, sha = self._locate(type, repo, rev)
        f = self.hub.files(record, sha).get(path)
        if f is None:
            raise HubError(404, f"Entry not found: {path}", "EntryNotFound", {"X-Repo-Commit": sha})
        headers = {
            "X-Repo-Commit": sha,
            "ETag": f'"{f["oid"]}"',
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
            "Content-Length": str(f["size"]),
        }
        if f["lfs"]:
            headers.update({"X-Linked-Etag": f'"{f["sha256"]}"', "X-Linked-Size": str(f["size"])})
        if self.command == "HEAD":
            return self._send(200, b"", headers)
        data = (self.hub.blobs / f["sha256"]).read_bytes()
        match = re.fullmatch(r"bytes=(\d*)-(\d*)", self.headers.get("Range", "").strip())
        if match and any(match.groups()):
            start_s, end_s = match.groups()
            start = int(start_s) if start_s else max(len(data) - int(end_s), 0)  # "-N" = last N bytes
            end = min(int(end_s), len(data) - 1) if start_s and end_s else len(data) - 1
            if start >= len(data) or start > end:
                raise HubError(416, "Range not satisfiable", headers={"Content-Range": f"bytes */{len(data)}"})
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            chunk = data[start : end + 1]
            headers["Content-Length"] = str(len(chunk))
            return self._send(206, chunk, headers)
        self._send(200, data, headers)
