"""Decode with selfspec: `python infer.py --help`. Subcommands: `python infer.py bench ...`, `python infer.py costs ...`.

The logic lives in selfspec.cli (importable and tested); this file only runs it.
"""

import sys

from selfspec.cli import main

if __name__ == "__main__":
    sys.exit(main())
