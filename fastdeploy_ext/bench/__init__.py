"""Benchmarks, one module per benchmark. They take typed values or their own flags and never
import the command line (entrypoints/): the CLI calls them."""


class BenchError(ValueError):
    """A benchmark request that cannot run (unknown workload, bad size); the message says why.
    The CLI prints it as one line with exit status 2."""
