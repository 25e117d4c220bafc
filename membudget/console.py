"""How errors reach the console: one line per job on a host (not one per rank), log files that cannot be written
without tracebacks, and Hydra's errors and a sweep's failed jobs each in one line. The exceptions themselves are
membudget/errors.py's."""

from __future__ import annotations

from membudget.errors import UserError
from membudget.launch import launch_from_env

# --- one line per job, not one per rank ---------------------------------------------------------------------------

_SAID: list = []  # the sockets that claim the lines this process said (released when it exits)


def first_to_say(message: str) -> bool:
    """Whether this process is the first of its job on this host to say `message`: the ranks of a torchrun or
    srun job all fail with the same line, which the console should show once. The claim is an abstract Unix
    socket named after the job and the line (Linux; it vanishes with the process, so it leaves nothing behind
    and a rerun says it again); elsewhere, or outside a multi-rank job, every process says it."""
    import hashlib
    import socket
    import sys

    try:
        launch = launch_from_env()
    except Exception:  # noqa: BLE001 - a launch that is itself the error: say it
        return True
    if launch.world_size == 1 or launch.job_key is None or not sys.platform.startswith("linux"):
        return True
    name = "\0membudget-said-" + hashlib.sha1(f"{launch.job_key}\n{message}".encode()).hexdigest()
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        claim.bind(name)
    except OSError:
        claim.close()
        return False  # another rank of this job on this host said it already
    _SAID.append(claim)
    return True


