"""One shallow, picklable hierarchy for every error baton raises on purpose.

Each error carries a one-line message meant for a user; the CLI prints it and exits non-zero.
They pickle cleanly (only a message string) so they survive crossing Ray actor boundaries.
"""


def reason(error: BaseException) -> str:
    """An exception in one line for a message: its type and the first line of its text."""
    first = (str(error).strip().splitlines() or [""])[0][:300]
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


class BatonError(Exception):
    """Base class: a failure with a message a user can act on."""


class SpecError(BatonError):
    """The job file is wrong. The message names the file, the key, the value and the fix."""


class DataError(BatonError):
    """The input data is missing or not shaped as the job says."""


class CheckpointError(BatonError):
    """A checkpoint cannot be written, found or loaded."""


class StoreUnavailable(BatonError):
    """The checkpoint store did not answer a read, tried again and again (an object store's
    outage, a lost mount): nothing read is judged, and no checkpoint is set aside for it."""


class WorkerError(BatonError):
    """A worker failed while training; the message names the rank and the step."""


class NoRoom(WorkerError):
    """Too few of a world's workers found room on the cluster in time (they started nowhere,
    rather than failing to start)."""


class OutOfMemory(WorkerError):
    """A worker's allocation failed (device or host memory): the message says which, how much
    was asked for, and what lowers it."""


class WorkerLost(WorkerError):
    """Workers died, froze or failed: the coordinator may recover. `cause` is one of
    baton.coordinator.policy.CAUSES; `ranks` the ranks found dead or silent, where known."""

    def __init__(self, message: str, cause: str, ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.cause, self.ranks = cause, tuple(ranks)

    def __reduce__(self):
        return (type(self), (str(self), self.cause, self.ranks))


class TrackingError(BatonError):
    """The tracking store cannot be opened at the start of a run (later failures degrade)."""


class ClusterError(BatonError):
    """A remote Ray cluster cannot be reached, refuses the request, or does not know the job."""


def raised_cause(error: BaseException) -> str:
    """What a worker's exception was: "timeout" for a collective that timed out in
    torch.distributed's backends: a RuntimeError (gloo's, measured on torch 2.13: a plain one
    whose message starts "[.../gloo/transport/...] Timed out waiting") or a DistBackendError
    (a RuntimeError) with NCCL's watchdog message;
    "exception" for everything else: the job's own code, whatever its message says (a
    `TimeoutError` or a "timeout" in a user's message is its own bug, which the repeat rule
    must see)."""
    text = str(error)
    backend = "gloo/" in text or "NCCL" in text or "ProcessGroupGloo" in text
    timed_out = "timed out" in text.lower() or "Watchdog caught collective operation timeout" in text
    return "timeout" if isinstance(error, RuntimeError) and backend and timed_out else "exception"
