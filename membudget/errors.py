"""The one exception type a user sees as a message instead of a traceback."""


class UserError(Exception):
    """A problem the user can fix: shown as one line (key, bad value, fix), never as a traceback."""


class Stopped(Exception):
    """The run stopped at a step boundary on request (SIGTERM, Ctrl-C); its checkpoint and summary are written."""

    def __init__(self, status: str, signal_name: str, message: str):
        super().__init__(message)
        self.status = status
        self.signal_name = signal_name


def one_line(e: BaseException) -> str:
    """"Type: first line of the message": a failure reported in one line (a failed trial, a report's note)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"
