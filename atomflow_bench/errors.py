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
