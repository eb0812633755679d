"""Acme N1 backend for fastdeploy_ext (sample out-of-tree vendor package)."""
