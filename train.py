"""Train drafts on a frozen causal LM: Medusa heads, Hydra heads, an EAGLE-style head or an early-exit head (method=...).

    python train.py --config configs/medusa_smollm2.yaml [key=value ...]
    accelerate launch [--config_file configs/accelerate/<setup>.yaml] train.py --config ... [key=value ...]
"""

import argparse
import logging
import sys

from heads.checkpoints.hub import PublishError
from heads.training.base_model import UnsupportedModel
from heads.training.data import DataError
from heads.training.recipe import describe, load_config
from heads.training.run_folder import RunFolderError
from heads.training.state import CorruptCheckpoint
from heads.training.trainer import TrainingDiverged, check_publish, train


def main(argv: list[str] | None = None) -> int:
    epilog = "recipe keys (set in the YAML file or as key=value / a.b=value):\n" + "\n".join(describe())
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, epilog=epilog,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="a YAML recipe (configs/*.yaml); without it every key takes its default")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="recipe overrides, e.g. optim.lr=3e-4 data.max_conversations=100")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config, args.overrides)
        check_publish(cfg)
    except (ValueError, FileNotFoundError) as err:
        print(f"error in the recipe: {err}", file=sys.stderr)
        return 2
    try:
        result = train(cfg)
    except TrainingDiverged as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except (UnsupportedModel, DataError, FileNotFoundError, CorruptCheckpoint, RunFolderError) as err:  # one named
        print(f"error: {err}", file=sys.stderr)
        return 2
    except PublishError as err:
        print(f"training finished and the checkpoint is saved, but publishing failed: {err}\n"
              f"retry with: python -m heads.publish {cfg.final_dir} {cfg.publish.repo_id}",
              file=sys.stderr)
        return 1
    return 128 + result.signal if result.status == "interrupted" else 0


if __name__ == "__main__":
    sys.exit(main())
