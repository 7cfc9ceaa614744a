"""What `baton submit` sends, decided locally: the package (ignore rules, size), the entrypoint,
the address and the token. The submission itself is tested against a real Ray head in
tests/integration/test_submit.py."""

from __future__ import annotations

import shlex
import zipfile
from pathlib import Path

import pytest

from baton import cli, storage, submit
from baton.errors import ClusterError
from baton.spec import load_spec
from helpers import write_spec

JOB = {"name": "demo", "data": {"source": "stdlib", "path": "data/demo"},
       "checkpoint": {"path": "checkpoints"}, "train": {"global_batch": 8}}


def _project(root: Path) -> Path:
    files = {
        "train.py": "print('hi')\n",
        "jobs/demo.yaml": "",
        "pkg/model.py": "x = 1\n",
        "pkg/notes.tmp": "scratch\n",
        "pkg/.gitignore": "*.tmp\n",
        "big/blob.bin": "",
        "secret.env": "TOKEN=1\n",
        ".gitignore": "secret.env\n",
        ".rayignore": "big/\n",
        "data/demo/part-0.parquet": "rows\n",
        "checkpoints/demo/step-1/x": "state\n",
        "mlflow.db": "runs\n",
        ".git/HEAD": "ref\n",
        ".venv/bin/python": "",
        "pkg/__pycache__/model.cpython-311.pyc": "",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    write_spec(root / "jobs" / "demo.yaml", JOB)
    return root


def test_the_package_honours_ignore_files_and_leaves_out_run_state(tmp_path, monkeypatch):
    root = _project(tmp_path)
    monkeypatch.chdir(root)
    spec = load_spec(root / "jobs" / "demo.yaml")
    sub = submit.prepare(spec, "jobs/demo.yaml", ["train.steps=5"], out_dir=tmp_path)
    assert sub.package.files == [".gitignore", ".rayignore", "jobs/demo.yaml", "pkg/.gitignore",
                                 "pkg/model.py", "train.py"]
    with zipfile.ZipFile(sub.package.zip_path) as z:
        assert sorted(z.namelist()) == sorted(sub.package.files)
        assert z.read("pkg/model.py") == b"x = 1\n"
    assert sub.entrypoint == "baton run jobs/demo.yaml --set train.steps=5"
    paused = submit.prepare(spec, "jobs/demo.yaml", ["train.steps=5"], out_dir=tmp_path / "p", until=3)
    assert paused.entrypoint == "baton run jobs/demo.yaml --set train.steps=5 --until 3"
    assert cli._parser().parse_args(shlex.split(paused.entrypoint)[1:]).until == 3
    assert sub.runtime_env == {"working_dir": str(sub.package.zip_path)}
    assert sub.submission_id.startswith("baton-demo-")
    assert any("--storage" in w for w in sub.warnings)  # relative paths on the cluster


def test_the_same_files_make_the_same_package(tmp_path, monkeypatch):
    root = _project(tmp_path / "p")
    monkeypatch.chdir(root)
    spec = load_spec(root / "jobs" / "demo.yaml")
    a = submit.prepare(spec, "jobs/demo.yaml", [], out_dir=tmp_path / "a")
    b = submit.prepare(spec, "jobs/demo.yaml", [], out_dir=tmp_path / "b")
    assert a.package.zip_path.read_bytes() == b.package.zip_path.read_bytes()


def test_excludes_storage_and_env(tmp_path, monkeypatch):
    root = _project(tmp_path)
    monkeypatch.chdir(root)
    spec = load_spec(root / "jobs" / "demo.yaml")
    sub = submit.prepare(spec, "jobs/demo.yaml", [], excludes=("pkg/",), storage="/mnt/shared",
                         env={"A": "1"}, submission_id="mine", out_dir=tmp_path)
    assert not any(f.startswith("pkg/") for f in sub.package.files)
    assert sub.runtime_env["env_vars"] == {"A": "1", "BATON_STORAGE": "/mnt/shared"}
    assert sub.submission_id == "mine" and sub.warnings == []
    with pytest.raises(ClusterError, match="give a folder that every node mounts"):
        submit.prepare(spec, "jobs/demo.yaml", [], storage="s3://bucket/x", out_dir=tmp_path)


def test_an_oversized_upload_is_refused_before_anything_is_sent(tmp_path, monkeypatch):
    root = _project(tmp_path)
    (root / "weights").mkdir()
    (root / "weights" / "w.bin").write_bytes(b"\0" * 3 * 2**20)
    monkeypatch.chdir(root)
    spec = load_spec(root / "jobs" / "demo.yaml")
    with pytest.raises(ClusterError) as e:
        submit.prepare(spec, "jobs/demo.yaml", [], max_upload_mb=2, out_dir=tmp_path)
    assert str(e.value).startswith(f"{root} holds 3.0 MiB to upload, more than the 2 MiB limit; "
                                   "largest: weights/ 3.0 MiB")
    assert "--exclude" in str(e.value) and not list(tmp_path.glob("*.zip"))


def test_the_job_file_must_travel(tmp_path, monkeypatch):
    root = _project(tmp_path / "p")
    outside = write_spec(tmp_path / "elsewhere.yaml", JOB)
    monkeypatch.chdir(root)
    with pytest.raises(ClusterError, match="lies outside the folder to upload"):
        submit.prepare(load_spec(outside), str(outside), [], out_dir=tmp_path)
    (root / ".gitignore").write_text("jobs/\n")
    with pytest.raises(ClusterError, match="left out of the upload by an ignore rule"):
        submit.prepare(load_spec(root / "jobs/demo.yaml"), "jobs/demo.yaml", [], out_dir=tmp_path)


def test_address_resolution(monkeypatch):
    for name in ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ClusterError, match="no cluster address"):
        submit.resolve_address(None)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:8265")
    assert submit.resolve_address(None) == "http://10.0.0.5:8265"
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", "https://ray.example:443/")
    assert submit.resolve_address(None) == "https://ray.example:443"
    assert submit.resolve_address("http://127.0.0.1:8265") == "http://127.0.0.1:8265"
    with pytest.raises(ClusterError, match="not a job server"):
        submit.resolve_address("ray://head:10001")


