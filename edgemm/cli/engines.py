"""`edgemm engines build`: TensorRT engines for a model, built on the Jetson that runs them."""
from __future__ import annotations

import click

from edgemm.cli.output import echo_result, reports_errors
from edgemm.errors import EngineError
from edgemm.util.generation_limits import MAX_BEAMS


@click.group()
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
