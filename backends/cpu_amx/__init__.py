from .runner import CpuAmxRunner, CpuRunner

__all__ = ["CpuAmxRunner", "CpuRunner"]
