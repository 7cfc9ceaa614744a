from baton.data.order import Cursor, EpochOrder
from baton.data.source import TokenTable

__all__ = ["Cursor", "EpochOrder", "TokenTable"]
