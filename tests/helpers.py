"""Small real-text datasets and specs for tests."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from baton.data import Cursor, EpochOrder
from baton.data.corpus import stdlib_stream, windows
from baton.data.feed import IDS, TOKENS, Batch
from baton.data.local import job_order as _job_order, read_corpus
from baton.models import build_model, loss_sum, routed
from baton.models.layers import Layers
from baton.models.documents import attend_within, attending
from baton.tasks import IGNORE, make_task
from baton.training import clip_and_norm, make_optimizer, set_lr

_STREAM = None


def write_dataset(folder: Path, num_samples: int, seq_len: int, shards: int = 2,
                  id_offset: int = 1000, row_group_rows: int | None = None,
                  loss_mask: bool = False) -> Path:
    """`num_samples` rows of stdlib text, seq_len + 1 tokens each, ids id_offset.. in shuffled
    shard order (so nothing may rely on file order); row groups of `row_group_rows`.
    `loss_mask`: with a `loss_mask` column (data.loss_mask_column) marking about two thirds
    of each row's tokens, in a pattern of its own a row."""
    global _STREAM
    if _STREAM is None:
        _STREAM = stdlib_stream()[0]
    rows = windows(_STREAM[: num_samples * seq_len + 1], seq_len)[:num_samples]
    assert len(rows) == num_samples
    folder.mkdir(parents=True, exist_ok=True)
    ids = np.arange(id_offset, id_offset + num_samples)
    for k, part in enumerate(np.array_split(np.arange(num_samples), shards)[::-1]):
        tokens = pa.FixedSizeListArray.from_arrays(pa.array(rows[part].reshape(-1)), seq_len + 1)
        columns = {"sample_id": ids[part], "tokens": tokens}
        if loss_mask:
            marks = ((rows[part] + np.arange(seq_len + 1)) % 3 != 0).astype(np.uint8)
            columns["loss_mask"] = pa.FixedSizeListArray.from_arrays(pa.array(marks.reshape(-1)), seq_len + 1)
        pq.write_table(pa.table(columns), folder / f"part-{k}.parquet", row_group_size=row_group_rows)
    return folder


KEEP_WARM_S = 0.0  # resources.keep_warm_s of tiny_spec's jobs (conftest's warm_workers sets it)


def require_cxx() -> None:
    """Skip a test of train.compile on CPU where there is no C++ compiler for Inductor; fail
    instead under BATON_REQUIRE_CXX (CI installs g++ and sets it, so there it cannot skip)."""
    import pytest

    from baton.parallel.compiled import CXX

    if not any(shutil.which(c) for c in CXX):
        if os.environ.get("BATON_REQUIRE_CXX"):
            pytest.fail("BATON_REQUIRE_CXX is set but there is no C++ compiler; apt-get install g++")
        pytest.skip("no C++ compiler for Inductor on CPU (apt-get install g++; CI installs it "
                    "and sets BATON_REQUIRE_CXX, so there it cannot skip)")


