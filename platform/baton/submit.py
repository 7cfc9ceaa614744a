"""Jobs on a remote Ray cluster: package the working directory, submit `baton run JOB.yaml`
through Ray's Job Submission API, and look after the jobs (status, logs, stop, list).

Nothing here runs on the cluster: the entrypoint is the plain `baton run`, so any Ray cluster
with baton installed takes the job (Ray's own `ray job submit` with the same entrypoint and
runtime environment works as well).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import secrets
import shlex
import shutil
import subprocess
import tempfile
import time
import zipfile
from urllib.parse import urlsplit
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

from baton.errors import ClusterError
from baton.spec import JobSpec

ADDRESS_ENVS = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")
DEFAULT_MAX_UPLOAD_MB = 100.0
# Left out of every package, whatever the ignore files say: version control, environments,
# caches, and the stores a run writes (a job's own data and checkpoint folders are added).
ALWAYS_EXCLUDED = (".git/", ".venv/", "venv/", "__pycache__/", "*.pyc", ".pytest_cache/",
                   "*.egg-info/", "mlruns/", "mlartifacts/", "mlflow.db", "mlflow.db-journal")
IGNORE_FILES = (".gitignore", ".rayignore")
# Credentials a project folder may hold: never sent unless --include names them (a Ray job's
# working directory is readable by every job on the cluster, and kept in its GCS).
SECRETS = (".env", ".env.*", "*.pem", "*.key", "*.p12", "*.pfx", "id_rsa*", "id_dsa*",
           "id_ecdsa*", "id_ed25519*", ".netrc", ".pgpass", ".git-credentials", ".aws/", ".ssh/",
           ".kube/", ".ray/", ".gnupg/", ".docker/")
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
# A head whose job agent is still starting (a new cluster, a head pod just restarted) answers
# a submission, after 10 s of its own wait, with "No available agent to submit job, please try
# again later": baton tries again for this long (seen in CI on a busy 2-core machine)
AGENT_WAIT_S = 60.0
NO_AGENT = "No available agent"


# --- where and who -------------------------------------------------------------------------

def resolve_address(address: Optional[str]) -> str:
    """The dashboard's HTTP address: --address, else $RAY_API_SERVER_ADDRESS, else $RAY_ADDRESS."""
    source = "--address"
    if not address:
        for name in ADDRESS_ENVS:
            if os.environ.get(name):
                address, source = os.environ[name].strip(), f"${name}"
                break
    if not address:
        raise ClusterError("no cluster address: pass --address http://HEAD:8265 or set "
                           "RAY_API_SERVER_ADDRESS (port-forward the head's port 8265 on Kubernetes)")
    if address in ("auto", "local") or address.startswith("ray://"):
        raise ClusterError(f"{source} is {address!r}, which is not a job server: give the head's "
                           "dashboard address, e.g. http://HEAD:8265")
    if "://" not in address:
        address = f"http://{address}"
    if not address.startswith(("http://", "https://")):
        raise ClusterError(f"{source} {address!r}: use http:// or https://")
    return address.rstrip("/")


def plain_http_warning(address: str) -> Optional[str]:
    """A warning when a token would cross the network unencrypted: http:// to a host that is
    not this machine (a port-forward to 127.0.0.1 is fine)."""
    parts = urlsplit(address)
    host = parts.hostname or ""
    if parts.scheme != "http" or host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        pass
    return (f"the Ray token goes to {host} over plain http://, readable on the way: use "
            "https://, or a port-forward or SSH tunnel to 127.0.0.1")


@dataclass(frozen=True)
class Token:
    value: str
    source: str  # where it came from, for error messages


