#!/usr/bin/env python3
"""Build TensorRT engines for a model folder, on the Jetson that will run them.

    python tools/build_engines.py models/tiny-vlm --out /var/lib/edgemm/engines/tiny-vlm --device gpu --precision int8
    python tools/build_engines.py models/tiny-vlm --device dla0 --precision int8 --tiers low,mid,high
    python tools/build_engines.py MODEL_DIR [--device gpu|dla0|dla1] [--precision int8|fp16]
        [--tiers …] [--components …] [--timing-cache FILE] [--max-batch N] [--max-beams N]

The same command as `edgemm engines build` (edgemm/backends/tensorrt/build.py does the work):
same options, one-line errors, exit codes 0 / 1 / 2.
"""
from __future__ import annotations

import sys

from edgemm.cli.main import main

if __name__ == "__main__":
    main(["engines", "build", *sys.argv[1:]], prog_name="build_engines.py")
