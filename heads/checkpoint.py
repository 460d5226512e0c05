"""How Medusa heads are stored and shared: a directory (or Hub repo) like PEFT's and huggingface_hub's mixin.

    config.json         every MedusaConfig field, plus "selfspec_version" (draft_type is "medusa")
    model.safetensors   the heads' own weights only (never the base model's), with a sha256 of the tensor bytes
    README.md           the model card: Hub metadata, measured accuracy per head, the tree, a usage snippet

Saving is atomic: files are written to a temporary directory next to the target; a new directory is renamed into
place whole, an existing one gets each file replaced atomically (weights first, config.json last) so other files
there (a git clone of the repo, say) are left alone. Loading is strict: unknown config keys, missing or unexpected
tensors, shapes that disagree with config.json, a corrupt or truncated file, or a base of another size all raise.
Publishing (``push_folder`` / ``push_heads``) checks a checkpoint the same way, then uploads config.json,
model.safetensors and a model card written for the repo in one Hub commit (heads/hub.py).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import json
import os
import shutil
import tempfile
import tomllib
import uuid
from pathlib import Path
from typing import Any, Callable

import torch
from huggingface_hub import ModelCardData, snapshot_download
from huggingface_hub.errors import HFValidationError, HfHubHTTPError, LocalEntryNotFoundError
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import PreTrainedModel

from heads.cli import describe
from heads.hub import Published, check_repo_id, publish
from heads.medusa import MedusaConfig, MedusaHeads, base_sizes
from heads.tree_search import expected_accept_length
from selfspec.core.models import BUILTIN, looks_local
from selfspec.core.files import read_json_object

CONFIG, WEIGHTS, CARD = "config.json", "model.safetensors", "README.md"
FILES = (CONFIG, WEIGHTS, CARD)
HUB_DATASETS = {"sharegpt": "anon8231489123/ShareGPT_Vicuna_unfiltered"}
"""data sources the model card can name as Hub datasets (local files are not named)."""


def selfspec_version() -> str:
    """The installed selfspec's version; from a source checkout that was not installed (code on PYTHONPATH), the
    version in its pyproject.toml marked "+source"."""
    try:
        return importlib.metadata.version("selfspec")
    except importlib.metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        if not pyproject.is_file():
            return "unknown"
        return tomllib.loads(pyproject.read_text())["project"]["version"] + "+source"


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over names and raw bytes of the tensors, in name order (detects bytes changed inside the file)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def expected_shapes(config: MedusaConfig) -> dict[str, tuple[int, ...]]:
    """The tensors (name -> shape) that heads built from ``config`` hold, computed without allocating them."""
    with torch.device("meta"):
        heads = MedusaHeads(config, nn.Linear(config.hidden_size, config.vocab_size, bias=config.lm_head_bias))
    return {name: tuple(t.shape) for name, t in heads.state_dict().items()}


# --------------------------------------------------------------------------------------------------------- save
def save_heads(heads: MedusaHeads, directory: str | Path, repo_id: str | None = None) -> Path:
    """Write config.json, model.safetensors and README.md to ``directory`` atomically; returns the directory."""
    return write_checkpoint(directory, heads.state_dict(), heads.config.to_dict(),
                            model_card(heads.config, repo_id or str(Path(directory).expanduser())))


def write_checkpoint(directory: str | Path, state: dict[str, torch.Tensor], config: dict, card: str) -> Path:
    """Any draft checkpoint: config.json (+ selfspec_version), model.safetensors (with the tensors' sha256) and
    README.md, written to a temporary directory and renamed into place, so a checkpoint is whole or absent."""
    target = Path(directory).expanduser()
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"expected a directory to save the checkpoint into, found a file at {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()  # the default mode (not mkdtemp's 0700): the renamed checkpoint is as readable as any new directory
    try:
        tensors = {name: t.detach().cpu().contiguous() for name, t in state.items()}
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt", "sha256": tensors_sha256(tensors)})
        (tmp / CONFIG).write_text(json.dumps({**config, "selfspec_version": selfspec_version()}, indent=2) + "\n")
        (tmp / CARD).write_text(card)
        if not target.exists():
            os.rename(tmp, target)  # the whole checkpoint appears at once
            return target
        for name in (WEIGHTS, CARD, CONFIG):
            os.replace(tmp / name, target / name)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


class DraftCheckpoint:
    """``save_pretrained`` / ``push_to_hub`` / ``from_pretrained`` for a draft module stored as config.json +
    model.safetensors + README.md (PEFT's and huggingface_hub's mixin surface), for the drafts that store a typed
    config (Hydra heads, an EAGLE head, an exit head). A subclass has ``config`` (with ``to_dict``) and says:

    - ``WHAT``: its name in messages and commit messages ("Hydra heads");
    - ``card(location)``: its README.md;
    - ``read_checkpoint(directory)``: (config, tensors), checked against each other;
    - ``on_base(config, base_model)``: a new module on the base (its embeddings, LM head) before the weights load;
    - ``base_checks(config, base_model)``: (name, trained for, found) sizes beyond hidden and vocabulary size.
    """

    WHAT = "draft"
    READS = "lm_head"
    """the width its config's hidden_size names: of the states the LM head reads, or of the decoder's "layers"
    (``heads.medusa.base_sizes``)."""

    def card(self, location: str) -> str:
        raise NotImplementedError

    @classmethod
    def read_checkpoint(cls, directory: Path) -> tuple[Any, dict[str, torch.Tensor]]:
        raise NotImplementedError

    @classmethod
    def on_base(cls, config: Any, base_model: PreTrainedModel) -> nn.Module:
        raise NotImplementedError

    @classmethod
    def base_checks(cls, config: Any, base_model: PreTrainedModel) -> tuple[tuple[str, int, int], ...]:
        return ()

    def save_pretrained(self, directory: str | Path, repo_id: str | None = None) -> Path:
        """config.json + model.safetensors + README.md, written atomically."""
        return write_checkpoint(directory, self.state_dict(), self.config.to_dict(), self.card(repo_id or str(directory)))

    def push_to_hub(self, repo_id: str, private: bool = False, revision: str | None = None, token: str | None = None,
                    dry_run: bool = False, commit_message: str | None = None) -> Any:
        """Save to a temporary directory and upload it in one commit; dry_run returns the files it would upload."""
        return push_heads(self, repo_id, private=private, revision=revision, token=token, dry_run=dry_run,
                          commit_message=commit_message or f"Upload {self.WHAT} (selfspec)")

    @classmethod
    def from_pretrained(cls, path_or_repo_id: str | Path, base_model: PreTrainedModel, revision: str | None = None):
        """From a local directory or a Hub id, onto ``base_model`` (its device and dtype). Strict; refuses a base of
        another hidden or vocabulary size (or whatever ``base_checks`` names)."""
        directory = resolve(path_or_repo_id, revision)
        config, tensors = cls.read_checkpoint(directory)
        check_base_sizes(config, base_model, path_or_repo_id, cls.WHAT, extra=cls.base_checks(config, base_model),
                         at=cls.READS)
        module = cls.on_base(config, base_model)
        module.load_state_dict(tensors, strict=True)
        weight = base_model.get_output_embeddings().weight
        return module.to(device=weight.device, dtype=weight.dtype).eval()


# --------------------------------------------------------------------------------------------------------- load
def resolve(path_or_repo_id: str | Path, revision: str | None = None, files: tuple[str, ...] = FILES) -> Path:
    """A local checkpoint directory, or a Hub repo fetched through the Hub cache (a second load needs no network).

    files: the file names fetched from a Hub repo (a selfspec heads checkpoint's by default).
    """
    path = Path(path_or_repo_id).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ValueError(f"revision={revision!r} was given but {path} is a local directory: revisions are for Hub ids")
        return path
    if path.exists():
        raise NotADirectoryError(f"expected a checkpoint directory or a Hub repo id, found the file {path}")
    if looks_local(str(path_or_repo_id)):  # a path, not 'owner/name': never looked up on the Hub
        raise FileNotFoundError(f"the directory {path} does not exist: expected a local checkpoint directory "
                                "(or a Hub repo id 'owner/name'); check the path")
    try:
        return Path(snapshot_download(str(path_or_repo_id), revision=revision, allow_patterns=list(files)))
    except (HFValidationError, HfHubHTTPError, LocalEntryNotFoundError) as err:
        raise FileNotFoundError(
            f"{path_or_repo_id!r} is not a local directory and could not be fetched from the Hugging Face Hub "
            f"(revision {revision or 'main'}): {type(err).__name__}: {err}"
        ) from err


def read_config(directory: Path, tool: str = "expected Medusa heads") -> MedusaConfig:
    """The MedusaConfig in ``directory``/config.json. ``tool``: what the caller takes, said when the directory holds
    something else ("heads.export exports Medusa heads")."""
    file = directory / CONFIG
    if not file.is_file():
        raise FileNotFoundError(f"{directory} has no {CONFIG}: it holds {describe(directory)}; {tool} (a selfspec "
                                f"checkpoint: {', '.join(FILES)})")
    data = read_json_object(file, "the heads' config")
    if data.get("draft_type") != "medusa":
        what = describe(directory)
        hint = ": convert it first with python -m heads.import_medusa" if "FasterDecoding" in what else ""
        raise ValueError(f"{directory} holds {what}, not Medusa heads (draft_type 'medusa'); {tool}{hint}")
    data.pop("selfspec_version", None)
    try:
        return MedusaConfig.from_dict(data)
    except ValueError as err:  # the config's own message, naming the file it came from
        raise ValueError(f"{file}: {err}") from err


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    file = directory / WEIGHTS
    if not file.is_file():
        raise FileNotFoundError(f"{directory} has {CONFIG} but no {WEIGHTS}: the checkpoint is incomplete")
    try:
        with safe_open(str(file), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{file} is corrupt or truncated ({err}): save or download the checkpoint again") from err
    stored = metadata.get("sha256")
    if stored is not None and stored != tensors_sha256(tensors):
        raise ValueError(f"{file} is corrupt: its tensors do not match the sha256 stored with them; save or download it again")
    return tensors


def read_typed_checkpoint(directory: Path, draft_type: str, what: str, from_dict: Callable[[dict], Any],
                          build: Callable[[Any], nn.Module],
                          upgrade: Callable[[dict], dict] | None = None) -> tuple[Any, dict[str, torch.Tensor]]:
    """config.json (its draft_type must be ``draft_type``; parsed strictly by ``from_dict``) and model.safetensors,
    whose tensor names and shapes must be those of ``build(config).state_dict()`` (built on the meta device), after
    ``upgrade`` (if given) renamed an older checkpoint's tensors. ``what`` names the draft in messages ("exit head",
    "EAGLE head")."""
    data = read_json_object(directory / CONFIG, f"the {what}'s config")
    if data.get("draft_type") != draft_type:
        raise ValueError(f"{directory / CONFIG} says draft_type {data.get('draft_type')!r}; expected {draft_type!r} "
                         f"(an {what} checkpoint)")
    data.pop("selfspec_version", None)
    try:
        config = from_dict(data)
    except ValueError as err:  # the config's own message, naming the file it came from
        raise ValueError(f"{directory / CONFIG}: {err}") from err
    tensors = read_tensors(directory)
    if upgrade is not None:
        tensors = upgrade(tensors)
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in build(config).state_dict().items()}
    found = {name: tuple(t.shape) for name, t in tensors.items()}
    if found != expected:
        wrong = {k: (expected[k], found[k]) for k in sorted(set(expected) & set(found)) if expected[k] != found[k]}
        raise ValueError(f"{directory / WEIGHTS} disagrees with config.json: missing tensors "
                         f"{sorted(set(expected) - set(found))[:4]}, unexpected {sorted(set(found) - set(expected))[:4]}, "
                         f"wrong shapes (expected, found) {dict(list(wrong.items())[:4])}")
    return config, tensors


def check_base_sizes(config: Any, base_model: PreTrainedModel, location: str | Path, what: str,
                     extra: tuple[tuple[str, int, int], ...] = (), at: str = "lm_head") -> None:
    """Refuse a base whose hidden or vocabulary size (or any (name, trained for, found) in ``extra``) differs from what
    the draft ``config`` was trained for, naming the base it belongs on. ``at``: which width (``base_sizes``)."""
    hidden, vocab = base_sizes(base_model, at=at)
    for name, want, have in (("hidden size", config.hidden_size, hidden), ("vocab size", config.vocab_size, vocab),
                             *extra):
        if want != have:
            raise ValueError(f"the {what} in {location} was trained for {name} {want}, this model has {have}: it "
                             f"belongs on {config.base_model}")


def check_tensors(config: MedusaConfig, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Refuse weights that disagree with config.json: missing, unexpected or wrongly shaped tensors."""
    expected = expected_shapes(config)
    stored_heads = {int(name.split(".")[1]) for name in tensors if name.startswith("heads.") and name.split(".")[1].isdigit()}
    if stored_heads and len(stored_heads) != config.num_heads:
        raise ValueError(f"{where} holds {len(stored_heads)} heads but config.json says num_heads={config.num_heads}")
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{where} disagrees with config.json (num_heads={config.num_heads}, num_layers={config.num_layers}, "
            f"projection={config.projection!r}): missing tensors {missing[:6]}, unexpected tensors {unexpected[:6]}"
        )
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(
                f"{where}: tensor {name} has shape {list(tensors[name].shape)}, config.json implies {list(shape)} "
                f"(hidden_size={config.hidden_size}, vocab_size={config.vocab_size}, lora_rank={config.lora_rank})"
            )


def load_heads(path_or_repo_id: str | Path, base_model: PreTrainedModel, revision: str | None = None) -> MedusaHeads:
    """Heads on ``base_model`` (its LM head, device), in the dtype they were stored in. Strict."""
    directory = resolve(path_or_repo_id, revision)
    config = read_config(directory)
    hidden, vocab = base_sizes(base_model)
    for what, want, have in (("hidden size", config.hidden_size, hidden), ("vocab size", config.vocab_size, vocab)):
        if want != have:
            raise ValueError(
                f"heads were trained for {what} {want}, this model has {have}: the heads in {path_or_repo_id} belong "
                f"on {config.base_model}, not on {type(base_model).__name__} ({base_model.config._name_or_path or '?'})"
            )
    tensors = read_tensors(directory)
    check_tensors(config, tensors, f"{directory / WEIGHTS}")
    lm_head = base_model.get_output_embeddings()
    heads = MedusaHeads(config, lm_head)
    heads.load_state_dict(tensors, strict=True)
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}  # not the draft vocabulary's token ids
    return heads.to(device=lm_head.weight.device, dtype=dtypes.pop() if len(dtypes) == 1 else None).eval()


