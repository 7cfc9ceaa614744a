from baton.workers.group import WorkerGroup

__all__ = ["WorkerGroup"]
