"""baton: elastic training for PyTorch on Ray."""

__version__ = "0.7.0"