def tiny_spec(tmp: Path, data_dir: Path, **sections) -> dict:
    """A small job as a dict; `sections` override whole keys of each section."""
    spec = {
        "name": "tiny",
        "model": {"name": "gpt", "layers": 2, "width": 32, "heads": 2, "seq_len": 32},
        "data": {"source": "parquet", "path": str(data_dir)},
        "train": {"steps": 3, "global_batch": 8, "micro_batch": 2, "lr": 1e-2, "min_lr": 1e-3,
                  "warmup_steps": 1, "seed": 7},
        "parallel": {"dp": 2, "timeout_s": 60},
        "resources": {"cpus_per_worker": 0.5, **({"keep_warm_s": KEEP_WARM_S} if KEEP_WARM_S else {})},
        "checkpoint": {"path": str(tmp / "ckpt"), "every_steps": 1, "keep": 2},
        "tracking": {"uri": f"sqlite:///{tmp / 'mlflow.db'}", "experiment": "tests"},
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            spec[section] = {**spec.get(section, {}), **values}
        else:
            spec[section] = values
    return spec


def write_spec(path: Path, spec: dict) -> Path:
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def commit_state(spec, state: dict, step: int = 1) -> None:
    """A checkpoint of `spec`'s job at `step` holding the model state `state` (and an
    optimizer that never stepped), written as a job's worker writes a single stage's."""
    from baton.checkpoint import CheckpointStore

    store = CheckpointStore(spec.checkpoint_dir)
    store.begin(step)
    parts = [store.write_tensors(step, "model-0000.pt", state),
             store.write_tensors(step, "optim-0000.pt", {"state": {}, "param_groups": []})]
    store.commit(step, {"step": step, "layout": {"pp": 1}}, keep=1, parts=parts)


def reference_run(spec, data_dir, steps: int, each_step=None) -> tuple[dict[str, torch.Tensor], list, list]:
    """Plain PyTorch in this process: the whole global batch at once, no Ray, no accumulation.
    Returns the final parameters and each step's loss and gradient norm (before clipping).
    `each_step(step, model)`: called after each step (1-based), e.g. to keep its weights."""
    _, tokens = read_table(data_dir)
    mask = spec.data.loss_mask_column
    masks = read_corpus(str(data_dir), mask)[1] if mask else None
    order, cursor = job_order(spec, data_dir), Cursor()
    return train_on(spec, tokens, [order.next_batch(cursor, spec.train.global_batch)
                                   for _ in range(steps)], each_step, masks)


def train_on(spec, tokens: np.ndarray, batches: list, each_step=None,
             masks: np.ndarray | None = None) -> tuple[dict[str, torch.Tensor], list, list]:
    """reference_run's loop over given batches (positions into `tokens`); `masks`: the rows'
    loss masks (data.loss_mask_column), the loss the mean over the tokens they mark."""
    model = build_model(spec.model, spec.train.seed)
    optimizer = make_optimizer(model, spec.train)
    task = make_task(spec)  # (data.document_mask: the documents of each batch, by data.eod_token)
    losses, norms = [], []
    for step, positions in enumerate(batches):
        batch = torch.from_numpy(tokens[positions]).long()
        targets, count = batch[:, 1:], batch[:, 1:].numel()
        if masks is not None:
            kept = torch.from_numpy(masks[positions][:, 1:]).bool()
            targets, count = targets.masked_fill(~kept, IGNORE), max(int(kept.sum()), 1)
        for layer in routed(model):  # a load-balancing loss weighs as the task's does
            layer.balance(torch.ones(len(batch), dtype=torch.bool), targets.shape[1] / count)
        attend_within(attending(model), task.documents({"tokens": batch}))
        loss = loss_sum(model(batch[:, :-1]), targets) / count
        loss.backward()
        set_lr(optimizer, spec.train.lr_at(step))
        norms.append(clip_and_norm(model, spec.train.grad_clip))
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
        if each_step:
            each_step(step + 1, model)
    return model.state_dict(), losses, norms


def assert_params_close(got: dict, want: dict, rtol: float, atol: float) -> float:
    """Parameters trained two ways (another world size, layout or reduction order) against
    each other, at the caller's measured bound. The key third of each attention's `qkv.bias`
    is left out: softmax is invariant to it (it adds q.b to every key's score alike), so its
    gradient is rounding noise (7.9e-10, against 9.9e-3 for the query bias and 2.2 for the
    value bias, on the tiny GPT), which AdamW scales up to steps near lr; its value then
    follows the order of every sum, not the maths (seen 1.1e-5 apart after a dp change, on one
    CPU and not on another). `tests/unit/test_models.py` checks that it changes no output.
    Returns the largest difference (printed too: `pytest -s` shows it)."""
    assert got.keys() == want.keys()
    worst = 0.0
    for name, ref in want.items():
        mine = got[name]
        if name.endswith("qkv.bias"):
            w = ref.numel() // 3
            mine, ref = torch.cat([mine[:w], mine[2 * w:]]), torch.cat([ref[:w], ref[2 * w:]])
        torch.testing.assert_close(mine, ref, rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"{name}: {m}")
        worst = max(worst, float((mine - ref).abs().max()))
    print(f"largest parameter difference: {worst:.3g}")  # what the bounds' comments quote
    return worst


def assert_like_one_process(spec, data_dir, result, steps: int, rtol: float = 1e-5,
                            atol: float = 4e-5) -> tuple[dict, dict]:
    """The run's parameters after `steps`, and each step's loss and gradient norm as logged to
    MLflow, against one plain process (`reference_run`). AdamW and clipping hide a wrong
    gradient scale from the parameters; the norms do not. The default bound is torch's own
    pipelining tests' (rtol 1e-5, atol 4e-5); callers say beside the call what they measured.
    Returns (the run's parameters, the reference's)."""
    from mlflow.tracking import MlflowClient

    from baton.checkpoint import CheckpointStore

    got = CheckpointStore(spec.checkpoint_dir).read_model(steps)
    want, losses, norms = reference_run(spec, data_dir, steps=steps)
    if set(want) - set(got):  # a job started from an export leaves out its frozen parameters
        from baton.models.frozen import from_start

        frozen = set(from_start(spec.model))  # (every name of a tied one)
        assert spec.model.init_from and set(want) - set(got) == frozen, set(want) - set(got)
        want = {n: t for n, t in want.items() if n in got}
    assert_params_close(got, want, rtol, atol)
    client = MlflowClient(spec.tracking.uri)
    for key, ref in (("loss", losses), ("grad_norm", norms)):
        history = sorted((m.step, m.value) for m in client.get_metric_history(result.run_id, key))
        assert [s for s, _ in history] == list(range(1, steps + 1)), key
        np.testing.assert_allclose([v for _, v in history], ref, rtol=1e-5, err_msg=key)
    return got, want


# A user model (the `module:function` path): the GPT, slowed down so that a kill lands
# between a checkpoint and the end of the run, whatever the machine's speed.
SLOW_MODEL = '''
import os
import time
import torch
from baton.models.gpt import build_gpt

class Slow(torch.nn.Module):
    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        time.sleep(self.seconds)
        return x

def build(spec):
    model = build_gpt(layers=spec.layers, width=spec.width, heads=spec.heads,
                      seq_len=spec.seq_len, vocab_size=spec.vocab_size, dropout=spec.dropout)
    return torch.nn.Sequential(Slow(float(os.environ.get("SLOWGPT_S", "0.4"))), *model)
'''
# A run that is not to be killed sets SLOWGPT_S=0 (the same maths, without the sleep): Ray's
# worker processes inherit the environment of the `baton run` that starts the embedded Ray.
FAST = {"SLOWGPT_S": "0"}


def start_baton(args: list[str], cwd: Path, env: dict | None = None,
                argv: list[str] | None = None) -> subprocess.Popen:
    """The installed `baton` command (or `argv`), as a user runs it from a terminal, in its own
    process group (so that a test can kill it and the embedded Ray it started together). SIGINT
    is set back to its default: a suite started as a background job (`cmd &`) inherits SIGINT
    ignored, Python then installs no KeyboardInterrupt handler, and a Ctrl-C test would wait
    forever on a run that never sees it."""
    exe = shutil.which("baton")
    assert exe, "the baton console script is installed"
    proc = subprocess.Popen(argv or [exe, *args], cwd=cwd, env=env or os.environ, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    STARTED.append(proc)
    return proc


STARTED: list[subprocess.Popen] = []  # killed after each test (conftest), if still running


def kill_leftovers() -> None:
    """A test that failed half-way must not leave a run (and its Ray) eating the CPU of every
    test after it."""
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)


def read_table(data_dir) -> tuple[np.ndarray, np.ndarray]:
    """(ids, tokens) of every row in manifest order: row i is the sample at position i."""
    return read_corpus(str(data_dir))


def job_order(spec, data_dir) -> EpochOrder:
    """The epoch order a job on this data trains in."""
    return _job_order(spec, str(data_dir))


def batch_in_store(ids: np.ndarray, tokens: np.ndarray, positions: np.ndarray) -> Batch:
    """A Batch of these positions over the whole table, put in the object store as one unit
    (for tests that drive workers directly)."""
    import ray

    tokens_col = pa.FixedSizeListArray.from_arrays(pa.array(tokens.reshape(-1)), tokens.shape[1])
    ref = ray.put(pa.table({TOKENS: tokens_col, IDS: pa.array(ids)}))
    return Batch(positions, {0: (0, [ref])})


def reference_grads(spec, tokens: np.ndarray, batch: np.ndarray) -> tuple[dict, float]:
    """One process, the whole batch: each parameter's gradient of the mean loss, and the loss."""
    model = build_model(spec.model, spec.train.seed)
    data = torch.from_numpy(tokens[batch]).long()
    loss = loss_sum(model(data[:, :-1]), data[:, 1:]) / data[:, 1:].numel()
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}, loss.item()