def test_token_resolution(tmp_path, monkeypatch):
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert submit.resolve_token() is None
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("from-home\n")
    assert submit.resolve_token().value == "from-home"
    path_file = tmp_path / "t"
    path_file.write_text("from-path")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(path_file))
    assert submit.resolve_token().value == "from-path"
    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-env")
    assert submit.resolve_token() == submit.Token("from-env", "$RAY_AUTH_TOKEN")
    given = tmp_path / "given"
    given.write_text("from-flag")
    assert submit.resolve_token(str(given)).value == "from-flag"
    given.write_text("  \n")
    with pytest.raises(ClusterError, match="is empty"):
        submit.resolve_token(str(given))
    with pytest.raises(ClusterError, match="cannot read it"):
        submit.resolve_token(str(tmp_path / "missing"))


def test_baton_storage_roots_relative_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("BATON_STORAGE", raising=False)
    assert storage.resolve("checkpoints")[1] == str(tmp_path / "checkpoints")
    monkeypatch.setenv("BATON_STORAGE", "/mnt/shared")
    assert storage.resolve("checkpoints")[1] == "/mnt/shared/checkpoints"
    assert storage.resolve("/abs/ckpt")[1] == "/abs/ckpt"
    from baton.tracking.mlflow_tracker import default_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert default_uri() == "sqlite:////mnt/shared/mlflow.db"


