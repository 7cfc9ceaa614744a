from baton.coordinator.coordinator import Coordinator, RunResult, State

__all__ = ["Coordinator", "RunResult", "State"]