class _FailOn(torch.nn.Module):
    """Raises on one input: the batch whose token ids sum to `total`."""

    def __init__(self, total: int):
        super().__init__()
        self.total = total

    def forward(self, x):
        if int(x.sum()) == self.total:
            raise ValueError(f"bad batch (token sum {self.total})")
        return x


def failing_gpt(spec):
    """A user model (`helpers:failing_gpt`) that fails on one batch, every time it sees it."""
    from baton.models.gpt import build_gpt

    gpt = build_gpt(layers=spec.layers, width=spec.width, heads=spec.heads, seq_len=spec.seq_len,
                    vocab_size=spec.vocab_size)
    return torch.nn.Sequential(_FailOn(spec.options["fail_on_sum"]), *gpt)


class _StallOnce(torch.nn.Module):
    """On one rank, sleeps `seconds` in its first forward (once per marker file): a straggler
    that is alive and answering, while its peers wait in a collective."""

    def __init__(self, seconds: float, marker: str, rank: int):
        super().__init__()
        self.seconds, self.marker, self.rank = seconds, marker, rank

    def forward(self, x):
        import time

        import torch.distributed as dist

        if dist.get_rank() == self.rank and not os.path.exists(self.marker):
            Path(self.marker).touch()
            time.sleep(self.seconds)
        return x