def test_credentials_and_links_out_of_the_project_are_never_sent(tmp_path, monkeypatch):
    """v0.5 packaged a key behind a symlink to a folder outside the project, `.env`, `id_rsa`,
    `key.pem`, `.netrc`, `.aws/credentials` and `.kube/config`, and one `sub/up -> ..` loop added
    398 duplicate files. Each is left out now and named in a warning; --include brings one back;
    git's global excludes file is honoured."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    (home / ".config" / "git").mkdir(parents=True)
    (home / ".config" / "git" / "ignore").write_text("*.log\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    root = _project(tmp_path / "p")
    secrets = {".env": "TOKEN=1", "id_rsa": "key", "key.pem": "key", ".netrc": "machine x",
               ".aws/credentials": "[default]", ".kube/config": "token", "run.log": "log"}
    for rel, text in secrets.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "keys").symlink_to(home / ".ssh")  # a folder outside the project
    (root / "pkg" / "up").symlink_to("..")  # a loop
    (root / "settings").symlink_to(".env")  # a link to a secret inside it
    (root / "again.py").symlink_to("train.py")  # a link to a plain file inside it: sent
    monkeypatch.chdir(root)
    spec = load_spec(root / "jobs" / "demo.yaml")
    sub = submit.prepare(spec, "jobs/demo.yaml", [], out_dir=tmp_path / "out")
    assert sub.package.files == [".gitignore", ".rayignore", "again.py", "jobs/demo.yaml",
                                 "pkg/.gitignore", "pkg/model.py", "train.py"]
    with zipfile.ZipFile(sub.package.zip_path) as z:
        assert not any(b"KEY" in z.read(name) or b"TOKEN" in z.read(name) for name in z.namelist())
    assert sub.package.secrets == [".aws/", ".env", ".kube/", ".netrc", "id_rsa", "key.pem",
                                   "settings -> .env"]
    assert [line.split(" -> ")[0] for line in sub.package.links] == ["keys", "pkg/up"]
    notes = " | ".join(sub.warnings)
    assert "left out as credentials (--include PATTERN sends one): .aws/, .env" in notes
    assert f"keys -> {home / '.ssh'} (outside {root})" in notes and "pkg/up -> " in notes
    again = submit.prepare(spec, "jobs/demo.yaml", [], includes=(".env",), out_dir=tmp_path / "out")
    assert ".env" in again.package.files and "id_rsa" not in again.package.files


def test_the_upload_zip_is_removed_after_a_dry_run(tmp_path, monkeypatch, capsys):
    """v0.5 left every upload's zip in a temporary folder, --dry-run included."""
    from baton import cli

    root = _project(tmp_path / "p")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(scratch))
    monkeypatch.chdir(root)
    assert cli.main(["submit", "jobs/demo.yaml", "--dry-run", "--address", "http://127.0.0.1:1"]) == 0
    assert "runtime_env" in capsys.readouterr().out
    assert list(scratch.iterdir()) == []


def test_a_token_over_plain_http_to_another_host_is_warned():
    assert "over plain http://" in submit.plain_http_warning("http://10.1.2.3:8265")
    assert "ray-head.example" in submit.plain_http_warning("http://ray-head.example:8265")
    for fine in ("http://127.0.0.1:8265", "http://localhost:8265", "http://[::1]:8265",
                 "https://ray-head.example:8265"):
        assert submit.plain_http_warning(fine) is None


class _StartingHead:
    """Ray's JobSubmissionClient as a head whose job agent is still starting answers it: a
    RuntimeError with the dashboard's 500 text (as seen in a CI run), `busy` times over."""

    def __init__(self, busy: int, then=None):
        self.busy, self.then, self.calls = busy, then, 0

    def submit_job(self, **kwargs):
        self.calls += 1
        if self.calls <= self.busy:
            raise RuntimeError("Request failed with status code 500: No available agent to submit "
                               "job, please try again later.")
        if self.then is not None:
            raise self.then
        return kwargs["submission_id"]


def _cluster(client) -> submit.Cluster:
    cluster = submit.Cluster.__new__(submit.Cluster)
    cluster.address, cluster.token, cluster.client = "http://127.0.0.1:1", None, client
    return cluster


def test_a_submission_waits_for_a_job_agent_that_is_still_starting(monkeypatch):
    monkeypatch.setattr(submit.time, "sleep", lambda s: None)
    head = _StartingHead(busy=2)
    job = dict(entrypoint="baton run job.yaml", runtime_env={}, submission_id="q-1", metadata={})
    assert _cluster(head).submit(**job) == "q-1" and head.calls == 3
    with pytest.raises(ClusterError, match=r"^the cluster at http://127.0.0.1:1: Request failed "
                                           r"with status code 500: No available agent"):
        _cluster(_StartingHead(busy=10**6)).submit(**job, agent_wait_s=0.0)


def test_a_head_that_closes_the_connection_is_one_line():
    import requests

    closed = requests.exceptions.ConnectionError("('Connection aborted.', RemoteDisconnected("
                                                 "'Remote end closed connection without response'))")
    with pytest.raises(ClusterError, match=r"^cannot reach a Ray job server at http://127.0.0.1:1: "):
        _cluster(_StartingHead(busy=0, then=closed)).submit(
            entrypoint="x", runtime_env={}, submission_id="q-2", metadata={})
