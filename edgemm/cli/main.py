"""The `edgemm` command line.

Exit codes (every command): 0 ok · 2 bad input, usage, config or model folder, a
result that cannot be written (full disk) (one-line message, no traceback) · 1 internal error · 3 `edgemm doctor` found a
failing check. EDGEMM_DEBUG=1 adds tracebacks (and, for infer, stream and serve,
the image and video libraries' own messages, which are otherwise dropped).
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

import click

from edgemm.errors import EdgemmError, EngineError, InputError, internal_message
from edgemm.util.generation_limits import MAX_BEAMS, MAX_NEW_TOKENS, MIN_TEMPERATURE, check_generation, check_text
from edgemm.model.manifest_types import AUTO, PRECISIONS

PRECISION_CHOICE = click.Choice([AUTO, *PRECISIONS])
PRECISION_HELP = ("Graph variant to load, by its file suffix (default: model.precision, auto: the fastest "
                  "present for each device; README 'Precisions').")

DEFAULT_PROMPT = "describe the image"
# the generation options' flags; their values are checked by edgemm.util.generation_limits, so the
# limits and messages are the config's and the API's (click only parses the type)
GENERATION_FLAGS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_p": "--top-p",
                    "seed": "--seed", "num_beams": "--beams", "beam_gate": "--beam-gate"}


def within_a_streams_bounds(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """`edgemm stream`'s --every, --fps and --change-threshold: a finite number within what a
    stream of the daemon's config and API may have (edgemm.config's bounds, imported only
    here: importing edgemm.config takes longer than `edgemm --help` itself). click's
    FloatRange lets NaN through, every comparison with it being false."""
    if value is None:
        return None
    from edgemm.config import MAX_ALERT_RUN, MAX_CHANGE_THRESHOLD, MAX_FPS, MIN_FPS
    low, high = {"every": (1, MAX_ALERT_RUN), "fps": (MIN_FPS, MAX_FPS),
                 "change_threshold": (0, MAX_CHANGE_THRESHOLD)}[param.name]
    if not (math.isfinite(value) and low <= value <= high):
        raise click.BadParameter(f"{value!r} is not in {low:g}..{high:g}" if math.isfinite(value)
                                 else f"{value} is not a finite number")
    return value


def quiet_libraries() -> None:
    """libpng's, libjpeg's, OpenCV's and FFmpeg's own lines off stderr (edgemm.util.library_noise)."""
    from edgemm.util.library_noise import quiet_libraries as quiet
    quiet()


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


def reports_errors(fn):
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


def build_config(config_path, model_dir=None, precision=None, threads=None):
    """The config file (or defaults) with command-line options on top, validated as one."""
    from edgemm.config import config_from_dict, config_to_dict, load_config
    if threads:
        from edgemm.engine.loading import usable_cpus
        if threads > usable_cpus():  # more threads than cores only queue up behind each other
            raise InputError(f"--threads {threads} is more than the {usable_cpus()} cores this process "
                             "may use (0 lets edgemm choose)")
    data = config_to_dict(load_config(config_path))
    for section, key, value in (("model", "path", model_dir), ("model", "precision", precision),
                                ("backend", "intra_op_threads", threads)):
        if value is not None:
            data[section][key] = value
    return config_from_dict(data)


def read_image_arg(image: str, limits):
    """The decoded image: `-` reads stdin (bounded), anything else is a path (a regular
    file only). Decoded here, before the model loads, so a bad image costs no load.
    `limits` is the config's LimitsConfig."""
    from edgemm.model.image import load_image
    max_bytes = limits.max_image_bytes
    bounds = {"max_pixels": limits.max_pixels, "max_decoded_bytes": limits.max_decoded_bytes}
    if image != "-":
        return load_image(image, max_bytes=max_bytes, **bounds)
    data = sys.stdin.buffer.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise InputError(f"image on stdin is larger than {max_bytes} bytes (limits.max_image_bytes)")
    return load_image(data, **bounds)


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


