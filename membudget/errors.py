"""The one exception type a user sees as a message instead of a traceback."""


class UserError(Exception):
    """A problem the user can fix: shown as one line (key, bad value, fix), never as a traceback."""


class Stopped(Exception):
    """The run stopped at a step boundary on request (SIGTERM, Ctrl-C); its checkpoint and summary are written."""

    def __init__(self, status: str, signal_name: str, message: str):
        super().__init__(message)
        self.status = status
        self.signal_name = signal_name
