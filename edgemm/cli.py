"""The `edgemm` command line.

Exit codes (every command): 0 ok · 2 bad input, usage, config or model folder
(one-line message, no traceback) · 1 internal error · 3 `edgemm doctor` found a
failing check. EDGEMM_DEBUG=1 adds tracebacks.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import sys
import traceback

import click

from edgemm.errors import EdgemmError, InputError, internal_message
from edgemm.generation_limits import MAX_BEAMS, MAX_NEW_TOKENS, MIN_TEMPERATURE, check_generation

DEFAULT_PROMPT = "describe the image"
# the generation options' flags; their values are checked by edgemm.generation_limits, so the
# limits and messages are the config's and the API's (click only parses the type)
GENERATION_FLAGS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_p": "--top-p",
                    "seed": "--seed", "num_beams": "--beams", "beam_gate": "--beam-gate"}


def fail(message: str, code: int) -> None:
    click.echo(f"edgemm: error: {message}", err=True)
    sys.exit(code)


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
    data = config_to_dict(load_config(config_path))
    for section, key, value in (("model", "path", model_dir), ("model", "precision", precision),
                                ("backend", "intra_op_threads", threads)):
        if value is not None:
            data[section][key] = value
    return config_from_dict(data)


def read_image_arg(image: str, max_bytes: int):
    """`-` reads stdin (bounded); anything else is a path."""
    if image != "-":
        return image
    data = sys.stdin.buffer.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise InputError(f"image on stdin is larger than {max_bytes} bytes (limits.max_image_bytes)")
    return data


class EdgemmGroup(click.Group):
    """Usage errors as one line (`edgemm: error: …`, exit 2), like every other error."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
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
    log = logging.getLogger("edgemm")
    if not any(isinstance(h, StderrHandler) for h in log.handlers):
        log.addHandler(StderrHandler(logging.WARNING))
        log.propagate = False


@main.command()
@click.argument("image")
@click.option("--prompt", "-p", default=DEFAULT_PROMPT, show_default=True, help="Question about the image.")
@click.option("--tier", help="Pin the resolution tier (default: the scheduler picks; see --scheduler).")
@click.option("--scheduler", type=click.Choice(["top", "thresholds", "calibrated"]),
              help="Tier policy when no tier is pinned (default: scheduler.policy, top).")
@click.option("--beams", type=int, help=f"Beam search width, 1..{MAX_BEAMS} (1 = greedy).")
@click.option("--beam-gate", type=float,
              help="Collapse beams once the best next token is this likely (0 = greedy, 1 = plain beams).")
@click.option("--precision", type=click.Choice(["fp32", "int8", "fp16"]), help="Graph variant to load.")
@click.option("--model", "model_dir", type=click.Path(), help="Model folder (default: built-in tiny-vlm).")
@click.option("--config", "config_path", type=click.Path(), envvar="EDGEMM_CONFIG",
              help="YAML config file.")
@click.option("--json", "as_json", is_flag=True, help="Print the answer with timings and metadata as JSON.")
@click.option("--max-new-tokens", type=int, help=f"Most tokens in the answer, 1..{MAX_NEW_TOKENS}.")
@click.option("--temperature", type=float, help=f"0 = greedy; sampling needs at least {MIN_TEMPERATURE:g}.")
@click.option("--top-p", type=float, help="Nucleus sampling mass, in (0, 1].")
@click.option("--seed", type=int, help="Sampling seed, 0..2**64-1.")
@click.option("--threads", type=click.IntRange(0), help="Intra-op threads (0 = onnxruntime decides).")
@reports_errors
def infer(image, prompt, tier, scheduler, beams, beam_gate, precision, model_dir, config_path, as_json,
          max_new_tokens, temperature, top_p, seed, threads) -> None:
    """Answer PROMPT about IMAGE (a file, or - for stdin)."""
    check_generation(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                     num_beams=beams, beam_gate=beam_gate, names=GENERATION_FLAGS)  # before the model loads
    from edgemm.runtime import Runtime
    cfg = build_config(config_path, model_dir, precision, threads)
    if scheduler is not None:
        cfg.scheduler.policy = scheduler  # a click.Choice, so already valid
    source = read_image_arg(image, cfg.limits.max_image_bytes)
    runtime = Runtime(cfg)
    result = runtime.infer(source, prompt, tier=tier, max_new_tokens=max_new_tokens,
                           temperature=temperature, top_p=top_p, seed=seed,
                           num_beams=beams, beam_gate=beam_gate)
    if as_json:
        click.echo(json.dumps({"answer": result.text, "prompt": prompt,
                               "image": image if image != "-" else "<stdin>", **result.to_dict()}))
    else:
        click.echo(result.text)