def resolve_token(token_file: Optional[str] = None) -> Optional[Token]:
    """Ray's token, looked up where Ray looks: --token-file, $RAY_AUTH_TOKEN,
    $RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token. None when there is none (a cluster without token
    authentication needs none)."""
    if token_file:
        return Token(_read_token(Path(token_file).expanduser(), "--token-file"), f"--token-file {token_file}")
    if os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return Token(os.environ["RAY_AUTH_TOKEN"].strip(), "$RAY_AUTH_TOKEN")
    if os.environ.get("RAY_AUTH_TOKEN_PATH"):
        path = Path(os.environ["RAY_AUTH_TOKEN_PATH"]).expanduser()
        return Token(_read_token(path, "$RAY_AUTH_TOKEN_PATH"), str(path))
    default = Path.home() / ".ray" / "auth_token"
    if default.is_file():
        return Token(_read_token(default, "the token file"), str(default))
    return None


def _read_token(path: Path, what: str) -> str:
    try:
        value = path.read_text().strip()
    except OSError as e:
        raise ClusterError(f"{what} {path}: cannot read it ({e.strerror})") from None
    if not value:
        raise ClusterError(f"{what} {path} is empty")
    return value


# --- what is sent ----------------------------------------------------------------------------

@dataclass
class Package:
    root: Path
    files: list[str] = field(default_factory=list)  # relative posix paths
    size_bytes: int = 0
    zip_path: Optional[Path] = None
    secrets: list[str] = field(default_factory=list)  # credentials left out (SECRETS)
    links: list[str] = field(default_factory=list)  # symlinks not followed, and why


def collect(root: Path, excludes: tuple[str, ...] = (), includes: tuple[str, ...] = ()) -> Package:
    """The files of `root` to send: everything but what its .gitignore/.rayignore files (at any
    depth, as git reads them), .git/info/exclude, git's global excludes file,
    `ALWAYS_EXCLUDED` and `excludes` (gitignore patterns relative to root) leave out; and
    never `SECRETS` unless `includes` names them. Symlinks are sent only as files inside root:
    a link out of root (to ~/.ssh, say) or to a folder (which may loop: `sub/up -> ..`) is not
    followed, and listed in `Package.links`."""
    from pathspec import GitIgnoreSpec

    root = root.resolve()
    pkg = Package(root)
    info_exclude = root / ".git" / "info" / "exclude"  # git's own per-clone ignore file
    local = info_exclude.read_text().splitlines() if info_exclude.is_file() else []
    base = GitIgnoreSpec.from_lines([*ALWAYS_EXCLUDED, *global_excludes(), *local, *excludes])
    secret, wanted = GitIgnoreSpec.from_lines(SECRETS), GitIgnoreSpec.from_lines(includes)
    # (folder relative to root, its spec): patterns of a nested ignore file are relative to it
    specs: list[tuple[str, GitIgnoreSpec]] = [("", base)]

    def ignored(rel: str, is_dir: bool) -> bool:
        for prefix, spec in specs:
            if prefix and not rel.startswith(prefix):
                continue
            sub = rel[len(prefix):] + ("/" if is_dir else "")
            if spec.match_file(sub):
                return True
        return False

    def walk(folder: Path, rel_folder: str) -> None:
        added = 0
        for name in IGNORE_FILES:
            f = folder / name
            if f.is_file():
                specs.append((rel_folder, GitIgnoreSpec.from_lines(f.read_text().splitlines())))
                added += 1
        for entry in sorted(folder.iterdir(), key=lambda p: p.name):
            rel = f"{rel_folder}{entry.name}"
            if entry.is_symlink():
                if not entry.exists():
                    continue  # a dangling link cannot be packaged
                target = entry.resolve()
                if root not in target.parents:
                    pkg.links.append(f"{rel} -> {target} (outside {root})")
                    continue
                if target.is_dir():
                    pkg.links.append(f"{rel} -> {target} (a folder: sent under its own path)")
                    continue
                aim = target.relative_to(root).as_posix()  # a link to .env is .env
                if secret.match_file(aim) and not wanted.match_file(aim):
                    pkg.secrets.append(f"{rel} -> {aim}")
                    continue
            sub = rel + ("/" if entry.is_dir() else "")
            if secret.match_file(sub) and not wanted.match_file(sub):
                pkg.secrets.append(sub)
                continue
            if entry.is_dir():
                if not ignored(rel, True):
                    walk(entry, rel + "/")
            elif entry.is_file() and not ignored(rel, False):
                pkg.files.append(rel)
                pkg.size_bytes += entry.stat().st_size
        del specs[len(specs) - added:]

    walk(root, "")
    return pkg


