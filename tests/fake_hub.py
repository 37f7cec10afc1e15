"""A local stand-in for the Hugging Face Hub, so the real download code can be tested offline.

The test machines cannot reach huggingface.co, so the hub is the one part of 01_download/download.py
that cannot run for real. This module serves repositories from local folders over real HTTP, with
the endpoints, status codes and headers that huggingface_hub (2.x) uses for `snapshot_download`,
`HfApi().list_repo_files` and `hf_hub_download`. The client is not patched: point it here with
HF_ENDPOINT=hub.endpoint (read when huggingface_hub is imported, so set it before Python starts).

    GET      /api/{models|datasets}/ORG/NAME[/revision/REV]        repo info: id, sha, siblings
    GET      /api/{models|datasets}/ORG/NAME/tree/REV[/PATH]       listing (?recursive=true|false)
    HEAD|GET /ORG/NAME/resolve/REV/FILE                            a model file
    HEAD|GET /datasets/ORG/NAME/resolve/REV/FILE                   a dataset file
    GET      (second port, the "CDN") /lfs/SHA256?repo=..&file=..  the bytes of a large file
    GET      /api/agent-harnesses                                  a registry the client reads once a day

REV is `main` or the repo's commit sha. Small files are answered directly: 200 with ETag (the git
blob id), X-Repo-Commit and Content-Length. Large files (weights, parquet: git-LFS on the hub) get a
302 with X-Linked-Etag (sha256), X-Linked-Size, X-Repo-Commit and a Location on the CDN server,
which listens on another port and so is another origin, as on the real hub. No Xet headers or
xetHash fields are ever sent, so huggingface_hub downloads over plain HTTP. Errors carry the hub's
X-Error-Code (RepoNotFound, RevisionNotFound, EntryNotFound).

Every request is recorded in `hub.requests`; `hub.downloads()` lists the files whose bytes were sent.
"""
import hashlib
import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".parquet", ".model")  # what the hub's .gitattributes puts in LFS


@dataclass(frozen=True)
class Request:
    server: str                  # "hub" or "cdn"
    method: str                  # "GET" or "HEAD"
    path: str                    # unquoted, without the query
    query: dict
    status: int
    sent: tuple | None = None    # (repo type, repo id, file name) when the file's bytes were sent


class Repo:
    """A folder's files, frozen into one commit."""

    def __init__(self, repo_type, repo_id, folder):
        self.repo_type, self.repo_id = repo_type, repo_id
        folder = Path(folder)
        self.files = {p.relative_to(folder).as_posix(): p.read_bytes()
                      for p in sorted(folder.rglob("*")) if p.is_file()}
        listing = json.dumps([repo_type, repo_id,
                              sorted((name, git_blob_id(data)) for name, data in self.files.items())])
        self.sha = hashlib.sha1(listing.encode()).hexdigest()

    def is_lfs(self, name):
        return name.endswith(LFS_SUFFIXES)

    def entry(self, name):
        """One file as the hub's /tree endpoint describes it."""
        data = self.files[name]
        if not self.is_lfs(name):
            return {"type": "file", "oid": git_blob_id(data), "size": len(data), "path": name}
        pointer = lfs_pointer(data)
        return {"type": "file", "oid": git_blob_id(pointer), "size": len(data), "path": name,
                "lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": len(pointer)}}

    def folders(self):
        return sorted({"/".join(name.split("/")[:i]) for name in self.files for i in range(1, name.count("/") + 1)})


def git_blob_id(data):
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(data):
    return (f"version https://git-lfs.github.com/spec/v1\noid sha256:{hashlib.sha256(data).hexdigest()}\n"
            f"size {len(data)}\n").encode()


