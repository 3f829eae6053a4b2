"""`edgemm stream SOURCE`: every frame of a camera, video or folder answered, one JSON
line each (--out), optionally drawn on the frames (--view), until the source ends or a signal."""
from __future__ import annotations

import contextlib
import json
import math

import click

from edgemm.cli.options import (DEFAULT_PROMPT, GENERATION_FLAGS, PRECISION_CHOICE, PRECISION_HELP, build_config,
                                quiet_libraries)
from edgemm.cli.output import JsonLines, reports_errors, say, to_stderr
from edgemm.util.generation_limits import MAX_NEW_TOKENS, check_generation, check_text


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


@click.command()
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
