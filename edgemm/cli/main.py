"""The `edgemm` command line: the command group, and the commands that hand over to a module
of their own (serve → edgemm.server.daemon, status, doctor). infer, stream and engines are
edgemm/cli/infer.py, stream.py and engines.py; what they write and how they fail, output.py.

Exit codes (every command): 0 ok · 2 bad input, usage, config or model folder, a
result that cannot be written (full disk) (one-line message, no traceback) · 1 internal error · 3 `edgemm doctor` found a
failing check. EDGEMM_DEBUG=1 adds tracebacks (and, for infer, stream and serve,
the image and video libraries' own messages, which are otherwise dropped).
"""
from __future__ import annotations

import json
import logging
import sys

import click

from edgemm.cli.engines import engines
from edgemm.cli.infer import infer
from edgemm.cli.options import PRECISION_CHOICE, PRECISION_HELP, build_config, quiet_libraries
from edgemm.cli.output import echo_result, fail, keep_closed_descriptor, reports_errors
from edgemm.cli.stream import stream


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
    for fd, standard in ((1, sys.stdout), (2, sys.stderr)):
        if standard is None:  # started with it closed: the next file opened (an --out, a model) would get it
            keep_closed_descriptor(fd)
    log = logging.getLogger("edgemm")
    if not any(isinstance(h, StderrHandler) for h in log.handlers):
        log.addHandler(StderrHandler(logging.WARNING))
        log.propagate = False


main.add_command(infer)
main.add_command(stream)
main.add_command(engines)


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
