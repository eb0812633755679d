"""Adapters between fastdeploy_ext runners and other frameworks' tensors (Paddle: paddle.py).
Nothing here is imported by the framework itself; each adapter imports its framework lazily."""