class FakeHub:
    """Start with `with FakeHub() as hub:`; add repos with `hub.add_repo(...)` (before or after)."""

    def __init__(self):
        self.repos = {}                # ("model"|"dataset", "org/name") -> Repo
        self.requests = []
        self._lock = threading.Lock()
        self._servers = []

    # ---- setup -----------------------------------------------------------------------------------

    def add_repo(self, repo_id, folder, repo_type="model"):
        """Serve the files under `folder` as repo `repo_id`; returns its commit sha."""
        repo = Repo(repo_type, repo_id, folder)
        self.repos[(repo_type, repo_id)] = repo
        return repo.sha

    def __enter__(self):
        self.hub_server = self._serve("hub")
        self.cdn_server = self._serve("cdn")
        self.endpoint = f"http://127.0.0.1:{self.hub_server.server_address[1]}"
        self.cdn = f"http://127.0.0.1:{self.cdn_server.server_address[1]}"
        return self

    def __exit__(self, *exc):
        for server in self._servers:
            server.shutdown()
            server.server_close()

    def _serve(self, name):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                hub._answer(name, self, body=True)

            def do_HEAD(self):
                hub._answer(name, self, body=False)

            def log_message(self, *args):  # keep test output clean; the record is in hub.requests
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self._servers.append(server)
        return server

    # ---- what the tests look at ------------------------------------------------------------------

    def downloads(self):
        """(repo_id, file name) of every file whose bytes were sent, in order."""
        return [r.sent[1:] for r in self.requests if r.sent]

    def clear(self):
        with self._lock:
            self.requests.clear()

    # ---- answering -------------------------------------------------------------------------------

    def _answer(self, server, handler, body):
        url = urlsplit(handler.path)
        path, query = unquote(url.path), {k: v[-1] for k, v in parse_qs(url.query).items()}
        route = self._route_cdn if server == "cdn" else self._route_hub
        status, headers, content, sent = route(handler.command, path, query)
        with self._lock:
            self.requests.append(Request(server, handler.command, path, query, status, sent))
        handler.send_response(status)
        for key, value in {"Content-Length": str(len(content)), **headers}.items():
            handler.send_header(key, value)
        handler.end_headers()
        if body:
            handler.wfile.write(content)

    def _route_hub(self, method, path, query):
        parts = path.strip("/").split("/")
        if path == "/api/agent-harnesses":  # huggingface_hub's user-agent asks for it; cached a day in HF_HOME
            return json_response({"standardEnvVars": [], "harnesses": {}})
        if parts[0] == "api" and len(parts) >= 4 and parts[1] in ("models", "datasets"):
            repo_type, repo_id, rest = parts[1][:-1], "/".join(parts[2:4]), parts[4:]
            repo = self.repos.get((repo_type, repo_id))
            if repo is None:
                return error(404, "RepoNotFound", f"Repository {repo_id} not found")
            if not rest:
                return self._info(repo)
            if rest[0] == "revision" and len(rest) == 2:
                return self._info(repo) if rest[1] in ("main", repo.sha) else error(404, "RevisionNotFound")
            if rest[0] == "tree" and len(rest) >= 2:
                if rest[1] not in ("main", repo.sha):
                    return error(404, "RevisionNotFound")
                return self._tree(repo, "/".join(rest[2:]), query.get("recursive", "false").lower() == "true")
            return error(404, None, "no such endpoint")
        repo_type = "dataset" if parts[0] == "datasets" else "model"
        parts = parts[1:] if repo_type == "dataset" else parts
        if len(parts) >= 5 and parts[2] == "resolve":
            repo = self.repos.get((repo_type, "/".join(parts[:2])))
            if repo is None:
                return error(404, "RepoNotFound")
            if parts[3] not in ("main", repo.sha):
                return error(404, "RevisionNotFound")
            return self._resolve(repo, "/".join(parts[4:]), method)
        return error(404, None, "no such endpoint")

    def _info(self, repo):
        info = {"id": repo.repo_id, "sha": repo.sha, "private": False, "disabled": False, "gated": False,
                "siblings": [{"rfilename": name} for name in repo.files]}
        return json_response(info)

    def _tree(self, repo, folder, recursive):
        prefix = folder + "/" if folder else ""
        depth = prefix.count("/")
        folders = [{"type": "directory", "oid": hashlib.sha1(name.encode()).hexdigest(), "size": 0, "path": name}
                   for name in repo.folders()
                   if name.startswith(prefix) and (recursive or name.count("/") == depth)]
        files = [repo.entry(name) for name in repo.files
                 if name.startswith(prefix) and (recursive or name.count("/") == depth)]
        if folder and not folders and not files:
            return error(404, "EntryNotFound", headers={"X-Repo-Commit": repo.sha})
        return json_response(folders + files)

    def _resolve(self, repo, name, method):
        if name not in repo.files:
            return error(404, "EntryNotFound", headers={"X-Repo-Commit": repo.sha})
        data = repo.files[name]
        if not repo.is_lfs(name):
            headers = {"ETag": f'"{git_blob_id(data)}"', "X-Repo-Commit": repo.sha,
                       "Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}
            return 200, headers, data, ((repo.repo_type, repo.repo_id, name) if method == "GET" else None)
        sha256 = hashlib.sha256(data).hexdigest()
        key = quote(f"{repo.repo_type}:{repo.repo_id}", safe="")
        location = f"{self.cdn}/lfs/{sha256}?repo={key}&file={quote(name, safe='')}"
        headers = {"Location": location, "ETag": f'"{git_blob_id(lfs_pointer(data))}"',
                   "X-Linked-Etag": f'"{sha256}"', "X-Linked-Size": str(len(data)), "X-Repo-Commit": repo.sha}
        return 302, headers, b"", None

    def _route_cdn(self, method, path, query):
        parts = path.strip("/").split("/")
        repo_type, _, repo_id = query.get("repo", "").partition(":")
        repo, name = self.repos.get((repo_type, repo_id)), query.get("file", "")
        if len(parts) != 2 or parts[0] != "lfs" or repo is None or name not in repo.files \
                or hashlib.sha256(repo.files[name]).hexdigest() != parts[1]:
            return 404, {"Content-Type": "text/plain"}, b"not found", None
        data = repo.files[name]
        headers = {"ETag": f'"{parts[1]}"', "Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}
        return 200, headers, data, ((repo_type, repo_id, name) if method == "GET" else None)


def json_response(value):
    return 200, {"Content-Type": "application/json"}, json.dumps(value).encode(), None


def error(status, code, message="", headers=None):
    headers = {"Content-Type": "application/json", **(headers or {})}
    if code:
        headers["X-Error-Code"] = code
    if message:
        headers["X-Error-Message"] = message
    return status, headers, json.dumps({"error": message or code}).encode(), None
