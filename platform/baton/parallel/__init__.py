from baton.parallel.mesh import ParallelDims

__all__ = ["ParallelDims"]
