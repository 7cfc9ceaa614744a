from baton.checkpoint.store import CheckpointStore

__all__ = ["CheckpointStore"]