def stalling_gpt(spec):
    """A user model (`helpers:stalling_gpt`) with a straggler: see _StallOnce."""
    from baton.models.gpt import build_gpt

    o = spec.options
    gpt = build_gpt(layers=spec.layers, width=spec.width, heads=spec.heads, seq_len=spec.seq_len,
                    vocab_size=spec.vocab_size)
    return torch.nn.Sequential(_StallOnce(o["seconds"], o["marker"], o["rank"]), *gpt)


class _Allocate(torch.nn.Module):
    """Asks the host's allocator for 1 PiB, more than any address space, in every training
    forward."""

    def forward(self, x):
        if self.training and torch.is_grad_enabled():
            torch.empty(1 << 50, dtype=torch.uint8)
        return x


def allocating_gpt(spec):
    """A user model (`helpers:allocating_gpt`) whose every training step runs out of memory."""
    from baton.models.gpt import build_gpt

    gpt = build_gpt(layers=spec.layers, width=spec.width, heads=spec.heads, seq_len=spec.seq_len,
                    vocab_size=spec.vocab_size)
    return torch.nn.Sequential(_Allocate(), *gpt)


class _Sleep(torch.nn.Module):
    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        time.sleep(self.seconds)
        return x


def slow_llama(spec):
    """A user model (`helpers:slow_llama`): the built-in llama (its options, mixtures of
    experts included), each forward `options.seconds` longer, as `slow_gpt`."""
    from baton.models.llama import llama_layers

    options = dict(spec.options)
    recipe = llama_layers(layers=spec.layers, width=spec.width, heads=spec.heads, seq_len=spec.seq_len,
                          vocab_size=spec.vocab_size, **{k: v for k, v in options.items() if k != "seconds"})
    return Layers([lambda: _Sleep(options["seconds"]), *recipe.makers], recipe.init)


def killed_run(spec, after: int, rank: int):
    """`spec` run to its end, with rank `rank`'s worker SIGKILLed once step `after` has
    completed (the first time only: not again after the recovery); the samples recorded."""
    from baton import api

    return api.run(spec, show_progress=False, record_samples=True,
                   on_step=lambda c: c.step == after and not c.events and os.kill(
                       c.workers[rank]["pid"], signal.SIGKILL))


def each_sample_once(result, steps: int, batch: int = 8) -> None:
    """The ledger holds steps 0..steps-1 and every sample of them once."""
    ids = sorted(i for _, _, part in result.ledger for i in part)
    assert sorted({step for step, _, _ in result.ledger}) == list(range(steps))
    assert len(ids) == len(set(ids)) == steps * batch


def slow_gpt(spec):
    """A user model (`helpers:slow_gpt`): the GPT, each forward `options.seconds` longer, so a
    fault injected after a step lands in the next step's forward, before its collectives."""
    from baton.models.gpt import build_gpt

    gpt = build_gpt(layers=spec.layers, width=spec.width, heads=spec.heads, seq_len=spec.seq_len,
                    vocab_size=spec.vocab_size)
    return torch.nn.Sequential(_Sleep(spec.options["seconds"]), *gpt)