def global_excludes() -> list[str]:
    """The lines of git's global excludes file (core.excludesFile, else
    $XDG_CONFIG_HOME/git/ignore or ~/.config/git/ignore), as git itself honours them."""
    path = None
    try:
        out = subprocess.run(["git", "config", "--global", "--get", "core.excludesFile"],
                             capture_output=True, text=True, timeout=10)
        path = out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    if path is None:
        config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
        path = os.path.join(config, "git", "ignore")
    try:
        return Path(path).expanduser().read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return []


def job_excludes(spec: JobSpec, root: Path, job_file: Path) -> tuple[str, ...]:
    """Patterns for the job's own data and checkpoint folders when they lie inside root: the
    cluster prepares or reads data where the job says and keeps its own checkpoints."""
    from baton import storage

    out = []
    for path in (*spec.data.paths, spec.checkpoint.path):
        if storage.is_uri(path):
            continue
        full = Path(storage.local_path(path)).resolve()
        if root in full.parents:
            if full == job_file or full in job_file.parents:
                continue  # never leave out the job file itself
            out.append("/" + full.relative_to(root).as_posix() + "/")
    return tuple(out)


def check_size(pkg: Package, max_mb: float) -> None:
    if pkg.size_bytes <= max_mb * 2**20:
        return
    biggest = _largest_folders(pkg)
    raise ClusterError(
        f"{pkg.root} holds {pkg.size_bytes / 2**20:.1f} MiB to upload, more than the "
        f"{max_mb:g} MiB limit; largest: {biggest}. Add them to .gitignore or .rayignore, pass "
        "--exclude PATTERN, or raise --max-upload-mb")


def _largest_folders(pkg: Package, count: int = 3) -> str:
    sizes: dict[str, int] = {}
    for rel in pkg.files:
        top = rel.split("/", 1)[0] + ("/" if "/" in rel else "")
        sizes[top] = sizes.get(top, 0) + (pkg.root / rel).stat().st_size
    top = sorted(sizes.items(), key=lambda kv: -kv[1])[:count]
    return ", ".join(f"{name} {size / 2**20:.1f} MiB" for name, size in top)


def write_zip(pkg: Package, out_dir: Path) -> Path:
    """A zip of the package's files at its top level (Ray unpacks it as the job's working
    directory). Fixed timestamps keep it content-addressed: the same files upload once."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"baton-{pkg.root.name or 'job'}.zip"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for rel in pkg.files:
            info = zipfile.ZipInfo(rel, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = ((pkg.root / rel).stat().st_mode & 0o777) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, (pkg.root / rel).read_bytes())
    pkg.zip_path = path
    return path


def entrypoint(job_rel: str, overrides: list[str], until: Optional[int] = None) -> str:
    """The command the cluster runs: plain `baton run`, which joins the cluster through the
    $RAY_ADDRESS that Ray sets for a job's entrypoint (`until`: its --until)."""
    return shlex.join(["baton", "run", job_rel, *[a for o in overrides for a in ("--set", o)],
                       *(["--until", str(until)] if until is not None else [])])


# --- the cluster -----------------------------------------------------------------------------

