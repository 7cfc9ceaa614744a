from baton.workers.host import collector_paused

with collector_paused():  # torch and the workers' modules load faster without it (host.py)
    from baton.workers.group import WorkerGroup

__all__ = ["WorkerGroup"]