@main.command()
@click.argument("source_uri", metavar="SOURCE")
@click.option("--prompt", "-p", default=DEFAULT_PROMPT, show_default=True)
@click.option("--fps", type=click.FloatRange(0, min_open=True), help="Process at most F frames per second.")
@click.option("--every", type=click.IntRange(1), default=1, show_default=True, help="Process every Nth frame.")
@click.option("--max-frames", type=click.IntRange(1), help="Stop after N processed frames.")
@click.option("--out", type=click.Path(dir_okay=False, writable=True), help="Write JSON lines here (default stdout).")
@click.option("--change-threshold", type=click.FloatRange(0),
              help="Reuse the last answer when a frame differs by less than this (mean abs pixel change, 0-255).")
@click.option("--tier", help="Resolution tier for every frame.")
@click.option("--precision", type=click.Choice(["fp32", "int8", "fp16"]))
@click.option("--model", "model_dir", type=click.Path())
@click.option("--config", "config_path", type=click.Path(), envvar="EDGEMM_CONFIG")
@click.option("--max-new-tokens", type=int, help=f"Most tokens per answer, 1..{MAX_NEW_TOKENS}.")
@click.option("--latency", "latency_ms", type=click.IntRange(0), default=200, show_default=True,
              help="RTSP jitter buffer in ms.")
@reports_errors
def stream(source_uri, prompt, fps, every, max_frames, out, change_threshold, tier, precision,
           model_dir, config_path, max_new_tokens, latency_ms) -> None:
    """Answer PROMPT about every frame of SOURCE, one JSON object per line.

    SOURCE: csi://0, v4l2:///dev/video0, rtsp://host/path, a video file, an image,
    a folder or glob of images, or synthetic://?fps=10. Ctrl-C / SIGTERM stop it
    after the frames in flight are answered; a summary goes to stderr.
    """
    check_generation(max_new_tokens=max_new_tokens, names=GENERATION_FLAGS)
    import signal
    import threading

    from edgemm.pipeline import Pipeline
    from edgemm.runtime import Runtime
    from edgemm.sources import open_source
    from edgemm.stream import StreamOptions, run_stream

    cfg = build_config(config_path, model_dir, precision)
    source = open_source(source_uri, latency_ms=latency_ms, max_pixels=cfg.limits.max_pixels)
    source.open()  # a missing camera or file is reported before the model loads
    runtime = Runtime(cfg, concurrent=True)
    generation = {k: v for k, v in (("tier", tier), ("max_new_tokens", max_new_tokens)) if v is not None}
    options = StreamOptions(prompt=prompt, every=every, fps=fps, max_frames=max_frames,
                            change_threshold=change_threshold, generation=generation)
    stop = threading.Event()

    def on_signal(signum, _frame) -> None:
        stop.set()  # the reader stops taking frames; those in flight are still answered
        click.echo(f"edgemm: {signal.Signals(signum).name}: finishing frames in flight …", err=True)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    sink = open(out, "w", buffering=1) if out else sys.stdout
    # alone in this process: a pipeline of its own, with room for the stream's share
    pipeline = Pipeline(runtime, queue_size=options.share(source.live))
    try:
        summary = run_stream(pipeline, source, options,
                             lambda record: print(json.dumps(record), file=sink, flush=True), stop)
    finally:
        pipeline.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if out:
            sink.close()
    click.echo("edgemm: summary: " + json.dumps(summary.to_dict()), err=True)


@main.command()
@click.option("--config", "config_path", type=click.Path(), envvar="EDGEMM_CONFIG",
              help="YAML config file (under systemd: /etc/edgemm/edgemm.yaml).")
@click.option("--socket", "socket_path", type=click.Path(dir_okay=False),
              help="UNIX socket path (default: server.socket, /run/edgemm/edgemm.sock).")
