"""Publish a saved draft checkpoint directory (Medusa, Hydra, EAGLE or exit heads, a layer-skip config) to the Hub.

    python -m heads.publish runs/medusa-smollm2 me/smollm2-medusa-heads [--private] [--revision BRANCH] [--dry-run]

The checkpoint is checked strictly first (config.json against model.safetensors); config.json, model.safetensors (none
for a layer-skip config) and a model card written for the repo go up in one commit, so the repo gets all of them or
none. The token comes from --token, HF_TOKEN, or a saved `hf auth login`; HF_ENDPOINT points at another
Hub-compatible endpoint.
Exit status: 0 published (or dry run), 1 the upload failed, 2 the checkpoint or the arguments are wrong.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from heads.checkpoints.hub import PublishError, check_repo_id, find_token, publish
from heads.draft_types import publish_files


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False,
        prog="python -m heads.publish", description=__doc__.split("\n\n")[0],
        epilog="Prefer HF_TOKEN or `hf auth login` over --token: a token on the command line shows in process lists.",
    )
    parser.add_argument("directory", type=Path, help="a checkpoint directory written by save_pretrained / train.py")
    parser.add_argument("repo_id", help="the Hub repo to publish to: 'owner/name' (created if missing)")
    parser.add_argument("--private", action="store_true",
                        help="create the repo private (refused if it exists and is public)")
    parser.add_argument("--revision", default=None, metavar="BRANCH",
                        help="branch to commit to (created from main); default main")
    parser.add_argument("--token", default=None,
                        help="a Hub token with write access (default: HF_TOKEN or the saved login)")
    parser.add_argument("--message", default="Upload a draft checkpoint (selfspec)", help="the commit message")
    parser.add_argument("--dry-run", action="store_true", help="check everything local, list the files, send nothing")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    branch = args.revision or "main"
    try:
        check_repo_id(args.repo_id)
        files = publish_files(args.directory.expanduser(), args.repo_id)
    except (ValueError, FileNotFoundError, NotADirectoryError) as err:
        print(f"cannot publish {args.directory}: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        _, source = find_token(args.token)
        visibility = "private" if args.private else "public"
        print(f"dry run: would publish to {args.repo_id} (branch {branch}, {visibility}) in one commit:")
        for name, data in files.items():
            size = len(data) if isinstance(data, bytes) else data.stat().st_size
            print(f"  {name}  ({size:,} bytes{', written for the repo' if isinstance(data, bytes) else ''})")
        print(f"token: {source}; nothing was sent")
        return 0
    try:
        published = publish(files, args.repo_id, private=args.private, revision=args.revision, token=args.token,
                            commit_message=args.message)
    except PublishError as err:
        print(f"publish failed: {err}", file=sys.stderr)
        return 1
    what = f"published {len(published.files)} files" if published.changed else "already up to date, no new commit"
    print(f"{what}: {published.repo_id} branch {published.revision} at commit {published.commit[:8]} ({published.url})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
