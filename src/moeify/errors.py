"""The error type for bad user input that the CLI reports without a traceback."""


class MoeifyError(Exception):
    """A problem the user can fix (bad config, missing file, corrupt checkpoint, ...).
    The message says what is wrong and what to do."""
