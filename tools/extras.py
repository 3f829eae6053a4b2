"""What a tool says when an optional dependency is missing: the extra that installs it, in one
line, exit 2 — not an ImportError's traceback (the runtime's install has no torch)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import NoReturn


def missing_extra(tool: str, extra: str, missing: ImportError, default: str = "torch") -> NoReturn:
    """Exit 2 naming the module `tool` (its __file__) could not import and the extra to install."""
    print(f"error: tools/{Path(tool).name} needs {missing.name or default}, which the {extra} extra installs: "
          f"pip install -e '.[{extra}]'", file=sys.stderr)
    sys.exit(2)
