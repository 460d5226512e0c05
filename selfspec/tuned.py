"""The store of tuned trees: what ``infer.py tune-tree`` measured fastest for a draft on this target, dtype and
machine, cached on disk for ``--tree auto`` (``selfspec.registry.resolve_tree`` reads it, ``selfspec.tools.calibrate``
writes it after ``selfspec.tools.budget`` has tuned).

    key    the draft (its weights' sha256, or prompt lookup's options), the merge it was tuned in, and ``machine_key``:
           the model, its config, dtype, device, this CPU and its instructions, its threads, torch, whether the
           forward is compiled
    file   $SELFSPEC_CACHE/tuning/tree-<sha256 of the key>.json: the key, the best (budget, depth) and the whole table
           (the verify-cost curves of ``budget.cached_verify_costs`` sit beside them as verify-<...>.json)

The drafts here are ``selfspec.registry.DraftSpec``s (read for their kind, location, revision, config, parts, text
and ``capabilities``: whether their kind declares itself tunable; the registry imports this module, so it cannot import
the type back).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol, Sequence

import torch
from huggingface_hub import hf_hub_download
from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError

from selfspec.core import compiled
from selfspec.core.models import bf16_emulated, cache_dir, looks_local
from selfspec.core.tree import DynamicTree
from selfspec.drafts.merge import REPLAYED_OPTIONS


class Tuned(Protocol):
    """What tune-tree measured (``selfspec.tools.budget.Tuning``): the best choice and the whole table, dataclasses
    with ``budget`` and ``depth``."""

    best: Any
    table: Sequence[Any]


def machine_key(target, model_id: str) -> dict:
    """What a verify-cost curve depends on: the model, its dtype and device, this machine's CPU (its name, the vector
    instructions torch uses on it and whether it has bf16 instructions: one CPU name can cover an AVX2 and an AVX-512
    generation, where a tree's cost differs several times, docs/benchmarks/log.md §46) and threads, and whether the
    target's forward is compiled."""
    return {"model": model_id, "config": hashlib.sha256(target.model.config.to_json_string().encode()).hexdigest()[:12],
            "dtype": str(next(target.model.parameters()).dtype), "device": str(target.device), **this_cpu(),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            **({"compiled": True} if compiled.is_compiled(target.model) else {})}  # uncompiled keys as they always were


def this_cpu() -> dict:
    """This CPU: its name (/proc/cpuinfo's model name, else the platform's), the vector instructions torch uses on it
    ('AVX2', 'AVX512', ...) and whether it computes bf16 in hardware."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "isa": torch.backends.cpu.get_cpu_capability(), "bf16_instructions": not bf16_emulated("cpu")}


def cache_file(kind: str, key: dict) -> Path:
    """Where the cached ``kind`` ('verify': a cost curve, 'tree': a tuned tree) for ``key`` lives."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "tuning" / f"{kind}-{digest}.json"


