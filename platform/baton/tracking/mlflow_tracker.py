"""MLflow: one run per job, written only by the coordinator.

Metrics are buffered and sent in batches (one batch call instead of one call per value:
MLflow's own advice, and 35x faster on sqlite). The buffer is flushed before every checkpoint
commit, at the end, and at most every `tracking.flush_every_s` seconds (that one on a thread of
its own, while the coordinator hands out the next steps). A resumed run replays
the steps after its checkpoint; those already logged are skipped, so every step is logged once.

Tracking never stops training. Once the run is open, a store that fails (a server gone, a
locked database) puts the tracker in a degraded state: one warning, `tracking: degraded` in
`baton status`, and every later write kept in memory (metrics in order, the newest value of
each tag and artifact) and tried again with a backoff of 1 s doubling to 60 s. When the store
answers again, what was kept is delivered, each step's metrics once, and a line says so. A
checkpoint commit no longer waits on the store. MLflow's HTTP client would retry each call
for minutes first: baton sets it to one try of at most 10 s, unless the environment says
otherwise. The run's end waits up to 60 s for a store still away, then says how much could
not be delivered (and leaves the run RUNNING: `baton run` again marks it when it resumes).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

from baton import interrupts, storage
from baton.errors import TrackingError
from baton.spec import TrackingSpec
from baton.storage import redact
from baton.tracking import store_template

MAX_BATCH = 1000  # MLflow's limit of metrics per log_batch call
STEP_METRIC = "loss"  # logged at every step: its last step says how far a run's record goes
RETRY_FIRST_S, RETRY_MAX_S = 1.0, 60.0  # backoff while the store is away
FINISH_WAIT_S = 60.0  # how long the run's end waits for a store that is away
# MLflow's HTTP client: one try, at most 10 s (its defaults retry 7 times over minutes)
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
                 # the run report reads events.json back: no tqdm bar in baton's console
                 "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}


def default_uri() -> str:
    """$MLFLOW_TRACKING_URI, else a sqlite store in the working directory, or in $BATON_STORAGE
    when set (MLflow 3's default backend; an absolute sqlite path takes four slashes)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{storage.local_path('mlflow.db')}"


def _sqlite_file(uri: str) -> Optional[Path]:
    """A sqlite store's database file (an absolute path takes four slashes); None for others."""
    return Path(uri[len("sqlite:///"):].split("?")[0]) if uri.startswith("sqlite:///") else None


def _artifact_root(uri: str, experiment: str) -> Optional[str]:
    """Beside a sqlite store, artifacts go to mlartifacts/ next to the database file (not to
    whatever the working directory is); other stores keep their server's default."""
    db = _sqlite_file(uri)
    return (db.resolve().parent / "mlartifacts" / experiment).as_uri() if db else None


def _shielded(method):
    """A write to the store that Ctrl-C or SIGTERM does not cut in half (interrupts.py)."""
    @functools.wraps(method)
    def write(*args, **kwargs):
        with interrupts.shielded():
            return method(*args, **kwargs)
    return write


class MLflowTracker:
    """Nothing touches the store before `open_ahead` or `start` (opening a new sqlite store
    creates its tables; no run exists before `start`); after a failure earlier than that,
    every other method is a no-op, so the error that stopped the run is the one the user
    sees. Every write is shielded from interrupts."""

    def __init__(self, spec: TrackingSpec):
        self.uri = spec.uri or default_uri()
        self.client = None
        self.experiment = spec.experiment
        self.flush_every_s = spec.flush_every_s
        self.run_id: Optional[str] = None
        self._buffer: list = []
        self._last_flush = time.monotonic()
        self._logged_through = 0  # steps up to this one are already in the run
        self._tags: dict[str, str] = {}  # not yet delivered (the newest value of each)
        self._dicts: dict[str, Any] = {}  # artifact file -> the newest content not delivered
        self.degraded_since: Optional[float] = None  # wall time the store stopped answering
        self._retry_at, self._backoff = 0.0, RETRY_FIRST_S
        self._opening: Optional[concurrent.futures.Future] = None  # open_ahead's thread
        self._fresh: Optional[Path] = None  # the new sqlite store it prepares, a hidden name
        self._finishing: Optional[threading.Thread] = None  # finish(background=True)'s thread
        # one writer to the store at a time: the coordinator's thread, or the sender's
        self._sending = threading.RLock()
        self._sender: Optional[threading.Thread] = None  # periodic deliveries (`_deliver_soon`)
        self._due = threading.Event()
        self._closed = False  # finished: the sender's loop ends
        for key, value in HTTP_DEFAULTS.items():
            os.environ.setdefault(key, value)

    def open_ahead(self) -> None:
        """Prepare on a thread what opening the store costs, while `ray.init` (which mostly
        waits for its processes) runs: importing MLflow, and for a new sqlite store, creating
        its tables (from a cached copy: store_template.py). The new store is made under a
        hidden name beside the real one and takes the real name only in `start`, so a run
        refused before then (bad data, a layout the cluster cannot place) leaves no store
        behind (`drop_ahead`). A store that exists, or is not a sqlite file, is not touched
        before `start`. Not a daemon: an interrupted run lets the tables be made whole."""
        db = _sqlite_file(self.uri)
        if db is not None and not db.parent.is_dir():  # sqlite makes no folders: refused before Ray
            raise TrackingError(f"the MLflow store {redact(self.uri)} cannot be opened: its folder "
                                f"{db.parent} does not exist; make it, or set tracking.uri")
        new = db is not None and not db.exists()
        # (named by the tracker too: a sweep's concurrent trials open one store from one process)
        fresh = self._fresh = db.with_name(f".{db.name}.{os.getpid()}.{id(self):x}.new") if new else None
        done = self._opening = concurrent.futures.Future()

        def prepare() -> None:
            try:
                from mlflow.tracking import MlflowClient  # noqa: F401 - the import is the cost

                if fresh:
                    store_template.open_new(fresh, store_template.cached())
                done.set_result(None)
            except BaseException as e:  # reported by `start`, on the run's thread
                done.set_exception(e)

        threading.Thread(target=prepare, name="baton-mlflow-open").start()

    def wait_finished(self) -> None:
        """Wait for `finish(background=True)`, if it was called."""
        if self._finishing is not None:
            self._finishing.join()
            self._finishing = None

    def drop_ahead(self) -> None:
        """After `open_ahead`: wait for it, and remove a prepared store `start` did not take."""
        if self._opening is not None:
            concurrent.futures.wait([self._opening])
            self._opening = None
        if self._fresh is not None:
            self._fresh.unlink(missing_ok=True)
            self._fresh = None

    def _take_ahead(self) -> None:
        """In `start`: the prepared store takes the real name, unless one appeared there
        meanwhile (a hard link never replaces a file); its error is raised here."""
        opening, fresh = self._opening, self._fresh
        try:
            if opening is not None:
                opening.result()
            if fresh is not None:
                with contextlib.suppress(OSError):  # exists now, or no hard links: made normally
                    os.link(fresh, _sqlite_file(self.uri))
        finally:
            self.drop_ahead()

    @property
    def state(self) -> str:
        """For `baton status`: ok, or degraded (since when, how much is waiting)."""
        if self.degraded_since is None:
            return "ok"
        return (f"degraded since {time.strftime('%H:%M:%S', time.localtime(self.degraded_since))}"
                f", {len(self._buffer)} metric values waiting")

    @_shielded
    def start(self, run_name: str, params: dict[str, Any], run_id: Optional[str] = None) -> str:
        """Open a new run, or continue `run_id` (a resumed job keeps its run). A store that
        cannot be opened stops the run here, in one line: nothing has trained yet."""
        try:
            return self._start(run_name, params, run_id)
        except Exception as e:
            self.client = self.run_id = None  # the rest are no-ops: this is the error the user sees
            raise self._cannot_open(e) from e

    def _cannot_open(self, e: Exception) -> TrackingError:
        first = (str(e).strip().splitlines() or [""])[0]
        return TrackingError(f"the MLflow store {redact(self.uri)} cannot be opened: "
                             f"{type(e).__name__}: {redact(first)[:400]}")

    def find(self, key: str, value: str) -> Optional[str]:
        """The newest run of the experiment tagged `key`=`value` (a sweep's own run, looked
        for when the sweep runs again), or None; a store that cannot be opened as `start`."""
        try:
            self._open()
            runs = self.client.search_runs([self._experiment_id()], max_results=1,
                                           filter_string=f"tags.`{key}` = '{value}'")
            return runs[0].info.run_id if runs else None
        except Exception as e:
            raise self._cannot_open(e) from e

    def _open(self) -> None:
        from mlflow.tracking import MlflowClient

        if self.client is None:
            self._take_ahead()
            self.client = MlflowClient(tracking_uri=self.uri)

    def _start(self, run_name: str, params: dict[str, Any], run_id: Optional[str]) -> str:
        self._open()
        if run_id:
            run = self.client.get_run(run_id)
            self.client.update_run(run_id, status="RUNNING")
            known = run.data.params
            logged = self.client.get_metric_history(run_id, STEP_METRIC)
            self._logged_through = max((m.step for m in logged), default=0)
        else:
            run_id = self.client.create_run(self._experiment_id(), run_name=run_name).info.run_id
            known = {}
        self.run_id = run_id
        self._log_params(params, known)
        return run_id

    def _experiment_id(self) -> str:
        """The experiment's id, made if it is new. Two runs that start together (a sweep's
        concurrent trials, two jobs on one server) may both find none: the second to create
        it is refused (its name is taken), and takes the first's."""
        exp = self.client.get_experiment_by_name(self.experiment)
        if exp is not None:
            return exp.experiment_id
        try:
            return self.client.create_experiment(
                self.experiment, artifact_location=_artifact_root(self.uri, self.experiment))
        except Exception:
            exp = self.client.get_experiment_by_name(self.experiment)
            if exp is None:
                raise
            return exp.experiment_id

    def _log_params(self, params: dict[str, Any], known: dict[str, str]) -> None:
        from mlflow.entities import Param, RunTag

        new, changed = [], []
        for k, v in params.items():
            text = redact(str(v))[:6000]  # a URI's credentials are never recorded
            if k not in known:
                new.append(Param(k, text))
            elif known[k] != text:  # params are immutable in MLflow: record the change as a tag
                changed.append(RunTag(f"resumed_with.{k}", text))
        for i in range(0, len(new), 100):
            self.client.log_batch(self.run_id, params=new[i:i + 100])
        if changed:
            self.client.log_batch(self.run_id, tags=changed)

    def log_metrics(self, step: int, metrics: dict[str, float], *, replayed_ok: bool = False) -> None:
        """Per-step metrics, once per step: a step replayed after a resume or a recovery keeps
        the values of its first run. `replayed_ok` logs anyway (events at a replayed step)."""
        from mlflow.entities import Metric

        if step <= self._logged_through and not replayed_ok:
            return
        self._logged_through = max(self._logged_through, step)
        now = int(time.time() * 1000)
        self._buffer += [Metric(k, float(v), now, step) for k, v in metrics.items()]
        if time.monotonic() - self._last_flush >= self.flush_every_s:
            self._deliver_soon()

    def _deliver_soon(self) -> None:
        """The periodic delivery, on a thread of the tracker's own: the coordinator goes on
        handing out steps meanwhile. Delivered from the coordinator's thread, it held the
        next step back: 55-94 ms for 10 s of the quick-start's steps on a sqlite store here,
        about 0.1 ms a step's metrics, so 0.4-0.6 s every 30 s (`flush_every_s`) of a GPU's
        70-ms steps, while the workers have two steps queued. A commit's flush and the run's
        end still deliver on the caller's thread (metrics before the marker), after it."""
        if self._sender is None:
            self._sender = threading.Thread(target=self._send_when_due, name="baton-mlflow-send",
                                            daemon=True)
            self._sender.start()
        self._due.set()

    def _send_when_due(self) -> None:
        while True:
            self._due.wait()
            self._due.clear()
            if self._closed:
                return
            self._deliver()

    def flush(self) -> None:
        """Deliver what is waiting (or, while the store is away, try again when due)."""
        self._deliver()

    def set_tags(self, tags: dict[str, Any]) -> None:
        with self._sending:
            self._tags.update({k: redact(str(v)) for k, v in tags.items()})
        self._deliver()

    def log_dict(self, obj: Any, artifact_file: str) -> None:
        with self._sending:
            self._dicts[artifact_file] = redact(obj)
        self._deliver()

    @_shielded
    def log_artifacts(self, local_dir: str, artifact_path: str) -> None:
        """Files of the moment (a pipeline timeline): sent now, or not at all."""
        if self.run_id and self._deliver():
            self._try(lambda: self.client.log_artifacts(self.run_id, local_dir, artifact_path))

    def finish(self, status: str, background: bool = False) -> None:
        """status: FINISHED, FAILED or KILLED. The run's pictures (`baton report`) go in first
        as report/ artifacts; a report that cannot be drawn is a warning, never the error.

        `background`: on a thread of its own, which `wait_finished` waits for: a finished
        run's report is drawn while its workers and Ray shut down (measured at the end of a
        `baton run`: the report 1.7 s, Ray's shutdown 1.5 s, one after the other before)."""
        if background:
            self._finishing = threading.Thread(target=self.finish, args=(status,),
                                               name="baton-mlflow-finish")
            self._finishing.start()
            return
        self._closed = True  # what is left is delivered here
        self._due.set()
        if not self.run_id:
            return
        deadline = time.monotonic() + FINISH_WAIT_S
        while not self._deliver() and time.monotonic() < deadline:
            time.sleep(max(0.0, min(self._retry_at, deadline) - time.monotonic()))
        if self.degraded_since is not None:
            print(f"baton: warning: the MLflow store at {redact(self.uri)} is still away: "
                  f"{len(self._buffer)} metric values, {len(self._tags)} tags and "
                  f"{len(self._dicts)} artifacts of run {self.run_id} were not delivered, and the "
                  f"run is left RUNNING", file=sys.stderr)
            return
        from baton.tracking import report

        try:
            with self._sending:
                report.log_to_run(self.client, self.run_id)
        except Exception as e:  # noqa: BLE001 - the run's own outcome matters more
            print(f"baton: warning: no report for MLflow run {self.run_id}: "
                  f"{type(e).__name__}: {e}", file=sys.stderr)
        self._try(lambda: self.client.set_terminated(self.run_id, status=status))

    # -- delivery -------------------------------------------------------------------------------

    @_shielded
    def _deliver(self) -> bool:
        """Send what is waiting, oldest first; True when nothing is left. While the store is
        away, only once its retry is due. One delivery at a time (the sender's or the
        caller's); metrics logged meanwhile join the buffer's end."""
        with self._sending:
            return self._deliver_now()

    def _deliver_now(self) -> bool:
        if not self.run_id:
            return True
        if self.degraded_since is not None and time.monotonic() < self._retry_at:
            return False
        from mlflow.entities import RunTag

        def send() -> None:
            while self._buffer:  # each batch leaves the buffer once the store took it
                batch = self._buffer[:MAX_BATCH]  # (steps logged meanwhile join the end)
                self.client.log_batch(self.run_id, metrics=batch)
                del self._buffer[:len(batch)]
            if self._tags:
                self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in self._tags.items()])
                self._tags = {}
            for name in list(self._dicts):
                self.client.log_dict(self.run_id, self._dicts[name], name)
                del self._dicts[name]
        ok = self._try(send)
        if ok:
            self._last_flush = time.monotonic()
        return ok

    def _try(self, call) -> bool:
        """One call to the store. A failure degrades the tracker (warned once) instead of
        raising; the next success restores it."""
        try:
            with self._sending:
                call()
        except Exception as e:  # noqa: BLE001 - any store error: the server, the network, sqlite
            if self.degraded_since is None:
                self.degraded_since = time.time()
                print(f"baton: warning: the MLflow store at {redact(self.uri)} failed "
                      f"({type(e).__name__}: {redact(str(e))[:300]}); training goes on, and "
                      "metrics wait in memory until it is back", file=sys.stderr, flush=True)
            self._retry_at = time.monotonic() + self._backoff
            self._backoff = min(RETRY_MAX_S, self._backoff * 2)
            return False
        if self.degraded_since is not None:
            print(f"baton: the MLflow store is back after {time.time() - self.degraded_since:.0f} s; "
                  "what waited is delivered", file=sys.stderr, flush=True)
            self.degraded_since, self._backoff = None, RETRY_FIRST_S
        return True


class NullTracker:
    """Stands in when tracking is off, so the training loop has no `if tracker:` branches."""

    uri = None
    run_id = None
    state = "off"

    def open_ahead(self) -> None: ...
    def drop_ahead(self) -> None: ...
    def wait_finished(self) -> None: ...

    def start(self, run_name: str, params: dict, run_id: Optional[str] = None) -> Optional[str]:
        return None

    def find(self, key: str, value: str) -> Optional[str]:
        return None

    def log_metrics(self, step: int, metrics: dict, *, replayed_ok: bool = False) -> None: ...
    def flush(self) -> None: ...
    def set_tags(self, tags: dict) -> None: ...
    def log_artifacts(self, local_dir: str, artifact_path: str) -> None: ...
    def log_dict(self, obj, artifact_file: str) -> None: ...
    def finish(self, status: str, background: bool = False) -> None: ...


def make_tracker(spec: TrackingSpec):
    return MLflowTracker(spec) if spec.enabled else NullTracker()
