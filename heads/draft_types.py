"""The drafts a checkpoint directory can hold, by the draft_type its config.json names, and publishing any of them.

Each kind's module class reads its checkpoint strictly and writes its model card (``DraftCheckpoint``,
heads/checkpoints/draft.py); a layer-skip config ("layerskip", selfspec.drafts.layerskip) has no weights: config.json
and its card. ``push_folder`` publishes a saved directory in one Hub commit (heads/checkpoints/hub.py), after the
same strict check; ``python -m heads.publish`` is its command. A distilled draft model (heads/draft_model, a
transformers directory) is published whole, its card naming the repo.
"""

from __future__ import annotations

from pathlib import Path

from heads.block.dflash import DFlashHead
from heads.block.model import BlockHead
from heads.checkpoints.contents import describe, stored_draft_type
from heads.checkpoints.draft import DraftCheckpoint
from heads.checkpoints.files import CARD, CONFIG, WEIGHTS
from heads.checkpoints.hub import Published, check_repo_id, publish
from heads.draft_model.save import draft_model_files
from heads.eagle.eagle3 import Eagle3Head
from heads.eagle.model import EagleHead
from heads.exit_head.model import ExitHead
from heads.hydra.model import HydraHeads
from heads.medusa.model import MedusaHeads
from selfspec.drafts.layerskip import LayerSkipConfig, layerskip_card

MODULES: tuple[type[DraftCheckpoint], ...] = (MedusaHeads, ExitHead, EagleHead, HydraHeads, BlockHead, Eagle3Head,
                                              DFlashHead)
"""every module class a checkpoint with weights is read by; each declares its draft_type or speculators type and what
it can be turned into (``DraftCheckpoint``)."""
DRAFT_TYPES: dict[str, type[DraftCheckpoint]] = {cls.DRAFT_TYPE: cls for cls in MODULES if cls.DRAFT_TYPE}
"""draft_type -> the module class that reads, loads and cards checkpoints of that kind (those with weights)."""
SPECULATORS_TYPES: dict[str, type[DraftCheckpoint]] = {cls.SPECULATORS_TYPE: cls for cls in MODULES
                                                       if cls.SPECULATORS_TYPE}
"""speculators_model_type -> the module class that reads, writes and cards such a speculators draft."""
SPECULATORS: dict[str, type[DraftCheckpoint]] = {f"a speculators {t} checkpoint": cls
                                                 for t, cls in SPECULATORS_TYPES.items()}
"""speculators checkpoints (no draft_type), as ``describe`` names them -> the module class that reads and cards them."""


def publish_files(directory: Path, repo_id: str) -> dict[str, Path | bytes]:
    """What a publish of ``directory`` to ``repo_id`` uploads: config.json and model.safetensors as saved (after a
    strict check), and README.md generated from config.json for ``repo_id`` (so its usage snippet names the repo).
    Medusa heads, exit heads (draft_type "exit-head"), EAGLE heads ("eagle"), Hydra heads ("hydra") and block
    drafters ("block") alike, and EAGLE-3 and DFlash drafts in the speculators format (train.py ``method: eagle3`` /
    ``dflash``, ``python -m heads.export --format speculators``); a layer-skip config ("layerskip") has no weights: config.json and its card."""
    kind = stored_draft_type(directory)
    if kind == "layerskip":  # a searched skip set: config.json alone (the target's own layers draft), read strictly
        return {CONFIG: directory / CONFIG, CARD: layerskip_card(LayerSkipConfig.load(directory), repo_id).encode()}
    if kind is None and describe(directory) in SPECULATORS:  # train.py method eagle3 / dflash, heads.export
        cls = SPECULATORS[describe(directory)]
        config, _ = cls.read_checkpoint(directory)
        return {CONFIG: directory / CONFIG, WEIGHTS: directory / WEIGHTS, CARD: cls.card_for(config, repo_id).encode()}
    if kind is None and describe(directory) == "a selfspec draft model":  # train.py method draft_model
        return draft_model_files(directory, repo_id)
    if kind not in DRAFT_TYPES:
        why = ": a policy names its arms by local paths, publish those instead" if kind == "policy" else ""
        raise ValueError(f"{directory} holds {describe(directory)}; heads.publish publishes selfspec checkpoints of "
                         f"Medusa, Hydra, EAGLE and exit heads, block drafters and layer-skip configs (config.json "
                         f"with draft_type {', '.join([*DRAFT_TYPES, 'layerskip'])}) and draft models (a "
                         f"transformers directory whose config.json names selfspec_target){why}")
    cls = DRAFT_TYPES[kind]
    config, _ = cls.read_checkpoint(directory)  # read strictly (config against tensors), then carded for the repo
    return {CONFIG: directory / CONFIG, WEIGHTS: directory / WEIGHTS, CARD: cls.card_for(config, repo_id).encode()}


def push_folder(
    directory: str | Path, repo_id: str, private: bool = False, revision: str | None = None, token: str | None = None,
    dry_run: bool = False, commit_message: str = "Upload a draft checkpoint (selfspec)", endpoint: str | None = None,
) -> list[str] | Published:
    """Publish a saved checkpoint directory to the Hub in one commit (heads.checkpoints.hub.publish: all files or none).

    dry_run: check the checkpoint and the repo id, return the files that would be uploaded; nothing is sent.
    Otherwise a ``Published`` record; any failure raises ``heads.checkpoints.hub.PublishError`` saying what the repo
    holds now. The token comes from ``token`` or the usual places (HF_TOKEN, ``hf auth login``); ``endpoint`` defaults
    to HF_ENDPOINT / huggingface.co.
    """
    check_repo_id(repo_id)
    files = publish_files(Path(directory).expanduser(), repo_id)
    if dry_run:
        return list(files)
    return publish(files, repo_id, private=private, revision=revision, token=token, commit_message=commit_message,
                   endpoint=endpoint)
