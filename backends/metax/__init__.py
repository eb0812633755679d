from .runner import MetaxRunner

__all__ = ["MetaxRunner"]