# ------------------------------------------------------------------------------------------------------ publish
def checkpoint_files(directory: Path) -> list[str]:
    """The files of a valid checkpoint directory that a publish uploads; refuses one whose files disagree."""
    config = read_config(directory)
    check_tensors(config, read_tensors(directory), str(directory / WEIGHTS))
    return [name for name in FILES if (directory / name).is_file()]


TYPED_DRAFTS = {
    "exit-head": ("heads.exit_head", "read_exit_checkpoint", "exit_card"),
    "eagle": ("heads.eagle", "read_eagle_checkpoint", "eagle_card"),
    "hydra": ("heads.hydra", "read_hydra_checkpoint", "hydra_card"),
}
"""draft_type -> (module, strict reader, model card) of the drafts stored with a typed config (DraftCheckpoint)."""


def publish_files(directory: Path, repo_id: str) -> dict[str, Path | bytes]:
    """What a publish of ``directory`` to ``repo_id`` uploads: config.json and model.safetensors as saved (after a
    strict check), and README.md generated from config.json for ``repo_id`` (so its usage snippet names the repo).
    Medusa heads, exit heads (draft_type "exit-head"), EAGLE heads ("eagle") and Hydra heads ("hydra") alike; a
    layer-skip config ("layerskip") has no weights: config.json and its card."""
    config_file = directory / CONFIG
    kind = read_json_object(config_file, "the checkpoint's config").get("draft_type") if config_file.is_file() else None
    if kind == "layerskip":  # a searched skip set: config.json alone (the target's own layers draft), read strictly
        from selfspec.drafts.layerskip import LayerSkipConfig, layerskip_card

        return {CONFIG: config_file, CARD: layerskip_card(LayerSkipConfig.load(directory), repo_id).encode()}
    if kind not in ("medusa", *TYPED_DRAFTS):
        why = ": a policy names its arms by local paths, publish those instead" if kind == "policy" else ""
        raise ValueError(f"{directory} holds {describe(directory)}; heads.publish publishes selfspec checkpoints of "
                         f"Medusa, Hydra, EAGLE and exit heads and layer-skip configs (config.json with draft_type "
                         f"{', '.join(['medusa', *TYPED_DRAFTS, 'layerskip'])}){why}")
    if kind in TYPED_DRAFTS:  # read strictly (config against tensors), then carded for the repo
        module = importlib.import_module(TYPED_DRAFTS[kind][0])
        read, card_for = getattr(module, TYPED_DRAFTS[kind][1]), getattr(module, TYPED_DRAFTS[kind][2])
        card = card_for(read(directory)[0], repo_id).encode()
        return {CONFIG: directory / CONFIG, WEIGHTS: directory / WEIGHTS, CARD: card}
    checkpoint_files(directory)
    card = model_card(read_config(directory), repo_id).encode()
    return {CONFIG: directory / CONFIG, WEIGHTS: directory / WEIGHTS, CARD: card}


