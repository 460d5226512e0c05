"""Decode with selfspec: `python infer.py --help`. Subcommands: `python infer.py bench ...`, `costs ...`, `sweep-exit ...`
(exit layers for early exit), `search-skip ...` (layers to skip).

The logic lives in selfspec.tools.cli (importable and tested); this file only runs it.
"""

import sys

from selfspec.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
