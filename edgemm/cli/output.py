"""What the `edgemm` commands write, and how they fail: a result on stdout, progress and
errors on stderr, each error one line with its exit code (edgemm/errors.py), and a stdout
or stderr that is closed, full or gone handled without a second message or a traceback.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any, TextIO

import click

from edgemm.errors import EdgemmError, InputError, internal_message


def fail(message: str, code: int) -> None:
    try:
        click.echo(f"edgemm: error: {message}", err=True)
    except OSError:  # stderr itself cannot be written (/dev/full): the exit code is all that is left
        silence(sys.stderr)
    sys.exit(code)


def to_stderr(text: str, nl: bool = True) -> None:
    """A line on stderr. One that cannot be written (a full disk, /dev/full) ends the command
    with exit 2, as a result that cannot be written does: the user would not know what happened."""
    try:
        click.echo(text, err=True, nl=nl)
    except OSError as e:
        silence(sys.stderr)
        raise cannot_write("standard error", e) from None


def reports_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn edgemm's errors into one line on stderr and the documented exit code."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except EdgemmError as e:
            if os.environ.get("EDGEMM_DEBUG"):
                traceback.print_exc()
            fail(str(e), e.exit_code)
        except KeyboardInterrupt:
            fail("interrupted", 130)
        except (click.exceptions.Exit, click.ClickException, SystemExit):
            raise
        except Exception as e:  # anything else is our bug: say so, exit 1
            if os.environ.get("EDGEMM_DEBUG"):
                traceback.print_exc()
            fail(f"{internal_message(e)} (set EDGEMM_DEBUG=1 for a traceback)", 1)
    return wrapper


@contextmanager
def progress(what: str, quiet: bool = False) -> Iterator[list[str]]:
    """`edgemm: loading WHAT … ready in 1.2 s` on stderr (never stdout: --json stays clean).
    On a terminal the first half shows while loading and is erased if an error follows;
    elsewhere (scripts, logs) the line comes whole once ready, so an error stays one line.
    What the caller adds to the list it is given is said after the time (`… ready in 0.1 s: q4`)."""
    interactive = not quiet and sys.stderr is not None and sys.stderr.isatty()  # None: started with 2>&-
    if interactive:
        to_stderr(f"edgemm: loading {what} … ", nl=False)
    t0 = time.perf_counter()
    notes: list[str] = []
    try:
        yield notes
    except BaseException:
        if interactive:
            with contextlib.suppress(InputError):  # the error that follows says the same
                to_stderr("\r\033[K", nl=False)
        raise
    if not quiet:
        start = "" if interactive else f"edgemm: loading {what} … "
        said = f": {', '.join(notes)}" if notes else ""
        to_stderr(f"{start}ready in {time.perf_counter() - t0:.1f} s{said}")


def say(line: str) -> None:
    """A progress line on stderr (`edgemm: warming 3 tiers … 24.1 s`)."""
    to_stderr(f"edgemm: {line}")


def silence_stdout() -> None:
    """stdout to /dev/null: what is still buffered for it goes nowhere, so the interpreter's
    last flush cannot fail again (a second message, and exit code 120) after the error is said."""
    silence(sys.stdout)


def silence(stream: IO | None) -> None:
    """`stream`'s descriptor to /dev/null (see silence_stdout); nothing for a closed stream (None)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):  # not a real descriptor (a test's capture)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


def keep_closed_descriptor(fd: int) -> None:
    """/dev/null at the closed descriptor `fd`, so that no file edgemm opens takes it and
    gets what a library writes to its stdout or stderr. sys.stdout stays None: nothing is said there."""
    try:
        os.fstat(fd)
    except OSError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        if devnull != fd:
            os.dup2(devnull, fd)
            os.close(devnull)


def standard_output() -> TextIO:
    """sys.stdout, or exit 2 when the process was started with it closed (`>&-`): Python
    then has None there, and print and click.echo write nothing without a word."""
    if sys.stdout is None:
        raise InputError("cannot write standard output: it is closed")
    return sys.stdout


def cannot_write(where: str, error: OSError) -> InputError:
    """A full disk (ENOSPC, /dev/full), EIO, …: exit 2 like an --out that cannot be opened."""
    return InputError(f"cannot write {where}: {error.strerror or error}")


def echo_result(text: str) -> None:
    """A command's result on stdout. One that cannot be written is said as one line (exit 2).
    A reader that closed the pipe (BrokenPipeError) is not this: it goes on as before."""
    stdout = standard_output()
    try:
        click.echo(text, file=stdout)
        stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as e:
        silence_stdout()
        raise cannot_write("standard output", e) from None


class JsonLines:
    """`edgemm stream`'s output: one JSON object a line to --out or stdout, flushed per line.

    A reader that closes the pipe (`| head -1`) ends the output quietly: write() says
    False, and stdout goes to /dev/null so that the interpreter's last flush cannot fail.
    Any other failure to write (a full disk) is an InputError: the stream ends, exit 2.
    """

    def __init__(self, path: str | None):
        try:
            self.file = open(path, "w", buffering=1) if path else standard_output()
        except OSError as e:
            raise InputError(f"cannot write --out {path}: {e.strerror}") from None
        self.path, self.closed_by_reader, self.failed = path, False, False
        self.where = f"--out {path}" if path else "standard output"

    def write(self, record: dict) -> bool:
        if self.closed_by_reader:
            return False
        try:
            print(json.dumps(record), file=self.file, flush=True)
            return True
        except BrokenPipeError:
            self.closed_by_reader = True
            if self.path is None:
                silence_stdout()
            return False
        except OSError as e:
            self.failed = True
            if self.path is None:
                silence_stdout()
            raise cannot_write(self.where, e) from None

    def close(self) -> None:
        if not self.path:
            return
        try:
            self.file.close()
        except OSError as e:
            if not self.failed:  # already said by write()
                raise cannot_write(self.where, e) from None