class _SlowOn(torch.nn.Module):
    """On one rank, sleeps `seconds` in each training forward: a worker slower than its peers
    at every step (a throttled GPU, a busy host), alive and keeping up with every collective."""

    def __init__(self, seconds: float, rank: int):
        super().__init__()
        self.seconds, self.rank = seconds, rank

    def forward(self, x):
        import torch.distributed as dist

        if self.training and dist.is_initialized() and dist.get_rank() == self.rank:
            time.sleep(self.seconds)
        return x


def uneven_gpt(spec):
    """A user model (`helpers:uneven_gpt`): the GPT, each forward on rank `options.rank`
    `options.seconds` longer."""
    from baton.models.gpt import build_gpt

    gpt = build_gpt(layers=spec.layers, width=spec.width, heads=spec.heads, seq_len=spec.seq_len,
                    vocab_size=spec.vocab_size)
    return torch.nn.Sequential(_SlowOn(spec.options["seconds"], spec.options["rank"]), *gpt)


def not_on_meta(spec):
    """A user model (`helpers:not_on_meta`) whose builder needs real tensors: it raises on
    PyTorch's meta device, where the driver builds models for their shapes."""
    from baton.models.gpt import build_gpt

    if torch.empty(0).is_meta:
        raise RuntimeError("this builder reads real tensors")
    return build_gpt(layers=spec.layers, width=spec.width, heads=spec.heads, seq_len=spec.seq_len,
                     vocab_size=spec.vocab_size)


def gpt_recipe(spec):
    """A user model (`helpers:gpt_recipe`) whose builder returns a recipe of layers
    (`baton.models.layers.Layers`), which sharded workers build layer by layer."""
    from baton.models.gpt import gpt_layers

    return gpt_layers(layers=spec.layers, width=spec.width, heads=spec.heads, seq_len=spec.seq_len,
                      vocab_size=spec.vocab_size)


def await_growth(coordinator, timeout_s: float = 90) -> None:
    """From an on_step hook: wait until the workers a growth has started are ready, so that
    the world grows at the next step boundary. A growth starts its workers while training
    goes on (`Placement.growth_due`), and the short runs of the tests would otherwise end
    before a new process is up. Returns at once when no growth is under way."""
    joining = coordinator.placement.joining
    deadline = time.monotonic() + timeout_s
    while joining and not coordinator.group.spares_ready(joining):
        assert time.monotonic() < deadline, "the growth's workers did not start"
        time.sleep(0.1)


def hold_until_moving(coordinator, timeout_s: float = 60) -> None:
    """From an on_step hook, after a node holding workers was told to drain: hold the step
    until the coordinator has seen the drain (it asks every second) and the replacements it
    started have started, so that the move comes before a short test's last step (training
    goes on meanwhile in a real run, whose steps take longer)."""
    from baton.coordinator.placement import DRAIN_CHECK_S

    if not coordinator.placement.drains:
        time.sleep(DRAIN_CHECK_S)
    deadline = time.monotonic() + timeout_s
    while (coordinator.placement.drains
           and not coordinator.group.spares_ready(coordinator.placement.replacing)):
        assert time.monotonic() < deadline, "the replacement never started"
        time.sleep(0.1)


# --- Ray clusters started with `ray start` in their own session (tests stop only those) ---