def push_folder(
    directory: str | Path, repo_id: str, private: bool = False, revision: str | None = None, token: str | None = None,
    dry_run: bool = False, commit_message: str = "Upload a draft checkpoint (selfspec)", endpoint: str | None = None,
) -> list[str] | Published:
    """Publish a saved checkpoint directory to the Hub in one commit (heads.hub.publish: all files or none).

    dry_run: check the checkpoint and the repo id, return the files that would be uploaded; nothing is sent.
    Otherwise a ``Published`` record; any failure raises ``heads.hub.PublishError`` saying what the repo holds now.
    The token comes from ``token`` or the usual places (HF_TOKEN, ``hf auth login``); ``endpoint`` defaults to
    HF_ENDPOINT / huggingface.co.
    """
    check_repo_id(repo_id)
    files = publish_files(Path(directory).expanduser(), repo_id)
    if dry_run:
        return list(files)
    return publish(files, repo_id, private=private, revision=revision, token=token, commit_message=commit_message,
                   endpoint=endpoint)


def push_heads(heads: Any, repo_id: str, **kwargs: Any) -> list[str] | Published:
    """save_pretrained (Medusa or Hydra heads, an exit head or an EAGLE head) into a temporary directory and push_folder it (same keyword
    arguments)."""
    with tempfile.TemporaryDirectory(prefix="selfspec-push-") as tmp:
        directory = heads.save_pretrained(Path(tmp) / "heads", repo_id=repo_id)
        return push_folder(directory, repo_id, **kwargs)


