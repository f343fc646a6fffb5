"""The `snapcompile` command line. User mistakes end in one `error:` line and exit code 2."""
from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager

import click

from snapcompile.errors import EngineFailure, ParityError, SnapcompileError

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130
STOP_GRACE_S = 10.0     # after SIGTERM / Ctrl-C, unwinding may take this long; then the process exits


class _Group(click.Group):
    """Every user error (ours or click's usage errors) is one `error:` line and exit code 2;
    SIGTERM unwinds like Ctrl-C, so staging folders are removed on the way out. Unwinding is
    bounded: a second signal, or STOP_GRACE_S after the first, ends the process at once (library
    code that retries under a bare `except:` swallows the KeyboardInterrupt a signal raises)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        stop = _Stop()
        for sig in previous:
            signal.signal(sig, stop.on_signal)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.ClickException as err:
            click.echo(f"error: {_one_line(err.format_message())}", err=True)
            code = EXIT_USER_ERROR
        except (click.Abort, KeyboardInterrupt) as err:
            cause = err if isinstance(err, KeyboardInterrupt) else err.__cause__   # click wraps it in Abort
            detail = str(cause) if isinstance(cause, KeyboardInterrupt) else ""
            click.echo(f"error: interrupted{'; ' + detail if detail else ''}", err=True)
            code = EXIT_INTERRUPTED
        finally:
            stop.cancel()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        code = code if isinstance(code, int) else 0
        if standalone_mode:
            sys.exit(code)
        return code

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except SnapcompileError as err:
            click.echo(f"error: {_one_line(str(err))}", err=True)
            ctx.exit(1 if isinstance(err, (ParityError, EngineFailure)) else EXIT_USER_ERROR)
        except OSError as err:      # a full disk, a read-only folder, a name too long: the system's word
            click.echo(f"error: {_os_error(err)}", err=True)
            ctx.exit(EXIT_USER_ERROR)


_deferred = {"depth": 0, "signal": None}     # stop_signals_deferred's blocks open, the signal held


@contextmanager
def stop_signals_deferred():
    """A stop signal (SIGTERM, SIGINT) that arrives during the block is acted on at its end, by the
    handler then installed: for code that must not be interrupted halfway (a progress bar
    interrupted inside its constructor is half made, and its finalizer prints a traceback). Python
    runs signal handlers on the main thread, so only its blocks defer."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _deferred["depth"] += 1
    try:
        yield
    finally:
        _deferred["depth"] -= 1
        held = _deferred["signal"]
        if not _deferred["depth"] and held is not None:
            _deferred["signal"] = None
            handler = signal.getsignal(held)
            if callable(handler):
                handler(held, None)


def progress_bar(**options):
    """A tqdm bar on stderr (tqdm's options), made with the stop signals deferred."""
    from tqdm import tqdm
    with stop_signals_deferred():
        return tqdm(file=sys.stderr, **options)


class _Stop:
    """The handler of SIGTERM and SIGINT: the first raises KeyboardInterrupt (the command unwinds)
    and arms a timer that exits after STOP_GRACE_S; a second exits at once."""

    def __init__(self):
        self._timer: threading.Timer | None = None

    def on_signal(self, signum, frame):
        if _deferred["depth"]:
            _deferred["signal"] = signum
            return
        if self._timer is not None:
            _exit_now("interrupted again")
        self._timer = threading.Timer(STOP_GRACE_S, _exit_now, (f"still running {STOP_GRACE_S:g} s after the signal",))
        self._timer.daemon = True
        self._timer.start()
        raise KeyboardInterrupt

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


def _exit_now(why: str) -> None:
    sys.stderr.write(f"error: interrupted ({why}; stopped)\n")
    sys.stderr.flush()
    os._exit(EXIT_INTERRUPTED)


def _os_error(err: OSError) -> str:
    """'PATH: reason' (an OSError's own message when it names no file)."""
    reason = err.strerror or _one_line(str(err)) or type(err).__name__
    return f"{err.filename}: {reason}" if err.filename else reason


def _one_line(message: str) -> str:
    return " ".join(message.split())


@click.group(cls=_Group)
@click.version_option(package_name="snapcompile")
def main():
    """SnapStream fixed-budget KV-cache compression for ONNX Runtime and TensorRT.

    Typical flow: `convert` a model to a compressed artifact folder, `inspect` it, `run` prompts
    through it, and `validate` it against PyTorch.
    """


def _add_commands() -> None:
    """Each command lives in the module of its stage."""
    from snapcompile.cli.bench import bench
    from snapcompile.cli.build import build
    from snapcompile.cli.convert import compress, convert, export
    from snapcompile.cli.eval import eval_command
    from snapcompile.cli.inspect import inspect
    from snapcompile.cli.ruler import eval_ruler
    from snapcompile.cli.run import run, validate
    from snapcompile.cli.serve import bench_serve, serve
    from snapcompile.cli.triton import triton_repo, triton_serve
    from snapcompile.cli.turns import bench_turns, eval_turns
    for command in (export, convert, compress, inspect, build, run, validate, serve, bench_serve, triton_repo,
                    triton_serve, eval_command, eval_ruler, eval_turns, bench, bench_turns):
        main.add_command(command)


_add_commands()
