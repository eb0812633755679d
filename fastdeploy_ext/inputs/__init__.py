"""Inputs every entry point shares: images.py (what an image may be given as, and reading it with
its checks). The engine's and server's request inputs build on it."""