class Cluster:
    """A thin layer over Ray's `JobSubmissionClient` that turns its failures into one line."""

    def __init__(self, address: Optional[str] = None, token_file: Optional[str] = None):
        for name in ("ray.dashboard.modules.dashboard_sdk", "ray.dashboard.modules.job.sdk"):
            logging.getLogger(name).setLevel(logging.WARNING)  # "Uploading package ..." lines
        self.address = resolve_address(address)
        self.token = resolve_token(token_file)
        self.warning = plain_http_warning(self.address) if self.token else None
        from ray.job_submission import JobSubmissionClient

        # The token goes as an explicit header: Ray's client adds one only when this machine's
        # own Ray is in token mode, which says nothing about the remote cluster.
        headers = {"Authorization": f"Bearer {self.token.value}"} if self.token else None
        # Ray's client lets $RAY_API_SERVER_ADDRESS and $RAY_ADDRESS override the address it is
        # given; baton already chose (--address first), so they are hidden while it is built.
        saved = {name: os.environ.pop(name) for name in ADDRESS_ENVS if name in os.environ}
        try:
            self.client = self._call(lambda: JobSubmissionClient(self.address, headers=headers))
        finally:
            os.environ.update(saved)

    def _call(self, fn: Callable, job_id: Optional[str] = None):
        from ray.exceptions import AuthenticationError
        from requests.exceptions import ConnectionError as RequestsConnectionError

        try:
            return fn()
        except AuthenticationError as e:
            if "401" in str(e) or "Authentication required" in str(e):
                raise ClusterError(
                    f"the cluster at {self.address} requires a token and none was found: set "
                    "RAY_AUTH_TOKEN or pass --token-file (on the head, `ray get-auth-token` "
                    "prints it)") from None
            raise ClusterError(f"the cluster at {self.address} refused the token from "
                               f"{self.token.source if self.token else '(none)'}") from None
        except (ConnectionError, RequestsConnectionError):  # refused, or closed without an answer
            raise ClusterError(f"cannot reach a Ray job server at {self.address}: is the head "
                               "running, and the port forwarded?") from None
        except RuntimeError as e:
            text = str(e)
            if job_id and ("does not exist" in text or "404" in text):
                raise ClusterError(f"no job {job_id!r} on the cluster at {self.address}") from None
            if "already exists" in text:
                raise ClusterError(f"a job with submission id {job_id!r} already exists on the "
                                   f"cluster at {self.address}; choose another --id") from None
            raise ClusterError(f"the cluster at {self.address}: {_first_line(text)}") from None

    def submit(self, *, entrypoint: str, runtime_env: dict, submission_id: str,
               metadata: dict, agent_wait_s: float = AGENT_WAIT_S) -> str:
        deadline = time.monotonic() + agent_wait_s
        while True:
            try:
                return self._call(lambda: self.client.submit_job(
                    entrypoint=entrypoint, runtime_env=runtime_env, submission_id=submission_id,
                    metadata=metadata), submission_id)
            except ClusterError as e:  # nothing was submitted: the same id is free to try again
                if NO_AGENT not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(2.0)

    def info(self, job_id: str):
        return self._call(lambda: self.client.get_job_info(job_id), job_id)

    def status(self, job_id: str) -> str:
        return str(self._call(lambda: self.client.get_job_status(job_id), job_id).value)

    def logs(self, job_id: str) -> str:
        return self._call(lambda: self.client.get_job_logs(job_id), job_id)

    def follow(self, job_id: str) -> Iterator[str]:
        """The job's output as it comes, until the job ends."""
        self.info(job_id)  # a clear error for an unknown id, before the websocket opens
        loop = asyncio.new_event_loop()
        stream = self.client.tail_job_logs(job_id)
        try:
            while True:
                try:
                    chunk = self._call(lambda: loop.run_until_complete(stream.__anext__()), job_id)
                except StopAsyncIteration:
                    return
                yield chunk
        finally:
            loop.run_until_complete(stream.aclose())
            loop.close()

    def stop(self, job_id: str) -> bool:
        return self._call(lambda: self.client.stop_job(job_id), job_id)

    def list(self) -> list:
        return self._call(self.client.list_jobs)


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0][:300] if lines else "request failed"


