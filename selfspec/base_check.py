"""Is a draft checkpoint for this target? Its config.json names the base model (and Hub revision) it was trained for and
its sizes; the target's own config says what it is. Checked before any weights load: a draft for another model
fails fast, saying which model it wants.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from transformers import AutoConfig

from selfspec.core.models import BUILTIN, MODEL_FORMS, _refuse_remote_code, resolve, unreachable_hub
from selfspec.registry import DraftSpec


def _norm(name: str) -> str:
    return name.rstrip("/").split("/")[-1].lower()


def _same_revision(a: str | None, b: str | None) -> bool:
    """Hub revisions that name the same thing without asking the Hub: equal (None is 'main'), or a commit hash and
    its abbreviation."""
    a, b = (a or "main").lower(), (b or "main").lower()
    hashes = all(len(r) >= 7 and all(c in "0123456789abcdef" for c in r) for r in (a, b))
    return a == b or (hashes and (a.startswith(b) or b.startswith(a)))


def trained_for(cfg: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint's config.json says it was made for (base_model, base_revision, hidden_size, vocab_size; any
    may be None): selfspec's keys, or for a checkpoint of vLLM's speculators library its verifier and the sizes of
    its transformer_layer_config (vocab_size there is the target's)."""
    if "draft_type" in cfg or "speculators_model_type" not in cfg:
        return {k: cfg.get(k) for k in ("base_model", "base_revision", "hidden_size", "vocab_size")}
    layer = cfg.get("transformer_layer_config") if isinstance(cfg.get("transformer_layer_config"), dict) else {}
    spec = cfg.get("speculators_config") if isinstance(cfg.get("speculators_config"), dict) else {}
    verifier = spec.get("verifier") if isinstance(spec.get("verifier"), dict) else {}
    return {"base_model": verifier.get("name_or_path"), "base_revision": None,
            "hidden_size": layer.get("hidden_size"), "vocab_size": layer.get("vocab_size")}


def check_base(spec: DraftSpec, model_name: str, hidden_sizes: tuple[int, ...], vocab_size: int,
               aliases: tuple[str, ...] = (), allow_other_base: bool = False, revision: str | None = None) -> None:
    """Refuse a checkpoint trained for another model, or for another Hub revision of it. model_name and aliases name
    the target, revision its Hub revision (None: main); sizes are its own (hidden_sizes: its layers' width, and its
    LM head's input width where that differs)."""
    for part in spec.parts:
        check_base(part, model_name, hidden_sizes, vocab_size, aliases, allow_other_base, revision)
    if spec.location is None or not spec.capabilities.checks_base:  # it checks itself as it loads (a draft model)
        return
    cfg = trained_for(spec.config)
    base = cfg.get("base_model")
    for key, found in (("hidden_size", hidden_sizes), ("vocab_size", (vocab_size,))):
        want = cfg.get(key)
        if want is not None and want not in found:
            raise ValueError(
                f"these heads were trained for {base or 'another model'} with {key} {want}, but the target "
                f"{model_name} has {key} {' or '.join(map(str, found))}: pass the model they were trained for "
                f"(--model {base or '...'})"
            )
    names = {_norm(n) for n in (model_name, *aliases) if n}
    if base and not allow_other_base and _norm(base) not in names:
        raise ValueError(
            f"these heads were trained for {base}, but the target is {model_name}: pass --model {base}, "
            f"or allow_other_base=True (--allow-other-base) if {model_name} is a copy of the same model"
        )
    trained_at = cfg.get("base_revision")
    if base and trained_at and not allow_other_base and not _same_revision(trained_at, revision):
        raise ValueError(
            f"these heads were trained for {base} at revision {trained_at}, but the target is at revision "
            f"{revision or 'main'}: pass --revision {trained_at}, or allow_other_base=True (--allow-other-base) if "
            f"the two revisions hold the same weights"
        )


@dataclass(frozen=True)
class TargetInfo:
    """What a model's config says, read without loading any weights."""

    hidden_sizes: tuple[int, ...]
    """the width of its layers, and of the LM head's input where the config says it differs (OPT's
    word_embed_proj_dim): a draft's hidden_size is one of them."""
    vocab_size: int
    num_layers: int
    aliases: tuple[str, ...]
    """other names of the model (its directory, the Hub id of a built-in)."""


def target_info(model: str, revision: str | None = None, trust_remote_code: bool = False) -> TargetInfo:
    location, gguf = resolve(model)
    kwargs: dict[str, Any] = {"revision": revision} if revision else {}
    if gguf:
        kwargs["gguf_file"] = gguf
    if location == model and not gguf and (reason := unreachable_hub(location, revision=revision)):
        raise FileNotFoundError(f"could not read the config of {model!r} from the Hub to check the draft against it: "
                                f"{reason}; expected {MODEL_FORMS}")
    try:
        cfg = AutoConfig.from_pretrained(location, trust_remote_code=trust_remote_code, **kwargs).get_text_config()
    except ValueError as err:
        _refuse_remote_code(model, err)
        raise
    except OSError as err:  # a Hub id that is not there, or the Hub out of reach
        if isinstance(err, FileNotFoundError) and location != model:
            raise
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise FileNotFoundError(f"could not read the config of {model!r} from the Hub to check the draft against it "
                                f"({reason}); expected {MODEL_FORMS}") from None
    aliases = (location, BUILTIN[model]["hub_id"]) if model in BUILTIN else (location,)
    widths = (int(cfg.hidden_size), int(getattr(cfg, "word_embed_proj_dim", None) or cfg.hidden_size))
    return TargetInfo(tuple(dict.fromkeys(widths)), int(cfg.vocab_size), int(cfg.num_hidden_layers), aliases)


def check_drafts(model: str, drafts: Sequence[DraftSpec], revision: str | None = None,
                 allow_other_base: bool = False, trust_remote_code: bool = False) -> None:
    """Refuse draft checkpoints trained for another model, from the configs alone."""
    if not any(d.location or d.parts for d in drafts):
        return
    info = target_info(model, revision, trust_remote_code)
    for d in drafts:
        check_base(d, model, info.hidden_sizes, info.vocab_size, info.aliases, allow_other_base=allow_other_base,
                   revision=revision)
