"""Errors the CLI turns into a one-line message and a non-zero exit code."""


class AtomflowError(Exception):
    """Base class: anything the user can act on. The CLI prints `error: <message>` and exits 1."""


class ConfigError(AtomflowError):
    pass


class FetchError(AtomflowError):
    pass


class VerifyError(AtomflowError):
    pass


class GpuUnavailable(AtomflowError):
    pass


class Terminated(BaseException):
    """SIGTERM (`timeout`, a job scheduler) raised in the main thread, so that what is being written is removed and a
    tensor-parallel launcher stops its ranks, as for Ctrl-C. Not an Exception: no `except Exception` swallows it."""
