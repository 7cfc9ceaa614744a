from baton.data.order import Cursor, EpochOrder

__all__ = ["Cursor", "EpochOrder"]
