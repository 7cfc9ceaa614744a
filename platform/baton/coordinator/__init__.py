from baton.coordinator.coordinator import Coordinator, State
from baton.coordinator.result import RunResult

__all__ = ["Coordinator", "RunResult", "State"]
