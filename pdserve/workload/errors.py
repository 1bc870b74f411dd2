"""The one exception type the benchmark raises for bad input or an unusable server."""


class BenchError(Exception):
    """A user-facing benchmark error; the CLI prints its message without a stack trace."""