def model_label(cfg) -> str:
    """The model folder's name, for progress lines (before the model is read)."""
    from pathlib import Path

    from edgemm.engine.runtime import default_model_dir
    return (Path(cfg.model.path) if cfg.model.path else default_model_dir()).name + f" ({cfg.model.precision})"


class TierOption(click.Option):
    """--tier: its help names the default model's tiers, read only when help is shown."""

    def get_help_record(self, ctx: click.Context):
        try:
            from edgemm.model.manifest import load_manifest
            from edgemm.engine.runtime import default_model_dir
            manifest = load_manifest(default_model_dir())
            tiers = f"{manifest.name} has {', '.join(manifest.tiers)}; "
        except Exception:  # no readable default model: the help is still shown
            tiers = ""
        self.help = (f"Pin the resolution tier ({tiers}a wrong name lists the --model's own). "
                     "Default: the scheduler picks (see --scheduler).")
        return super().get_help_record(ctx)


class EdgemmGroup(click.Group):
    """Usage errors as one line (`edgemm: error: …`, exit 2), like every other error."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not (sys.argv[1:] if args is None else args):  # `edgemm` alone: its help, not an error
            with self.make_context(prog_name or "edgemm", ["--help"], resilient_parsing=True) as ctx:
                click.echo(self.get_help(ctx))
            if standalone_mode:
                sys.exit(0)
            return 0
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.UsageError as e:
            where = f" (see '{e.ctx.command_path} --help')" if e.ctx else ""
            fail(e.format_message() + where, 2)
        except click.Abort:
            fail("aborted", 130)
        except click.ClickException as e:
            fail(e.format_message(), e.exit_code)
        if standalone_mode:
            sys.exit(rv if isinstance(rv, int) else 0)
        return rv


class StderrHandler(logging.Handler):
    """Log lines to whatever stderr is now (click's test runner swaps it)."""

    def emit(self, record: logging.LogRecord) -> None:
        click.echo(f"edgemm: {record.levelname.lower()}: {record.getMessage()}", err=True)


@click.group(cls=EdgemmGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="edgemm")
def main() -> None:
    """edgemm: vision-language inference on NVIDIA Jetson (and anywhere ONNX Runtime runs)."""
    for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
        if stream is None:  # started with it closed: the next file opened (an --out, a model) would get it
            keep_closed_descriptor(fd)
    log = logging.getLogger("edgemm")
    if not any(isinstance(h, StderrHandler) for h in log.handlers):
        log.addHandler(StderrHandler(logging.WARNING))
        log.propagate = False


@main.command()
@click.argument("image")
@click.option("--prompt", "-p", default=DEFAULT_PROMPT, show_default=True, help="Question about the image.")
@click.option("--tier", cls=TierOption)
@click.option("--scheduler", type=click.Choice(["auto", "top", "thresholds", "calibrated"]),
              help="Tier policy when no tier is pinned (default: scheduler.policy, auto: calibrated when "
                   "the model folder ships scheduler.yaml, else top).")
@click.option("--beams", type=int, help=f"Beam search width, 1..{MAX_BEAMS} (1 = greedy).")
@click.option("--beam-gate", type=float,
              help="Collapse beams once the best next token is this likely (0 = greedy, 1 = plain beams).")
@click.option("--precision", type=PRECISION_CHOICE, help=PRECISION_HELP)
@click.option("--model", "model_dir", type=click.Path(), help="Model folder (default: built-in tiny-vlm).")
@click.option("--config", "config_path", type=click.Path(), envvar="EDGEMM_CONFIG",
              help="YAML config file.")
@click.option("--json", "as_json", is_flag=True, help="Print the answer with timings and metadata as JSON.")
@click.option("--max-new-tokens", type=int,
              help=f"Most tokens in the answer, 1..{MAX_NEW_TOKENS} (default: generation.max_new_tokens, 32).")
@click.option("--temperature", type=float,
              help=f"0 = greedy (the default); sampling needs at least {MIN_TEMPERATURE:g}.")
@click.option("--top-p", type=float,
              help="Sampling keeps the most likely tokens whose probabilities add up to this, in (0, 1] "
                   "(default: generation.top_p, 1 = all).")
@click.option("--seed", type=int,
              help="Sampling seed, 0..2**64-1: the same seed gives the same answer (default: random).")
@click.option("--threads", type=click.IntRange(0), help="Intra-op threads (0 = onnxruntime decides).")
@click.option("--quiet", "-q", is_flag=True, help="No progress line on stderr (warnings and errors still).")
@reports_errors
def infer(image, prompt, tier, scheduler, beams, beam_gate, precision, model_dir, config_path, as_json,
          max_new_tokens, temperature, top_p, seed, threads, quiet) -> None:
    """Answer PROMPT about IMAGE (a file, or - for stdin).

    Loads the model, answers, exits; no warm-up: the answer is the graphs' first run. A prompt with
    words the model does not know is answered with a warning (stderr; `warnings` in --json),
    or refused with limits.unknown_words: refuse."""
    quiet_libraries()
    check_generation(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                     num_beams=beams, beam_gate=beam_gate, names=GENERATION_FLAGS)  # before the model loads
    check_text(prompt, "--prompt")  # a NUL or undecodable bytes: exit 2, not the tokenizer's error
    standard_output()  # closed (`>&-`): said before the model loads, not after the answer
    from edgemm.engine.runtime import Runtime
    cfg = build_config(config_path, model_dir, precision, threads)
    if scheduler is not None:
        cfg.scheduler.policy = scheduler  # a click.Choice, so already valid
    source = read_image_arg(image, cfg.limits)
    with progress(model_label(cfg), quiet) as notes:
        # a warm-up would answer twice: the answer's own first run is all the warming it needs
        runtime = Runtime(cfg, warm_up=False)
        if cfg.model.precision == "auto":  # which variant auto took
            notes.append(runtime.models.precision)
        started = time.perf_counter()
        request = runtime.prepare(source, prompt, tier=tier, max_new_tokens=max_new_tokens,
                                  temperature=temperature, top_p=top_p, seed=seed,
                                  num_beams=beams, beam_gate=beam_gate)
    result = runtime.answer(request, started=started)
    if as_json:
        echo_result(json.dumps({"answer": result.text, "prompt": prompt,
                               "image": image if image != "-" else "<stdin>", **result.to_dict()}))
    else:
        echo_result(result.text)
        for warning in result.warnings:
            to_stderr(f"edgemm: warning: {warning}")


def silence_stdout() -> None:
    """stdout to /dev/null: what is still buffered for it goes nowhere, so the interpreter's
    last flush cannot fail again (a second message, and exit code 120) after the error is said."""
    silence(sys.stdout)


def silence(stream) -> None:
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


def standard_output():
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


@main.command()
@click.argument("source_uri", metavar="SOURCE")
@click.option("--prompt", "-p", default=DEFAULT_PROMPT, show_default=True)
@click.option("--fps", type=float, callback=within_a_streams_bounds,
              help="Process at most F frames per second, 0.001..1000.")
@click.option("--every", type=int, default=1, show_default=True, callback=within_a_streams_bounds,
              help="Process every Nth frame, 1..1000.")
@click.option("--max-frames", type=click.IntRange(1), help="Stop after N processed frames.")
@click.option("--out", type=click.Path(dir_okay=False, writable=True), help="Write JSON lines here (default stdout).")
@click.option("--change-threshold", type=float, callback=within_a_streams_bounds,
              help="Reuse the last answer when a frame differs by less than this (mean abs pixel change, 0-255).")
@click.option("--tier", help="Resolution tier for every frame.")
@click.option("--precision", type=PRECISION_CHOICE, help=PRECISION_HELP)
@click.option("--model", "model_dir", type=click.Path())
@click.option("--config", "config_path", type=click.Path(), envvar="EDGEMM_CONFIG")
@click.option("--max-new-tokens", type=int, help=f"Most tokens per answer, 1..{MAX_NEW_TOKENS}.")
@click.option("--latency", "latency_ms", type=click.IntRange(0), default=200, show_default=True,
              help="RTSP jitter buffer in ms.")
@click.option("--view", "view_out", metavar="OUT",
              help="Draw each answer on the frames and write them to OUT: a .mp4/.avi file, a folder/, "
                   "display://0 or rtp://host:port.")
@reports_errors
def stream(source_uri, prompt, fps, every, max_frames, out, change_threshold, tier, precision,
           model_dir, config_path, max_new_tokens, latency_ms, view_out) -> None:
    """Answer PROMPT about every frame of SOURCE, one JSON object per line.

    SOURCE: csi://0, v4l2:///dev/video0, rtsp://host/path, a video file, an image,
    a folder or glob of images, or synthetic://?fps=10. Ctrl-C / SIGTERM stop it
    after the frames in flight are answered; a summary goes to stderr.
    """
    quiet_libraries()
    check_generation(max_new_tokens=max_new_tokens, names=GENERATION_FLAGS)
    check_text(prompt, "--prompt")
    import signal
    import threading

    from edgemm.engine.pipeline import Pipeline
    from edgemm.engine.runtime import Runtime
    from edgemm.streams.sources import open_source
    from edgemm.streams.run import StreamOptions, run_stream
    from edgemm.streams.view import open_view, parse_view

    if view_out is not None:
        parse_view(view_out)  # a --view that cannot work is said before anything opens
    cfg = build_config(config_path, model_dir, precision)
    # a camera that does not open now is reported (exit 2), not waited for; one that opens
    # and later stops delivering is reopened with backoff
    source = open_source(source_uri, latency_ms=latency_ms, max_pixels=cfg.limits.max_pixels,
                         max_synthetic_pixels=cfg.limits.max_synthetic_pixels,
                         wait_for_camera=False)
    source.open()  # a missing camera or file is reported before the model loads
    sink = JsonLines(out)  # so is an --out that cannot be written
    runtime = Runtime(cfg, concurrent=True, warm_up=False)
    # every tier the stream may use: a pinned one alone (backend.warmup: none warms nothing)
    runtime.warmup([runtime.manifest.tier(tier).name] if tier and runtime.warmup_tiers else runtime.warmup_tiers,
                   report=say)
    generation = {k: v for k, v in (("tier", tier), ("max_new_tokens", max_new_tokens)) if v is not None}
    # the output keeps the source's frame rate: every source frame is written, with the latest answer
    view = open_view(view_out, getattr(source, "fps", 0.0)) if view_out is not None else None
    options = StreamOptions(prompt=prompt, every=every, fps=fps, max_frames=max_frames,
                            change_threshold=change_threshold, generation=generation, view=view)
    stop = threading.Event()

    def on_signal(signum, _frame) -> None:
        stop.set()  # the reader stops taking frames; those in flight are still answered
        with contextlib.suppress(OSError):  # a stderr that cannot take it must not end the stop in a traceback
            click.echo(f"edgemm: {signal.Signals(signum).name}: finishing frames in flight …", err=True)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    # alone in this process: a pipeline of its own, with room for the stream's share
    pipeline = Pipeline(runtime, queue_size=options.share(source.live))

    def emit(record: dict) -> None:
        if not sink.write(record):  # the reader went away (`| head -1`): stop, as Ctrl-C does
            stop.set()

    try:
        summary = run_stream(pipeline, source, options, emit, stop)
    finally:
        pipeline.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        try:
            if view is not None:
                view.close()
        finally:  # closed whatever the view's close raised
            sink.close()
    to_stderr("edgemm: summary: " + json.dumps(summary.to_dict()))


@main.command()
@click.option("--config", "config_path", type=click.Path(), envvar="EDGEMM_CONFIG",
              help="YAML config file (under systemd: /etc/edgemm/edgemm.yaml).")
@click.option("--socket", "socket_path", type=click.Path(dir_okay=False),
              help="UNIX socket path (default: server.socket, else /run/edgemm/edgemm.sock where systemd "
                   "made /run/edgemm, else $XDG_RUNTIME_DIR/edgemm.sock; none with --port).")
@click.option("--port", type=click.IntRange(0, 65535),
              help="Serve HTTP on this TCP port (0 = any free one), as well as the socket when one is named, else TCP only (server.tcp_port).")
@click.option("--host", help="TCP address for --port (default: server.tcp_host, 127.0.0.1: loopback only).")
@click.option("--precision", type=PRECISION_CHOICE, help=PRECISION_HELP)
@click.option("--model", "model_dir", type=click.Path())
@click.option("--threads", type=click.IntRange(0), help="Intra-op threads (0 = onnxruntime decides).")
@reports_errors
def serve(config_path, socket_path, port, host, precision, model_dir, threads) -> None:
    """Serve the OpenAI-compatible HTTP API on a UNIX socket (or --port) until SIGTERM.

    Loads and warms up the model once, then answers POST /v1/chat/completions,
    POST /v1/infer, GET /v1/models, /v1/streams, /healthz, /readyz and /metrics,
    and runs the camera streams of the config. Under systemd it reports READY=1
    and watchdog pings, and takes a socket-activated socket.
    SIGTERM (or Ctrl-C) stops accepting, lets requests in flight finish, exits 0.
    """
    if host is not None and port is None:
        raise click.UsageError("--host needs --port (the TCP port to listen on)")
    quiet_libraries()
    from edgemm.server.daemon import serve as run_daemon
    cfg = build_config(config_path, model_dir, precision, threads)
    if port is not None:
        cfg.server.tcp_port = port
    if host is not None:
        cfg.server.tcp_host = host
    log = logging.getLogger("edgemm")
    log.setLevel(logging.INFO)  # a daemon says where it listens and when it drains
    for handler in log.handlers:
        handler.setLevel(logging.INFO)
    run_daemon(cfg, socket_path)


@main.group()
def engines() -> None:
    """TensorRT engines: build them on the Jetson that runs them."""


def _tier_list(_ctx, _param, value):
    return [t.strip() for t in value.split(",") if t.strip()] if value else None


@engines.command("build")
@click.argument("model_dir", type=click.Path(file_okay=False))
@click.option("--out", type=click.Path(file_okay=False),
              help="Engine folder (default: <engines root>/<model name>, where model.engines: null looks; "
                   "the root is $EDGEMM_ENGINES, /var/lib/edgemm/engines for root, else ~/.cache/edgemm/engines).")
@click.option("--device", type=click.Choice(["gpu", "dla0", "dla1"]), default="gpu", show_default=True)
@click.option("--precision", type=click.Choice(["int8", "fp16"]), default="int8", show_default=True)
@click.option("--tiers", callback=_tier_list, help="Comma-separated tiers (default: all of the model's).")
@click.option("--components", callback=_tier_list,
              help="Comma-separated: vision_encoder, embed_tokens, decoder (default: all on gpu, the encoder on a DLA).")
@click.option("--timing-cache", type=click.Path(dir_okay=False), help="Read and update this TensorRT timing cache.")
@click.option("--max-batch", type=click.IntRange(1, 64), default=4, show_default=True,
              help="Most images per encoder call on the GPU (server.max_batch).")
@click.option("--max-beams", type=click.IntRange(1, MAX_BEAMS), default=MAX_BEAMS, show_default=True,
              help="Most decoder rows (generation.num_beams).")
@click.option("--dry-run", is_flag=True, help="Print the plans and their shape profiles; build nothing.")
@click.option("--tensorrt", "tensorrt_version", metavar="VERSION",
              help="With --dry-run: plan for this TensorRT release on a module with two DLA cores, "
                   "without probing this machine.")
@reports_errors
def engines_build(model_dir, out, device, precision, tiers, components, timing_cache, max_batch, max_beams,
                  dry_run, tensorrt_version) -> None:
    """Build TensorRT engines for the model in MODEL_DIR and write manifest.yaml next to them.

    Same as tools/build_engines.py. DLA plans (AGX Orin, Orin NX) are one per tier (a tiled
    family's encoder: one plan that takes a tile at a time).
    """
    from pathlib import Path

    from edgemm.backends.tensorrt.build import BuildRequest, build_engines, describe_jobs, plan_jobs
    from edgemm.backends.tensorrt.platform import Platform, probe
    from edgemm.model.manifest import load_manifest
    from edgemm.engine.runtime import default_engines_dir
    if tensorrt_version and not dry_run:
        raise click.UsageError("--tensorrt is for --dry-run: a real build uses the TensorRT installed here")
    model = load_manifest(model_dir)
    request = BuildRequest(model_dir=Path(model_dir), out=Path(out) if out else default_engines_dir(model.name),
                           device=device, precision=precision, tiers=tiers, components=components,
                           timing_cache=Path(timing_cache) if timing_cache else None,
                           max_batch=max_batch, max_beams=max_beams)
    if dry_run:
        if tensorrt_version:
            platform = Platform(tensorrt=tensorrt_version, gpu="a module with two DLA cores", compute_capability="?",
                                integrated=True, dla_cores=2)
        else:
            try:
                platform = probe()
            except EngineError as e:
                raise EngineError(f"{e}; to plan without it: --dry-run --tensorrt VERSION") from None
        for line in describe_jobs(plan_jobs(request, model, platform), platform.tensorrt):
            echo_result(line)
        return
    built = build_engines(request, model)
    total = sum(e.build_seconds for e in built)
    echo_result(f"{len(built)} engine(s) in {request.out} ({total:.1f} s); manifest: {request.out / 'manifest.yaml'}")


@main.command()
@click.option("--config", "config_path", type=click.Path(), envvar="EDGEMM_CONFIG", help="YAML config file.")
@click.option("--socket", "socket_path", type=click.Path(dir_okay=False),
              help="The daemon's socket (default: server.socket, else the one `edgemm serve` picks).")
@click.option("--root", type=click.Path(file_okay=False), help="Read telemetry under this folder (default: power.root, /).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (the daemon's GET /v1/status).")
@reports_errors
def status(config_path, socket_path, root, as_json) -> None:
    """Telemetry now, the placement the policy would choose and why, loaded components,
    offload state, cache and queue figures. Asks the daemon when it runs; otherwise shows
    what this machine reads now (no components, cache or queues then)."""
    from edgemm.cli.status import collect, render
    cfg = build_config(config_path)
    if root is not None:
        cfg.power.root = root
    report = collect(cfg, socket_path)
    echo_result(json.dumps(report) if as_json else "\n".join(render(report)))


@main.command()
@click.option("--config", "config_path", type=click.Path(), envvar="EDGEMM_CONFIG", help="YAML config file.")
@click.option("--root", type=click.Path(file_okay=False),
              help="Look for telemetry, cameras and CUDA under this folder (default: power.root, /).")
@click.option("--engines", "engines_dir", type=click.Path(file_okay=False),
              help="Built engines folder, with manifest.yaml or one folder per model "
                   "(default: model.engines, else where `edgemm engines build` writes).")
@click.option("--json", "as_json", is_flag=True, help="Print the checks as a JSON list.")
@reports_errors
def doctor(config_path, root, engines_dir, as_json) -> None:
    """Check what this machine can do for edgemm: TensorRT, DLA, CUDA, pycuda, OpenCV's
    GStreamer, cameras, the socket directory, engines and telemetry files. One line each:
    ok, warn (not needed by this config) or fail (needed: a gpu/dla placement needs TensorRT,
    a CUDA device, its DLA core and its engines). Exit code 3 when any check fails."""
    from pathlib import Path

    from edgemm.cli.doctor import FAILED_EXIT_CODE, run_checks
    cfg = build_config(config_path)
    if root is not None:
        cfg.power.root = root
    checks = run_checks(cfg, Path(engines_dir) if engines_dir else None)
    echo_result(json.dumps([c.to_dict() for c in checks]) if as_json else "\n".join(c.line() for c in checks))
    if any(c.level == "fail" for c in checks):
        click.get_current_context().exit(FAILED_EXIT_CODE)


if __name__ == "__main__":
    main()