def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def session_pids(sid: int) -> list[int]:
    """Processes in session `sid`: everything `ray start` spawned (it never leaves the session)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()  # after the name: state, ppid, pgrp, session
            if int(fields[3]) == sid and fields[0] != "Z":  # a zombie is gone but for its entry
                pids.append(int(entry))
    return pids


def stop_session(proc: subprocess.Popen, grace_s: float = 5) -> None:
    """SIGTERM to every process of the head's session (the way `ray stop` ends a node, but
    only ours), SIGKILL to what is left after `grace_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in session_pids(proc.pid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + grace_s
        while session_pids(proc.pid) and time.time() < deadline:
            proc.poll()  # reap the head's own process
            time.sleep(0.2)
    proc.poll()



class SlowProxy:
    """A TCP proxy on 127.0.0.1 in front of an HTTP store that holds each write request (PUT,
    POST) `delay_s` before passing it on: a store slow to write to."""

    def __init__(self, upstream_port: int, delay_s: float):
        import threading

        self.upstream, self.delay_s = upstream_port, delay_s
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.delayed_s = 0.0
        self._threads = threading
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream))
            self._threads.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            self._threads.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, slow: bool) -> None:
        try:
            while chunk := src.recv(1 << 16):
                if slow and chunk.startswith((b"PUT ", b"POST ")):
                    time.sleep(self.delay_s)
                    self.delayed_s += self.delay_s
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.server.close()


class TrackingServer:
    """A real MLflow tracking server (`mlflow server` on 127.0.0.1, its own process group) on a
    sqlite database, to kill mid-run and start again on the same database. Its artifacts go
    beside the database (the server's default, `./mlartifacts`, is the test's working
    directory: the checkout)."""

    def __init__(self, db: str, port: int, log):
        self.db, self.port, self.log, self.proc = db, port, log, None

    def start(self) -> None:
        mlflow = os.path.join(os.path.dirname(sys.executable), "mlflow")
        self.proc = subprocess.Popen(
            [mlflow, "server", "--backend-store-uri", f"sqlite:///{self.db}", "--host", "127.0.0.1",
             "--port", str(self.port), "--workers", "1", "--artifacts-destination",
             os.path.join(os.path.dirname(os.path.abspath(self.db)), "mlartifacts")],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        # (a bound, not a wait: it returns once the server answers. 60 s was too short once,
        # a restart in the chaos soak while another suite shared the machine's 2 cores)
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1):
                    return
            except OSError:
                if self.proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.2)
                    continue
                if self.proc.poll() is None:  # (not left running past the test: it was once)
                    self.kill()
                raise AssertionError("no MLflow server")

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


class Chaos:
    """Faults of mixed kinds at seeded random steps of a run on a simulated cluster
    (`ray.cluster_utils.Cluster`), injected from the run's `on_step` hook, as the fault tests
    do one at a time: a worker SIGKILLed (`kill`), a worker's node removed and a fresh node
    added (`node`), a worker frozen with SIGSTOP (`stop`, declared dead after
    elastic.hang_timeout_s), a worker killed half-way through writing a checkpoint (`saving`:
    needs `fault_hooks.pause_between_checkpoint_parts` in the workers), and, given the run's MLflow server,
    the server killed and started again on its database `OUTAGE_STEPS` later, in the background
    as a real store comes back (`tracking`). The new node is added once the recovery from the
    loss has completed a step: a real one joins on its own, and `Cluster.add_node` must run on
    the main thread, which is the coordinator's (added at once, its seconds of start-up were
    counted as the time the coordinator took to notice the loss). A worker's node drained
    (`drain`: the GCS asked to drain it for a preemption, 60 s ahead, as `ray start` asks on
    SIGTERM) is held at each step until the run has started its replacement, and the next
    fault is scheduled 2 steps later than it would be, after the move; once moved, the node
    goes (a pod deleted) and a fresh one joins. `injected` records what was done, at which step and wall time. `finish()` after
    the run."""

    KINDS = ("kill", "node", "stop", "saving", "drain")
    OUTAGE_STEPS = 3

    def __init__(self, cluster, *, faults: int, steps: int, every_steps: int, seed: int,
                 checkpoint_dir: str, tracking: TrackingServer | None = None):
        rng = np.random.default_rng(seed)
        self.kinds = self.KINDS + (("tracking",) if tracking else ())
        kinds = [self.kinds[i % len(self.kinds)] for i in range(faults)]
        rng.shuffle(kinds)
        self.schedule: dict[int, str] = {}
        step, moving = 2, 0
        for kind in kinds:  # at least 3 steps apart; `saving` just before a checkpoint
            step += int(rng.integers(3, 5)) + moving
            if kind == "saving":
                step += (every_steps - 1 - step) % every_steps
            self.schedule[step] = kind
            # a drain's move comes 1-3 steps later (the run asks Ray every second, then starts
            # a replacement): the next fault 2 steps further, so that it does not land in it
            moving = 2 if kind == "drain" else 0
        back = [s + self.OUTAGE_STEPS for s, kind in self.schedule.items() if kind == "tracking"]
        assert max([*self.schedule, *back]) < steps - 1, f"{faults} faults do not fit {steps} steps"
        self.cluster, self.checkpoint_dir, self.rng = cluster, checkpoint_dir, rng
        self.tracking, self._back_at, self._restart = tracking, None, None
        self._add_after = None  # a node is added once the run has recovered this many times
        self._drained = None  # (node id, events before its drain) until the run moves off it
        self.injected: list[dict] = []

    def __call__(self, c) -> None:
        if self._back_at is not None and c.step >= self._back_at:
            self._back_at = None
            self._restart = concurrent.futures.ThreadPoolExecutor(1).submit(self.tracking.start)
        if self._add_after is not None and \
                sum(e["kind"] == "recovery" for e in c.events) > self._add_after:
            self._add_after = None
            self.cluster.add_node(num_cpus=1)
        if self._drained is not None:
            node, before = self._drained
            if any(e["kind"] == "move" for e in c.events[before:]):
                self._retire(node)
            else:
                hold_until_moving(c)
        kind = self.schedule.pop(c.step, None)
        if kind is None:
            return
        rank = 0 if kind == "saving" else int(self.rng.integers(len(c.workers)))
        pid = c.workers[rank]["pid"]
        self.injected.append({"step": c.step, "kind": kind, "rank": rank, "at": time.time()})
        if kind == "kill":
            os.kill(pid, signal.SIGKILL)
        elif kind == "stop":
            os.kill(pid, signal.SIGSTOP)
        elif kind == "node":
            if self._add_after is not None:  # the last loss's replacement first
                self.cluster.add_node(num_cpus=1)
            (node,) = [n for n in self.cluster.list_all_nodes() if n.node_id == c.workers[rank]["node"]]
            self.cluster.remove_node(node)
            self._add_after = sum(e["kind"] == "recovery" for e in c.events)
        elif kind == "drain":
            import ray
            from ray.core.generated import autoscaler_pb2

            node = c.workers[rank]["node"]
            accepted, why = ray._raylet.GcsClient(address=self.cluster.address).drain_node(
                node, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                "chaos", int(time.time() * 1000) + 60_000)
            assert accepted, why
            self._drained = (node, len(c.events))
        elif kind == "tracking":
            self.injected[-1]["rank"] = None
            if self._restart is not None:  # the last outage's server first finishes starting
                self._restart.result()
            self.tracking.kill()
            self._back_at = c.step + self.OUTAGE_STEPS
        else:  # the next step's checkpoint: once its first part is written, kill its writer
            part = f"{self.checkpoint_dir}/step_{c.step + 1:08d}/model-0000.pt"
            deadline = time.monotonic() + 60
            while not os.path.exists(part):
                assert time.monotonic() < deadline, f"no {part}"
                time.sleep(0.005)
            os.kill(pid, signal.SIGKILL)

    def _retire(self, node_id: str) -> None:
        """The drained node goes, as its pod would, and a fresh one joins."""
        self._drained = None
        for node in [n for n in self.cluster.list_all_nodes() if n.node_id == node_id]:
            self.cluster.remove_node(node)
        self.cluster.add_node(num_cpus=1)

    def finish(self) -> None:
        """After the run: the tracking server's restart finished (its error, if it failed), and
        the last lost or drained node replaced."""
        assert self._back_at is None, "the run ended before the tracking server was restarted"
        if self._restart is not None:
            self._restart.result()
        if self._add_after is not None:
            self._add_after = None
            self.cluster.add_node(num_cpus=1)
        if self._drained is not None:
            self._retire(self._drained[0])


# -- tasks (tests/integration/test_tasks.py) ----------------------------------------------------


def write_table(folder: Path, num_samples: int = 96, features: int = 6, classes: int = 4,
                row_group_rows: int = 8, seed: int = 0) -> Path:
    """A classification and regression table: `vec` (features - 2 floats, a fixed-size list),
    `a` and `b` (a float and an int feature), `label` (a class, learnable from the features),
    `y` (a float target), `sample_id` from 5000; row groups of `row_group_rows`."""
    rng = np.random.default_rng(seed)
    vec = rng.normal(size=(num_samples, features - 2)).astype(np.float32)
    a = rng.normal(size=num_samples).astype(np.float32)
    b = rng.integers(0, 5, size=num_samples)
    label = (np.argmax(vec[:, :classes], axis=1) + (b > 3)) % classes
    y = vec.sum(1) + 0.5 * a - 0.1 * b
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({
        "sample_id": np.arange(5000, 5000 + num_samples),
        "vec": pa.FixedSizeListArray.from_arrays(pa.array(vec.reshape(-1)), features - 2),
        "a": a, "b": b, "label": label, "y": y.astype(np.float32),
        "name": [f"row-{i}" for i in range(num_samples)]}),
        folder / "table.parquet", row_group_size=row_group_rows)
    return folder


def read_columns(folder: Path, columns: dict) -> tuple[np.ndarray, dict]:
    """(ids, {key: rows}) of the whole table in manifest order, each key's columns
    concatenated as a job's `data.columns` maps them (a reference reads what baton reads)."""
    table = pq.read_table(folder)
    out = {}
    for key, names in columns.items():
        parts = []
        for name in names if isinstance(names, list) else [names]:
            col = table.column(name).combine_chunks()
            parts.append(col.flatten().to_numpy().reshape(len(col), -1)
                         if pa.types.is_fixed_size_list(col.type) else col.to_numpy()[:, None])
        joined = np.concatenate(parts, axis=1)
        out[key] = joined[:, 0] if not isinstance(names, list) and joined.shape[1] == 1 else joined
    return table.column("sample_id").to_numpy(), out


def log_regression(output, batch):
    """A user task with a bug a bad row finds (`helpers:log_regression`): the squared error of
    a scalar output against log(target), NaN for a target below 0 (and its gradient too)."""
    valid = batch["valid"].float()
    err = output.squeeze(-1).float() - torch.log(batch["target"])
    return {"loss": (err ** 2 * valid).sum()}


def regression(output, batch):
    """A user task (`helpers:regression`): squared error of a scalar output against `target`,
    summed over the valid rows; the absolute error as a metric (a mean over rows), and the
    weighted absolute percentage error, a ratio of two sums (all errors over all targets)."""
    valid = batch["valid"].float()
    err = output.squeeze(-1).float() - batch["target"]
    return {"loss": (err ** 2 * valid).sum(), "abs_error": (err.abs() * valid).sum(),
            "wape": ((err.abs() * valid).sum(), (batch["target"].abs() * valid).sum())}


def no_loss_task(output, batch):
    """A user task that forgot its loss (`helpers:no_loss_task`)."""
    return {"mse": (output ** 2).sum()}


def three_part_ratio_task(output, batch):
    """A user task whose ratio metric has three parts, not two (`helpers:three_part_ratio_task`)."""
    s = (output ** 2).sum()
    return {"loss": s, "f1": (s, s, s)}


def binary(output, batch):
    """A user task (`helpers:binary`): is a row of class 0 (of `label`'s 4)? Two logits a row,
    cross-entropy, accuracy, the area under the ROC curve and average precision of the
    positive class's probability (metrics of the whole set's scores) and the balanced accuracy
    (a macro average over the two classes)."""
    import torch.nn.functional as F

    from baton.tasks import auroc, average_precision

    valid, target = batch["valid"], (batch["label"] == 0).long()
    # the valid rows by a mask, as docs/tasks.md's examples: a count of rows that depends on
    # the data, which `baton validate`'s check on the meta device must let through
    loss = F.cross_entropy(output, target, reduction="none")[valid].sum()
    score = output.float().softmax(-1)[:, 1]
    correct = output.argmax(-1) == target
    rows = F.one_hot(target, 2).bool() & valid[:, None]  # each row's class, valid rows only
    return {"loss": loss, "accuracy": (correct & valid).sum().float(),
            "auroc": auroc(score, target.bool(), valid),
            "average_precision": average_precision(score, target.bool(), valid),
            # the mean of each class's recall: a macro average, each class's pair of sums
            "balanced_accuracy": ((rows & correct[:, None]).sum(0).float(), rows.sum(0).float())}


def regressor(spec):
    """A user model (`helpers:regressor`): features to one number."""
    return torch.nn.Sequential(torch.nn.Linear(spec.options["inputs"], spec.width),
                               torch.nn.Tanh(), torch.nn.Linear(spec.width, 1))
