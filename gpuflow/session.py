"""What every `gpuflow` command that talks to Prefect shares: which API it uses, how a
signal ends it (one sentence, exit 130 or 143, nothing left running), and the one
sentence it prints when the API fails."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any

from gpuflow.tasks.loading import loading as loading  # commands load through it

EXIT_FAILED, EXIT_INVALID = 1, 2
SIGNAL_NAMES = {signal.SIGINT: "SIGINT (Ctrl-C)", signal.SIGTERM: "SIGTERM"}


class Stopped(BaseException):
    """This process got SIGTERM outside a flow run (Prefect raises its own inside one)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signal = signum


def say(message: str) -> None:
    """Print a line about what gpuflow itself does (not the job's output, not an error)."""
    print(f"[gpuflow] {message}", file=sys.stderr, flush=True)


def fail(message: str) -> None:
    """Print the one sentence that says why a command could not go on."""
    print(f"gpuflow: {message}", file=sys.stderr, flush=True)


class _Outliving:
    """A terminal stream that a run outlives: once its reader is gone (`| head -3`, a
    closed terminal) what is written is dropped, and its descriptor points at /dev/null
    so that nothing fails on it later; the run goes on to its end, its log whole in the
    API. (Prefect's console handler would otherwise end the run as Crashed.)"""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._gone = False

    def _lost(self, exc: OSError) -> None:
        if exc.errno not in (errno.EPIPE, errno.EIO):
            raise exc
        self._gone = True
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)

    def write(self, text: str) -> int:
        if not self._gone:
            try:
                return int(self._stream.write(text))
            except OSError as exc:
                self._lost(exc)
        return len(text)

    def flush(self) -> None:
        if not self._gone:
            try:
                self._stream.flush()
            except OSError as exc:
                self._lost(exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def outlive_the_terminal() -> None:
    """Let a command outlive its terminal: stdout and stderr whose reader went away are
    dropped instead of ending it, and SIGHUP (the terminal closed) is noted, not fatal.
    A handler, not SIG_IGN: the jobs it starts get SIGHUP's default again."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _Outliving):
            setattr(sys, name, _Outliving(stream))
    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, lambda signum, frame: None)


def install_signal_handlers() -> dict[signal.Signals, Any]:
    """SIGTERM raises Stopped, SIGINT KeyboardInterrupt, once: a repeated signal while the
    first one is being handled (the job gets its stop_grace_s, teardown runs) is ignored.
    Return the handlers they replace."""
    stopping: list[int] = []
    previous = {signum: signal.getsignal(signum) for signum in SIGNAL_NAMES}

    def handler(signum: int, frame: Any) -> None:
        if stopping:
            say("already stopping: the job gets its grace period, then teardown runs")
            return
        stopping.append(signum)
        # Inside a flow run Prefect's own SIGTERM handler is installed; from now on this
        # one answers both signals, so a second one can not cut the stop short.
        for other in SIGNAL_NAMES:
            signal.signal(other, handler)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Stopped(signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return previous


def signal_of(exc: BaseException) -> int | None:
    """Return the signal an interruption stands for, or None when it is not one."""
    if isinstance(exc, KeyboardInterrupt):
        return signal.SIGINT
    if isinstance(exc, Stopped):
        return exc.signal
    from prefect.exceptions import TerminationSignal

    if isinstance(exc, TerminationSignal):
        return exc.signal
    return None


def settings_checked() -> None:
    """Read every GPUFLOW_* number a command may use (InvalidSpec, one sentence, for one
    that is no number or out of range), so none is found wrong half-way."""
    with loading():  # the outage watch's modules are most commands' first of Prefect's
        from gpuflow.outage import outage_bound_s
        from gpuflow.tasks.platform import api, kept_api

    kept_api.idle_s()
    api.start_timeout_s()
    outage_bound_s()


def with_api(body: Callable[[Any], int], temporary: bool = True) -> int:
    """Run `body(api)` against the chosen Prefect API (see gpuflow.tasks.platform.api) and return
    its exit code; an unreachable API ends it with one sentence. With `temporary` False
    (deployments live on a lasting server) no temporary API is started."""
    from gpuflow.tasks.errors import GpuflowError, InvalidSpec
    from gpuflow.tasks.host import StateFileError, gpuflow_home, secure_home
    from gpuflow.tasks.platform import api as prefect_api

    try:
        secure_home()  # the runs, logs and keys below it: this user's alone
        settings_checked()  # gpuflow's own variables: refused before any server starts
        chosen = prefect_api.choose(say, temporary)
    except (prefect_api.ApiUnavailable, StateFileError) as exc:
        fail(str(exc))
        return EXIT_FAILED
    except OSError as exc:  # a full or read-only GPUFLOW_HOME while looking for an API
        fail(
            f"gpuflow could not keep its state under GPUFLOW_HOME {gpuflow_home()}"
            f" ({exc.strerror or exc}); free space there, make it writable, or point"
            " GPUFLOW_HOME at another folder."
        )
        return EXIT_FAILED
    except InvalidSpec as exc:  # a setting in the environment
        fail(f"invalid input: {exc}")
        return EXIT_INVALID
    if chosen.kind != "temporary":
        say(f"using {chosen.describe()}")
    with prefect_api.using(chosen):
        if (gpuflow_home() / "unreported").is_dir():  # runs an API outage left Running
            from gpuflow.tasks.platform.reap import deliver_unreported

            deliver_unreported(say, chosen.url)
        try:
            return body(chosen)
        except InvalidSpec as exc:  # the command's own input (a kubeconfig, a block name)
            fail(f"invalid input: {exc}")
            return EXIT_INVALID
        except GpuflowError as exc:  # gpuflow's own sentence for what went wrong
            fail(str(exc))
            return EXIT_FAILED
        except Exception as exc:  # the engine itself failed talking to the API
            fail(api_failure(exc, chosen))
            return EXIT_FAILED


STOPPED_A_RUN = "the job (if one ran) was stopped and torn down, and its flow run marked Crashed."


def interruptible(command: Callable[[], int], stopped: str | None = None) -> int:
    """Run a whole command with gpuflow's signal handlers: a signal ends it, after the
    `finally` blocks and flow hooks stopped and tore down what it started, with one
    sentence (`stopped` says what the stop did; a run's command by default) and exit
    128 + the signal's number."""
    previous = install_signal_handlers()
    try:
        return command()
    except BaseException as exc:
        signum = signal_of(exc)
        if signum is None:
            raise
        name = SIGNAL_NAMES.get(signal.Signals(signum), str(signum))
        fail(f"stopped by {name}: {stopped or STOPPED_A_RUN}")
        return 128 + int(signum)
    finally:
        for signum, handler in previous.items():  # as they were, for a caller that goes on
            signal.signal(signum, handler)


def api_failure(exc: BaseException, api: Any) -> str:
    """Return one sentence for an error raised while talking to `api`: its real cause."""
    import httpx

    cause = exc
    while cause.__cause__ is not None and not isinstance(cause, httpx.HTTPError):
        cause = cause.__cause__
    if isinstance(cause, httpx.ConnectError):
        detail = "the connection was refused or dropped"
    elif isinstance(cause, httpx.TimeoutException):
        detail = "it did not answer in time"
    elif isinstance(cause, httpx.HTTPStatusError):
        detail = f"it answered HTTP {cause.response.status_code} to {cause.request.url.path}"
    else:
        text = str(cause).strip()
        first = text.splitlines()[0][:300] if text else ""
        return f"the run failed: {type(cause).__name__}{': ' + first if first else ''}."
    return f"the run failed talking to {api.describe()}: {detail}; check that server's log."


class _Sentence(logging.Formatter):
    """Formats a log record as `inner` does, without the traceback of gpuflow's own errors
    (their message is the one sentence the user needs; the run's log in Prefect keeps
    the traceback)."""

    def __init__(self, inner: logging.Formatter | None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        from gpuflow.tasks.errors import GpuflowError

        if record.exc_info and isinstance(record.exc_info[1], GpuflowError):
            record = logging.makeLogRecord(
                {**record.__dict__, "exc_info": None, "exc_text": None, "stack_info": None}
            )
        return self.inner.format(record)


@contextlib.contextmanager
def sentences_on_console() -> Iterator[None]:
    """While a flow runs in this process, the terminal shows gpuflow's errors as their
    sentence and the job's own lines, not Prefect's traceback of gpuflow's code."""
    from prefect.logging.handlers import PrefectConsoleHandler

    handlers = [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]
    previous = [h.formatter for h in handlers]
    for handler in handlers:
        handler.setFormatter(_Sentence(handler.formatter))
    try:
        yield
    finally:
        for handler, formatter in zip(handlers, previous, strict=True):
            handler.setFormatter(formatter)