@click.option("--precision", type=click.Choice(["fp32", "int8", "fp16"]))
@click.option("--model", "model_dir", type=click.Path())
@click.option("--threads", type=click.IntRange(0), help="Intra-op threads (0 = onnxruntime decides).")
@reports_errors
def serve(config_path, socket_path, precision, model_dir, threads) -> None:
    """Serve the OpenAI-compatible HTTP API on a UNIX socket until SIGTERM.

    Loads and warms up the model once, then answers POST /v1/chat/completions,
    POST /v1/infer, GET /v1/models, /v1/streams, /healthz, /readyz and /metrics,
    and runs the camera streams of the config. Under systemd it reports READY=1
    and watchdog pings, and takes a socket-activated socket.
    SIGTERM (or Ctrl-C) stops accepting, lets requests in flight finish, exits 0.
    """
    from edgemm.daemon import serve as run_daemon
    cfg = build_config(config_path, model_dir, precision, threads)
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
              help="Engine folder (default: engines/<model name> in edgemm's source tree, where model.engines: null looks).")
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
@reports_errors
def engines_build(model_dir, out, device, precision, tiers, components, timing_cache, max_batch, max_beams) -> None:
    """Build TensorRT engines for the model in MODEL_DIR and write manifest.yaml next to them.

    Same as tools/build_engines.py. DLA plans (AGX Orin, Orin NX) are one per tier.
    """
    from pathlib import Path

    from edgemm.engines.build import BuildRequest, build_engines
    from edgemm.model.manifest import load_manifest
    from edgemm.runtime import default_engines_dir
    model = load_manifest(model_dir)
    request = BuildRequest(model_dir=Path(model_dir), out=Path(out) if out else default_engines_dir(model.name),
                           device=device, precision=precision, tiers=tiers, components=components,
                           timing_cache=Path(timing_cache) if timing_cache else None,
                           max_batch=max_batch, max_beams=max_beams)
    built = build_engines(request, model)
    total = sum(e.build_seconds for e in built)
    click.echo(f"{len(built)} engine(s) in {request.out} ({total:.1f} s); manifest: {request.out / 'manifest.yaml'}")


@main.command()
@click.option("--config", "config_path", type=click.Path(), envvar="EDGEMM_CONFIG", help="YAML config file.")
@click.option("--socket", "socket_path", type=click.Path(dir_okay=False),
              help="The daemon's socket (default: server.socket).")
@click.option("--root", type=click.Path(file_okay=False), help="Read telemetry under this folder (default: power.root, /).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (the daemon's GET /v1/status).")
@reports_errors
def status(config_path, socket_path, root, as_json) -> None:
    """Telemetry now, the placement the policy would choose and why, loaded components,
    offload state, cache and queue figures. Asks the daemon when it runs; otherwise shows
    what this machine reads now (no components, cache or queues then)."""
    from edgemm.status import collect, render
    cfg = build_config(config_path)
    if root is not None:
        cfg.power.root = root
    report = collect(cfg, socket_path)
    click.echo(json.dumps(report) if as_json else "\n".join(render(report)))


@main.command()
@click.option("--config", "config_path", type=click.Path(), envvar="EDGEMM_CONFIG", help="YAML config file.")
@click.option("--root", type=click.Path(file_okay=False),
              help="Look for telemetry, cameras and CUDA under this folder (default: power.root, /).")
@click.option("--engines", "engines_dir", type=click.Path(file_okay=False),
              help="Built engines folder (default: $EDGEMM_ENGINES, /var/lib/edgemm/engines for root, "
                   "else ~/.cache/edgemm/engines).")
@click.option("--json", "as_json", is_flag=True, help="Print the checks as a JSON list.")
@reports_errors
def doctor(config_path, root, engines_dir, as_json) -> None:
    """Check what this machine can do for edgemm: TensorRT, DLA, CUDA, pycuda, OpenCV's
    GStreamer, cameras, the socket directory, engines and telemetry files. One line each:
    ok, warn (not needed by this config) or fail (needed). Exit code 3 when any check fails."""
    from pathlib import Path

    from edgemm.doctor import FAILED_EXIT_CODE, run_checks
    from edgemm.loading import default_engines_root
    cfg = build_config(config_path)
    if root is not None:
        cfg.power.root = root
    engines = Path(engines_dir) if engines_dir else default_engines_root()
    checks = run_checks(cfg, engines)
    click.echo(json.dumps([c.to_dict() for c in checks]) if as_json else "\n".join(c.line() for c in checks))
    if any(c.level == "fail" for c in checks):
        click.get_current_context().exit(FAILED_EXIT_CODE)


if __name__ == "__main__":
    main()
