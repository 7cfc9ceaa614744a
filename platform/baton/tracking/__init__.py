from baton.tracking.mlflow_tracker import MLflowTracker, NullTracker, make_tracker

__all__ = ["MLflowTracker", "NullTracker", "make_tracker"]
