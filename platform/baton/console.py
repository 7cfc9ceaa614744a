"""The job's console is baton's: the progress line and one line per event (failure, recovery,
rescale, with its cause). Ray's own messages to the driver are kept in a file beside Ray's logs.

What those messages are: when a raylet dies or a node misses its heartbeats, the GCS pushes an
error to every driver, and Ray prints it on the driver's stdout with the dead raylet's last log
lines and its internal state dump (measured: one node removed from a simulated cluster put 46
of a run's 54 console lines there, two copies of one dump). baton names the same event in one
line (`node_died: lost node 10.0.3.7 (5f1c2a9e) with worker rank 0 while ...`), so the dump goes
to `<Ray session>/logs/baton-ray-messages.log` on the driver's node, and the console says once,
at the end, where it is.

The same goes for Ray's "Unhandled error" lines: a call whose result nobody will read failed
(a read of the data feed abandoned for a recovery fails while it is cancelled, and Ray says so
when the result is dropped). baton reads every result it wants; what it dropped, it dropped
on purpose, and the line goes to the file.

Ray has no switch for the first kind: `log_to_driver=False` stops the workers' output (which a user's
prints need) but not these errors, which Ray's listener thread (`listen_error_messages` in
`ray._private.worker`) hands to the module's `print_to_stdstream`. That name is looked up at
each call, and the workers' output is printed through a handler bound at `ray.init`, so
replacing the name routes the errors alone. The second kind is logged by the module's
`_unhandled_error_handler`, looked up the same way (`RAY_IGNORE_UNHANDLED_ERRORS` would drop
it instead of keeping it). Both are replaced only while baton owns the Ray it started, and put
back after `ray.shutdown()`, which joins the listener thread.
"""

from __future__ import annotations

import os
import tempfile
import threading
from typing import Callable, Optional

FILE_NAME = "baton-ray-messages.log"


class RayMessages:
    """Routes Ray's pushed error messages to a file for as long as it is installed."""

    def __init__(self, path: str):
        self.path = path
        self.count = 0
        self._lock = threading.Lock()
        self._original: Optional[tuple[Callable, Callable]] = None  # Ray's two functions

    @classmethod
    def for_this_ray(cls) -> "RayMessages":
        """The file in the logs folder of the Ray session this process joined (a node's own
        folder: the driver runs on a node of the cluster), else in the temporary folder."""
        from ray._private import worker

        node = getattr(worker, "_global_node", None)
        folder = node.get_logs_dir_path() if node is not None else tempfile.gettempdir()
        return cls(os.path.join(folder, FILE_NAME))

    def install(self) -> "RayMessages":
        from ray._private import worker

        self._original = worker.print_to_stdstream, worker._unhandled_error_handler
        worker.print_to_stdstream = self._print
        worker._unhandled_error_handler = self._unhandled
        return self

    def restore(self) -> None:
        from ray._private import worker

        if self._original is not None:
            worker.print_to_stdstream, worker._unhandled_error_handler = self._original
        self._original = None

    def where(self) -> Optional[str]:
        """One line for the console when anything was kept out of it, else None."""
        if not self.count:
            return None
        what = "a message" if self.count == 1 else f"{self.count} messages"
        verb = "is" if self.count == 1 else "are"
        return f"ray: {what} from Ray kept out of the console {verb} in {self.path}"

    def _print(self, data: dict, ignore_prefix: bool = False) -> None:
        if not self._keep([str(line) for line in data.get("lines", ())]):
            self._original[0](data, ignore_prefix)

    def _unhandled(self, error: Exception) -> None:
        if not self._keep([f"Unhandled error: {error}"]):
            self._original[1](error)

    def _keep(self, lines: list[str]) -> bool:
        """Append to the file; False when it cannot be written (then the console, as before)."""
        with self._lock:
            try:
                with open(self.path, "a", encoding="utf-8", errors="replace") as f:
                    f.write("\n".join(lines) + "\n\n")
            except OSError:
                return False
            self.count += 1
            return True