def write_json(path: Path, data: dict) -> None:
    """``data`` as indented JSON, written whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)  # whole or absent


def draft_stamp(location: str, revision: str | None = None) -> str:
    """What identifies a draft's contents: the sha256 of its weights, or of its config.json for a draft without
    weights (a layer-skip config), from the directory or, for a Hub id, from the Hub cache at ``revision`` (two
    revisions of one repo are two drafts). Falls back to 'location@revision' where neither file can be read."""
    for name in ("model.safetensors", "config.json"):
        if looks_local(location):
            file = Path(location).expanduser() / name
        else:
            try:
                file = Path(hf_hub_download(location, name, revision=revision))
            except (EntryNotFoundError, LocalEntryNotFoundError, HfHubHTTPError, OSError):
                continue
        if file.is_file():
            return hashlib.sha256(file.read_bytes()).hexdigest()[:16]
    return f"{location}@{revision}" if revision else location


def _tuned_elsewhere(key: dict) -> list[str]:
    """The dtypes (as 'torch.bfloat16, 2 threads') this draft is tuned for on this target and machine, other than
    ``key``'s: ``tune-tree`` defaults to bf16, ``infer.py`` to fp32."""
    found = []
    for file in sorted(cache_file("tree", key).parent.glob("tree-*.json")):
        try:
            other = json.loads(file.read_text())["key"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        varies = ("dtype", "threads", "config")  # the config's hash records the dtype the model was loaded in
        if {k: v for k, v in other.items() if k not in varies} == {k: v for k, v in key.items() if k not in varies}:
            found.append(f"{other['dtype'].removeprefix('torch.')}, {other['threads']} threads")
    return found


def merge_stamp(spec, tuned) -> str:
    """What identifies the merge a draft part is tuned in (``spec``: a merged DraftSpec, ``tuned``: its part whose
    budget is tuned): the other parts in order (a checkpoint by its ``draft_stamp``, prompt lookup by its options),
    '*' in the tuned part's place, and the merge's options a tuning replays: 'ngram:depth=6,max_nodes=8+*+skip_after=3'
    (not ``skip_unpaid``, decided while decoding: the merge with it uses the tuning of the merge without it)."""
    def name(p) -> str:
        if p is tuned:
            return "*"
        if p.location:
            return f"{p.kind}@{draft_stamp(p.location, p.revision)}"
        return with_options(p.kind, p.config)

    parts = [name(p) for p in spec.parts]
    return "+".join(parts + [f"{k}={v}" for k, v in spec.config.items() if k in REPLAYED_OPTIONS])


def with_options(kind: str, config: dict) -> str:
    """A draft kind with its options as --draft spells them, sorted: "ngram:depth=6,max_nodes=8"."""
    options = ",".join(f"{k}={v}" for k, v in sorted(config.items()))  # sorted: one name however they were given
    return f"{kind}:{options}" if options else kind


TUNED_LOOKUP = ("depth", "max_nodes")
"""prompt lookup's options that ``selfspec.tools.budget.tune_lookup`` tunes (its budget and depth)."""


def check_untuned(spec, tuner: str) -> None:
    """Prompt lookup given to ``tuner`` ('tune-tree', '--tree auto') may not set what the tuning chooses."""
    if given := [k for k in TUNED_LOOKUP if k in spec.config]:
        raise ValueError(f"{tuner} tunes prompt lookup's {' and '.join(TUNED_LOOKUP)}, and --draft {spec.text} sets "
                         f"{' and '.join(given)}: drop {'them' if len(given) > 1 else 'it'} from --draft")


def lookup_name(spec) -> str:
    """Prompt lookup (a DraftSpec of kind 'ngram') as tuned and cached: 'ngram' with the options it keeps as given,
    'ngram:max_matches=4'; the tuned ones (``TUNED_LOOKUP``) left out."""
    return with_options(spec.kind, {k: v for k, v in spec.config.items() if k not in TUNED_LOOKUP})


def tuned_key(draft_location: str, target, model_id: str, revision: str | None = None,
              merged: str | None = None) -> dict:
    """draft_location: a checkpoint, or prompt lookup's ``lookup_name``; merged: the ``merge_stamp`` of the merge the
    draft was tuned in (None: tuned alone)."""
    lookup = draft_location == "ngram" or draft_location.startswith("ngram:")  # never a checkpoint (registry.parse_draft)
    return {"draft": draft_location if lookup else draft_stamp(draft_location, revision),
            **({"merged": merged} if merged else {}), **machine_key(target, model_id)}


def save_tuned(draft_location: str, target, model_id: str, tuning: Tuned, revision: str | None = None,
               merged: str | None = None) -> Path:
    key = tuned_key(draft_location, target, model_id, revision, merged)
    write_json(cache_file("tree", key), {"key": key, "draft": draft_location, "revision": revision,
                                          "best": asdict(tuning.best), "table": [asdict(c) for c in tuning.table]})
    return cache_file("tree", key)


def load_tuned(draft_location: str, target, model_id: str, revision: str | None = None,
               merged: str | None = None) -> DynamicTree:
    """The tuned DynamicTree (budget, depth, min_prob) for this draft on this target, dtype and machine (``--tree auto``), tuned
    alone or, with ``merged``, inside that merge."""
    key = tuned_key(draft_location, target, model_id, revision, merged)
    path = cache_file("tree", key)
    if not path.is_file():
        at, flag = (f" at revision {revision}", f" --draft-revision {revision}") if revision else ("", "")
        others = _tuned_elsewhere(key)
        hint = (f" (it is tuned for {' and '.join(others)}: decode in that dtype, or tune this one)" if others else "")
        raise FileNotFoundError(f"--tree auto: no tuned tree for {draft_location}{at} on {model_id} ({key['dtype']}, "
                                f"{key['threads']} threads) on this machine{hint}; run `python infer.py tune-tree "
                                f"--draft {draft_location}{flag} --model {model_id} --dtype "
                                f"{key['dtype'].removeprefix('torch.')}` first (a few minutes)")
    best = json.loads(path.read_text())["best"]
    return DynamicTree(budget=int(best["budget"]), depth=int(best["depth"]), min_prob=float(best.get("min_prob", 0.0)))


def auto_tree(spec, target, model_id: str, part=None) -> DynamicTree:
    """What ``--tree auto`` stands for with draft ``spec`` on this target, dtype and machine: the tree tune-tree cached
    for it. For a merge, ``part`` is its part that --tree applies to: the budget tuned inside this merge, else the one
    tuned for the part alone."""
    if part is not None:
        if not part.capabilities.tunable:
            return auto_tree(part, target, model_id)
        try:
            return load_tuned(part.location, target, model_id, part.revision, merged=merge_stamp(spec, part))
        except FileNotFoundError:
            pass
        try:
            return auto_tree(part, target, model_id)
        except FileNotFoundError as err:
            raise FileNotFoundError(f"{err}, or tune it inside this merge: `python infer.py tune-tree --draft "
                                    f"{spec.text} ...`") from None
    if spec.kind == "ngram":  # prompt lookup's depth and max_nodes, tuned by tune_lookup
        check_untuned(spec, "--tree auto")
        return load_tuned(lookup_name(spec), target, model_id)
    if not spec.capabilities.tunable:
        raise ValueError(f"--tree auto is for drafts whose tree budget infer.py tune-tree can tune (their kind declares "
                         f"it: DraftKind.tunable) and prompt lookup (ngram); --draft {spec.kind} takes a --tree of its "
                         "own")
    return load_tuned(spec.location, target, model_id, spec.revision)