def log_error_once(logger, message: str) -> None:
    """`error: <message>` in this rank's log file, and on the console unless another rank of the job on this
    host printed the same line."""
    import logging

    if first_to_say(message):
        logger.error("error: %s", message)
        return
    record = logger.makeRecord(logger.name, logging.ERROR, __file__, 0, "error: %s", (message,), None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


# --- log files that cannot be written -------------------------------------------------------------------------

def quiet_log_file_errors() -> None:
    """A log file that cannot be written (a full disk) costs its lines, never a traceback: logging's default
    `handleError` prints `--- Logging error ---` and a traceback for every record. Instead, the first failure
    of each file handler is one line on stderr; later records go to the console only (the file takes them
    again once it can)."""
    import logging

    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and not getattr(handler, "_membudget_quiet", False):
            handler.handleError = _LogFileError(handler)
            handler._membudget_quiet = True


class _LogFileError:
    def __init__(self, handler):
        self.handler, self.told = handler, False

    def __call__(self, record) -> None:
        import contextlib
        import sys

        if self.told:
            return
        self.told = True
        error = sys.exc_info()[1]
        why = getattr(error, "strerror", None) or error or "unknown error"
        with contextlib.suppress(Exception):
            sys.stderr.write(f"warning: could not write the log file {self.handler.baseFilename} ({why}); "
                             "its lines are on the console only until it can be written again\n")


# --- the command line: Hydra's own errors as one line -----------------------------------------------------------
# Hydra parses the overrides and composes the config before train.py's code runs, and prints its errors as
# several lines (a lexer's caret, OmegaConf's full_key/reference_type/object_type) or, for a failed sweep job,
# as a traceback. train.py checks the overrides first (`override_problem`) and runs Hydra inside
# `one_line_hydra_errors`, which turns what it recognises into one `error: ...` line; HYDRA_FULL_ERROR=1
# keeps Hydra's full report.

def _shell_quoted(override: str) -> str:
    """The override as one shell word: 'key="value"'."""
    return "'" + override.replace("'", "'\\''") + "'"


def override_problem(argv: list[str]) -> "str | None":
    """One line for the first command-line override Hydra's grammar cannot read, with the quoted form that works
    (`data.path=/tmp/données.txt` -> 'data.path="/tmp/données.txt"'; a path the shell split at a space,
    `data.path=/tmp/my data.txt` -> 'data.path="/tmp/my data.txt"'); None when every override parses (or the
    arguments are not Hydra's: Hydra reports those itself)."""
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    try:
        args, _ = get_args_parser().parse_known_args(argv)
    except SystemExit:
        return None
    parser = OverridesParser.create()

    def error(override: str) -> "Exception | None":
        try:
            parser.parse_overrides([override])
        except OverrideParseException as e:
            return e
        return None

    def parses(override: str) -> bool:
        return error(override) is None

    previous = None
    for arg in args.overrides or []:
        if parses(arg):
            previous = arg
            continue
        key, eq, value = arg.partition("=")
        if not eq:
            if previous is not None and "=" in previous:
                pkey, _, pvalue = previous.partition("=")
                joined = f'{pkey}="{pvalue} {arg}"'
                if parses(joined):
                    return (f"{arg!r} is not an override (key=value): if it is the rest of {previous!r}, a value "
                            "with a space that the shell split, quote the whole override, the value in double "
                            f"quotes: {_shell_quoted(joined)}")
            return (f"{arg!r} is not an override: write key=value or group=option (python train.py --help lists "
                    "them), and quote a value with spaces: 'key=\"a value\"'")
        quote = "'" if '"' in value else '"'
        # a sweep's values each quoted (a,b -> "a","b"), else the whole value
        quoted = f"{key}=" + ",".join(f"{quote}{v}{quote}" for v in value.split(","))
        if "," in value and not parses(quoted):
            quoted = f"{key}={quote}{value}{quote}"
        odd = sorted({c for c in value if ord(c) > 127 or c.isspace()})
        what = (f"its value has characters Hydra reads only in quotes ({', '.join(map(repr, odd))})" if odd
                else "Hydra's override grammar cannot read it unquoted")
        if parses(quoted):
            return f"{key}={value!r}: {what}; quote the value, and the override for the shell: {_shell_quoted(quoted)}"
        first = next((line for line in str(error(arg)).splitlines() if line.strip()), "")
        return (f"{arg!r}: Hydra cannot parse this override ({first.strip()}); see "
                "https://hydra.cc/docs/advanced/override_grammar/basic/")
    return None


def composition_error_line(e: BaseException) -> str:
    """Hydra's composition error (ConfigCompositionException: a bad choice, key, type or option) as one line
    naming the key, the value and the options or the fix."""
    import re

    cause = e.__cause__
    full_key = getattr(cause, "full_key", None)
    cause_first = str(cause).strip().splitlines()[0].strip() if cause is not None and str(cause).strip() else ""
    choice = re.match(r"Invalid value '(.*)', expected one of \[(.*)\]$", cause_first)
    if choice and full_key:
        options = [o.strip() for o in choice.group(2).split(",")]
        return (f"{full_key}={choice.group(1)!r}: not one of its options; choose one of "
                f"{', '.join(f'{full_key}={o}' for o in options)}")
    if full_key and type(cause).__name__ in ("ConfigAttributeError", "ConfigKeyError") and " not in " in cause_first:
        # Hydra suggests appending it with +key: the schema takes no key of its own
        return (f"{full_key}: no such key ({cause_first}); check its spelling against the keys "
                "`python train.py --cfg job` prints")
    lines = [line.strip() for line in str(e).split("Config search path:")[0].splitlines() if line.strip()]
    missing = re.match(r"In '.*': Could not find '(.+)/([^/']+)'$", lines[0]) if lines else None
    if missing and len(lines) > 1 and lines[1].startswith("Available options"):
        group, option = missing.groups()
        return (f"{group}={option}: there is no option '{group}/{option}'; choose one of "
                f"{', '.join(f'{group}={o}' for o in lines[2:])}")
    merging = re.match(r"Error merging override (.+)$", lines[0]) if lines else None
    if merging and cause_first:
        return f"{merging.group(1)}: {cause_first}"
    line = " ".join(lines)
    return f"{line} ({cause_first})" if cause_first else line


class SweepJobs:
    """The jobs of this process's multirun that ended here (Hydra's basic launcher runs them in this process;
    a SLURM launcher's run elsewhere and are not seen): filled by membudget.rundir.SweepReport."""

    ended: list = []
    sweep_dir: "str | None" = None


def _is_job_error(e: BaseException) -> bool:
    """A sweep job's own UserError, raised again by the sweeper (not, say, a search giving up): one of the jobs
    that ended here returned it, or (jobs run elsewhere) it names its job as train.py does, `job N [...]: `."""
    import re

    return any(r._return_value is e for r in SweepJobs.ended) or re.match(r"job \d+ \[", str(e)) is not None


def _job_label(job_return, varying: "set[str] | None" = None) -> str:
    num = job_return.hydra_cfg.hydra.job.num if job_return.hydra_cfg is not None else "?"
    overrides = [o for o in (job_return.overrides or []) if varying is None or o in varying]
    return f"job {num} [{' '.join(overrides)}]"


def sweep_failure_line(e: BaseException) -> str:
    """The sweep's one summary line: `1 of 3 jobs failed: job 0 [optimizer.lr=nan]` (the overrides that differ
    between the jobs), from the jobs that ended in this process; else (a remote launcher) the raised job's
    own line."""
    from hydra.core.utils import JobStatus

    ended = [r for r in SweepJobs.ended if r.status in (JobStatus.COMPLETED, JobStatus.FAILED)]
    failed = [r for r in ended if r.status == JobStatus.FAILED]
    if not failed:  # the jobs ran elsewhere (SLURM): the one that raised is known here
        return f"a job of the sweep failed: {e}"
    common = set.intersection(*(set(r.overrides or []) for r in ended))
    varying = {o for r in ended for o in (r.overrides or [])} - common if len(ended) > 1 else None
    names = ", ".join(_job_label(r, varying or None) for r in failed)
    return f"{len(failed)} of {len(ended)} jobs failed: {names}; each job's error is above"


def _print_crashed_jobs() -> None:
    """The traceback of each job that ended here with an exception other than a UserError (a bug, not a
    setting): Hydra keeps it in the job's result, and raises only the first failure's."""
    import sys
    import traceback

    for r in SweepJobs.ended:
        if isinstance(r._return_value, BaseException) and not isinstance(r._return_value, UserError):
            sys.stderr.write(f"{_job_label(r)} failed with an exception:\n")
            traceback.print_exception(r._return_value)


class _DropFailedJobLines:
    """sys.stderr without Hydra's `Error executing job with overrides: [...]` for a job whose UserError was
    already printed as one line (Hydra writes it just before raising the job's exception)."""

    PREFIX = "Error executing job with overrides: "

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        if text.startswith(self.PREFIX) and any(
                isinstance(r._return_value, UserError) and text.strip() == (self.PREFIX + str(r.overrides))
                for r in SweepJobs.ended):
            return len(text)
        return self._stream.write(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def one_line_hydra_errors():
    """Run Hydra's entry point (`hydra.main`) with its errors as one line: a composition error (exit 1), an
    override that does not parse (exit 1), a UserError that reaches Hydra (a multirun's failed job: the sweep's
    summary line; a search that gave up), exit 2. Other exceptions keep Hydra's report."""
    import contextlib
    import os
    import sys

    import hydra._internal.utils as hydra_utils
    from hydra.errors import ConfigCompositionException, OverrideParseException

    original = hydra_utils.run_and_report
    try:
        args, _ = hydra_utils.get_args_parser().parse_known_args(sys.argv[1:])
        multirun = bool(args.multirun) or "hydra.mode=MULTIRUN" in (args.overrides or [])
    except SystemExit:
        multirun = False

    def run_and_report(func):
        def guarded():
            try:
                with contextlib.redirect_stderr(_DropFailedJobLines(sys.stderr)) if multirun \
                        else contextlib.nullcontext():
                    return func()
            except Exception as e:
                if os.environ.get("HYDRA_FULL_ERROR") == "1":
                    raise
                if isinstance(e, ConfigCompositionException):
                    line, code = composition_error_line(e), 1
                elif isinstance(e, OverrideParseException):
                    line, code = override_problem(sys.argv[1:]) or " ".join(str(e).split()), 1
                elif isinstance(e, UserError) and multirun and _is_job_error(e):
                    _print_crashed_jobs()
                    line, code = sweep_failure_line(e), 2
                elif isinstance(e, UserError):
                    line, code = str(e), 2
                else:
                    raise
                if first_to_say(line):  # once per job on a host, not once per rank
                    sys.stderr.write(f"error: {line}\n")
                    sys.stderr.flush()
                raise SystemExit(code) from None

        return original(guarded)

    @contextlib.contextmanager
    def patched():
        hydra_utils.run_and_report = run_and_report
        try:
            yield
        finally:
            hydra_utils.run_and_report = original

    return patched()
