"""The ``hoist`` command's exit statuses."""

EXIT_OK = 0
EXIT_ERROR = 1
"""A file, flag value, placement or load hoist refuses (the message says which)."""
EXIT_USAGE = 2
"""The command line itself: an unknown option, a missing or doubled model path."""
EXIT_DOES_NOT_FIT = 3
"""The model does not fit the devices' free memory (``plan`` says so; ``load`` refuses)."""
EXIT_INTERRUPTED = 130
