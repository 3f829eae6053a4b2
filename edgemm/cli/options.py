"""What several `edgemm` commands share: their common options and the config they build
from the config file with the command line on top.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import click

from edgemm.errors import InputError
from edgemm.model.manifest_types import AUTO, PRECISIONS

if TYPE_CHECKING:  # imported where it is used: importing edgemm.config takes longer than `edgemm --help`
    from edgemm.config import Config

PRECISION_CHOICE = click.Choice([AUTO, *PRECISIONS])
PRECISION_HELP = ("Graph variant to load, by its file suffix (default: model.precision, auto: the fastest "
                  "present for each device; docs/models.md, 'Precisions').")

DEFAULT_PROMPT = "describe the image"
# the generation options' flags; their values are checked by edgemm.util.generation_limits, so the
# limits and messages are the config's and the API's (click only parses the type)
GENERATION_FLAGS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_p": "--top-p",
                    "seed": "--seed", "num_beams": "--beams", "beam_gate": "--beam-gate"}


def quiet_libraries() -> None:
    """libpng's, libjpeg's, OpenCV's and FFmpeg's own lines off stderr (edgemm.util.library_noise)."""
    from edgemm.util.library_noise import quiet_libraries as quiet
    quiet()


def build_config(config_path: str | None, model_dir: str | None = None, precision: str | None = None,
                 threads: int | None = None) -> Config:
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


def model_label(cfg: Config) -> str:
    """The model folder's name, for progress lines (before the model is read)."""
    from pathlib import Path

    from edgemm.engine.runtime import default_model_dir
    return (Path(cfg.model.path) if cfg.model.path else default_model_dir()).name + f" ({cfg.model.precision})"