# --------------------------------------------------------------------------------------------------- model card
def card_datasets(recipe: dict | None) -> list[str] | None:
    """The Hub dataset ids a recipe trained on (recipe["data"]["source"]); local files are not named."""
    data = (recipe or {}).get("data")
    source = data.get("source") if isinstance(data, dict) else None
    if not isinstance(source, str):
        return None
    if source in HUB_DATASETS:
        return [HUB_DATASETS[source]]
    is_hub_id = source.count("/") == 1 and not Path(source).suffix and not Path(source).exists()
    return [source] if is_hub_id else None


def model_card(config: MedusaConfig, location: str) -> str:
    """README.md: Hub metadata (base_model, library_name, tags, datasets), accuracy, tree and a usage snippet."""
    base = BUILTIN[config.base_model]["hub_id"] if config.base_model in BUILTIN else config.base_model
    meta = ModelCardData(
        base_model=base, library_name="selfspec", tags=["speculative-decoding", "medusa"],
        datasets=card_datasets(config.recipe),
    )
    revision = f" (revision `{config.base_revision}`)" if config.base_revision else ""
    lines = [
        "---", meta.to_yaml(), "---", "",
        f"# Medusa heads for {config.base_model}", "",
        f"{config.num_heads} Medusa heads ({config.num_layers} residual block(s) each, `{config.projection}` projection) "
        f"for `{config.base_model}`{revision}, made with selfspec. Head k predicts the token k steps beyond the base "
        "model's next token; selfspec drafts a tree of their top candidates and verifies it in one forward of the base "
        "model, losslessly: the output is the base model's own.", "",
        "## Measured accuracy", "",
    ]
    if config.head_accuracy:
        ranks = max(len(row) for row in config.head_accuracy)
        top = min(5, ranks)
        lines += ["Probability that head k's rank-r candidate is the right token (held-out data), and its top-r total:", "",
                  "| head | " + " | ".join(f"rank {r}" for r in range(ranks)) + f" | top-1 | top-{top} |",
                  "|---" * (ranks + 3) + "|"]
        for k, row in enumerate(config.head_accuracy):
            cells = [f"{a:.3f}" for a in row] + [""] * (ranks - len(row))
            lines.append(f"| {k + 1} | " + " | ".join(cells) + f" | {sum(row[:1]):.3f} | {sum(row[:top]):.3f} |")
    else:
        lines.append("Not measured yet.")
    lines += ["", "## Tree", ""]
    if config.tree:
        depth = max(len(c) for c in config.tree)
        lines.append(f"{len(config.tree)} draft nodes, depth {depth}, built from the measured accuracy by `heads.tree_search`.")
        if config.head_accuracy:
            lines.append(f"Expected accepted tokens per step (from the measured accuracy): "
                         f"{expected_accept_length(config.head_accuracy, config.tree):.2f}.")
        lines += ["", f"`{json.dumps(config.tree)}`"]
    else:
        lines.append("No tree stored: selfspec drafts a chain of the heads' top-1 candidates.")
    if config.draft_vocab_size is not None:
        lines += ["", f"Drafts come from a draft vocabulary of the {config.draft_vocab_size} tokens most frequent in the "
                      f"training data (of {config.vocab_size}); the base verifies every one."]
    if config.mean_accepted is not None:
        lines += ["", f"Measured mean accepted tokens per step: {config.mean_accepted:.2f}."]
    if config.recipe:
        lines += ["", "## Training recipe", "", "```json", json.dumps(config.recipe, indent=2, default=str), "```"]
    lines += [
        "", "## Usage", "", "```python",
        "from selfspec import Target, generate",
        "from selfspec.core.models import load_model",
        "from heads.drafter import load_drafter", "",
        f'model, tokenizer = load_model("{config.base_model}")',
        "target = Target(model)",
        f'drafter = load_drafter("{location}", target)',
        'messages = [{"role": "user", "content": "Hello!"}]',
        'ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")["input_ids"]',
        "out = generate(target, drafter, ids, max_new_tokens=128, eos_token_id=tokenizer.eos_token_id)",
        "print(tokenizer.decode(out.tokens))", "```", "",
    ]
    return "\n".join(lines)