# --- submit ----------------------------------------------------------------------------------

@dataclass
class Submission:
    submission_id: str
    entrypoint: str
    package: Package
    runtime_env: dict
    warnings: list[str] = field(default_factory=list)
    scratch: Optional[Path] = None  # the temporary folder holding the zip, removed by discard

    def discard(self) -> None:
        """Remove the zip's temporary folder (after the upload, or a dry run)."""
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None


def prepare(spec: JobSpec, job_file: str, overrides: list[str], *, root: Optional[str] = None,
            excludes: tuple[str, ...] = (), includes: tuple[str, ...] = (),
            max_upload_mb: float = DEFAULT_MAX_UPLOAD_MB,
            storage: Optional[str] = None, env: Optional[dict] = None,
            submission_id: Optional[str] = None, out_dir: Optional[Path] = None,
            until: Optional[int] = None) -> Submission:
    """Everything `submit` sends, built and checked locally before the cluster is contacted."""
    root_path = Path(root or os.getcwd()).resolve()
    job_path = Path(job_file).resolve()
    if not root_path.is_dir():
        raise ClusterError(f"--root {root_path} is not a folder")
    pkg = collect(root_path, tuple(excludes) + job_excludes(spec, root_path, job_path), tuple(includes))
    if root_path not in job_path.parents:
        raise ClusterError(f"{job_file} lies outside the folder to upload ({root_path}); run "
                           "baton submit from the project folder or pass --root")
    job_rel = job_path.relative_to(root_path).as_posix()
    if job_rel not in pkg.files:
        raise ClusterError(f"{job_file} is left out of the upload by an ignore rule; the cluster "
                           "needs it: un-ignore it or move it")
    check_size(pkg, max_upload_mb)
    scratch = None if out_dir else Path(tempfile.mkdtemp(prefix="baton-submit-"))
    write_zip(pkg, out_dir or scratch)

    env_vars = dict(env or {})
    warnings = []
    if pkg.secrets:
        warnings.append(f"left out as credentials (--include PATTERN sends one): {', '.join(pkg.secrets)}")
    if pkg.links:
        warnings.append(f"symlinks not followed: {'; '.join(pkg.links)}")
    if storage:
        if "://" in storage:
            raise ClusterError(f"--storage {storage!r}: give a folder that every node mounts "
                               "(for object storage, set checkpoint.path to the URI instead)")
        env_vars["BATON_STORAGE"] = storage
    elif any(_is_relative_local(p) for p in (*spec.data.paths, spec.checkpoint.path)):
        warnings.append(
            "relative paths (data.path, checkpoint.path) resolve in the job's upload folder on "
            "the cluster, which a later submission does not reuse: pass --storage /shared/folder "
            "(or give absolute paths or URIs) to resume from this job's checkpoints")
    runtime_env = {"working_dir": str(pkg.zip_path)}
    if env_vars:
        runtime_env["env_vars"] = env_vars
    return Submission(
        submission_id=submission_id or f"baton-{spec.name}-{secrets.token_hex(4)}",
        entrypoint=entrypoint(job_rel, overrides, until), package=pkg, runtime_env=runtime_env,
        warnings=warnings, scratch=scratch)


def _is_relative_local(path: str) -> bool:
    from baton import storage

    return not storage.is_uri(path) and not os.path.isabs(
        path[len("file://"):] if path.startswith("file://") else path)


def submit(cluster: Cluster, sub: Submission, spec: JobSpec, job_file: str) -> str:
    metadata = {"baton.job": spec.name, "baton.file": job_file}
    return cluster.submit(entrypoint=sub.entrypoint, runtime_env=sub.runtime_env,
                          submission_id=sub.submission_id, metadata=metadata)


__all__ = ["Cluster", "Package", "Submission", "collect", "prepare", "submit", "resolve_address",
           "resolve_token", "TERMINAL"]
