"""User-facing errors.

Anything a user can cause (a typo in a config, a missing data file, a corrupt checkpoint) raises a
subclass of `UserError`. The CLI prints its message on one line and exits with status 2; everything
else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """An error caused by the user's input; its message names the option or file and what is allowed."""


class ConfigError(UserError):
    """A config key or value is invalid."""


class DataError(UserError):
    """A data path is missing, empty, unreadable or of an unsupported format."""


class CheckpointError(UserError):
    """A checkpoint or run directory is missing, unreadable or corrupt."""
