from .runner import CudaRunner

__all__ = ["CudaRunner"]
