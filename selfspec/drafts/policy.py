"""A per-request draft policy: which of a few drafts ("arms") decodes a request, chosen from the request's prefill.

No fixed tree suits every input: prompt lookup wins where the answer copies the prompt, a trained head where it does
not, a merged tree in between. The policy learns that choice from logged runs (BlockPilot / SpecDec++'s idea, at the
granularity of a request) and adds no forward of its own: the prefill already computed what it reads.

    fit     logs of every arm answering training questions (``infer.py bench``, one dtype; selfspec/tools/policy_fit.py)
            → y[r, a]  log tokens/s of arm a on request r (a question's turn), centred over the arms
            → x[r]     prompt_features(the target's final hidden states over the request's prompt)
            → ridge regression x → y in dual form (R requests << F features); λ chosen by leave-one-out *realised*
              speed: the speed of the arm each held-out request would have been given
    decode  at a request's first draft, x from ``state.new_hidden`` (the prefill's hidden states) → the arm with the
            highest predicted speed; every step of the request is then that arm's, whose own per-step rules (dynamic
            trees grown by draft probability, ``skip_after``) follow the draft's confidence step by step

With a large λ the prediction is the training mean: the policy falls back to the best fixed arm. Lossless whatever it
chooses: it only picks which drafter proposes; the target verifies as always.

Shapes: P prompt tokens, D hidden size, F = 2D + 1 features, R requests, A arms.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from selfspec.core.accept import Acceptance
from selfspec.core.files import atomic_write, read_json_object
from selfspec.core.drafter import Draft, Drafter, DraftState

DRAFT_TYPE = "policy"
CONFIG, WEIGHTS = "config.json", "model.safetensors"
TENSORS = ("mean", "scale", "weights", "bias")


def prompt_features(hidden: torch.Tensor) -> torch.Tensor:
    """hidden [P, D] (the target's final hidden states over the prompt) -> [2D + 1]: their mean, the last one (which
    gave the first token), and log P. float64."""
    if hidden.dim() != 2 or hidden.shape[0] < 1:
        raise ValueError(f"expected the prompt's hidden states [P, D] with P >= 1, found {tuple(hidden.shape)}")
    h = hidden.detach().to(torch.float64)
    return torch.cat([h.mean(0), h[-1], h.new_tensor([math.log(h.shape[0])])])


# ------------------------------------------------------------------------------------------------ the regression
@dataclass(frozen=True)
class Ridge:
    """Standardised features -> predicted centred log speed of each arm."""

    mean: torch.Tensor
    """[F] the training features' mean."""
    scale: torch.Tensor
    """[F] their standard deviation (1 where a feature is constant)."""
    weights: torch.Tensor
    """[F, A]"""
    bias: torch.Tensor
    """[A] the training mean of each arm's centred log speed: the prediction when the features say nothing."""

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """x [R, F] or [F] -> [R, A] or [A]."""
        return ((x.to(torch.float64) - self.mean) / self.scale) @ self.weights + self.bias


def centred(y: torch.Tensor) -> torch.Tensor:
    """y [R, A] log speeds -> each request's log speeds minus their mean over the arms (what the features can
    predict: how the arms compare on this request, not how long or hard the request is)."""
    return y - y.mean(1, keepdim=True)


def _standardise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mean = x.mean(0)
    scale = x.std(0, unbiased=False)
    scale = torch.where(scale > 1e-12, scale, torch.ones_like(scale))
    return (x - mean) / scale, mean, scale


def fit_ridge(x: torch.Tensor, y: torch.Tensor, lam: float) -> Ridge:
    """x [R, F] features, y [R, A] log speeds -> the ridge fit (dual form: (K + λI)^-1 is R x R)."""
    if x.shape[0] != y.shape[0] or x.shape[0] < 2:
        raise ValueError(f"fitting needs the same number (>= 2) of feature rows and speed rows, found {x.shape[0]} and "
                         f"{y.shape[0]}")
    if lam <= 0:
        raise ValueError(f"the ridge penalty must be > 0, found {lam}")
    x, y = x.to(torch.float64), centred(y.to(torch.float64))
    z, mean, scale = _standardise(x)
    bias = y.mean(0)
    k = z @ z.T  # [R, R]
    alpha = torch.linalg.solve(k + lam * torch.eye(k.shape[0], dtype=k.dtype), y - bias)  # [R, A]
    return Ridge(mean=mean, scale=scale, weights=z.T @ alpha, bias=bias)


def loo_predictions(x: torch.Tensor, y: torch.Tensor, lam: float) -> torch.Tensor:
    """[R, A]: each request's prediction by the fit on all the other requests, in closed form: the fit is a linear
    smoother ŷ = H y with H = K (K + λI)^-1 + 11ᵀ/R (the unpenalised bias), so y_i - ŷ_-i = (y_i - ŷ_i) / (1 - H_ii).
    (The features' standardisation is taken from all rows.)"""
    x, y = x.to(torch.float64), centred(y.to(torch.float64))
    z, _, _ = _standardise(x)
    r = z.shape[0]
    k = z @ z.T  # [R, R]
    hat = k @ torch.linalg.inv(k + lam * torch.eye(r, dtype=k.dtype)) + 1.0 / r
    fitted = hat @ y
    h = hat.diagonal()[:, None]
    return y - (y - fitted) / (1 - h)


def realised_gain(pred: torch.Tensor, y: torch.Tensor, fixed: int) -> float:
    """Mean over requests of log(speed of the arm ``pred`` picks / speed of arm ``fixed``); exp() of it is the
    geometric-mean speed-up of the policy over always using ``fixed``. pred, y [R, A]."""
    pick = pred.argmax(1)
    rows = torch.arange(y.shape[0])
    return float((y[rows, pick] - y[rows, fixed]).mean())


@dataclass(frozen=True)
class Selection:
    lam: float
    fixed: int
    """the best fixed arm on the training requests (highest mean log speed)."""
    loo_gain: dict[float, float]
    """λ -> realised_gain of the leave-one-out predictions over the best fixed arm."""
    oracle_gain: float
    """the gain of always picking each request's fastest arm: the most any policy could add."""


def select_lambda(x: torch.Tensor, y: torch.Tensor, lams: Sequence[float]) -> Selection:
    """The λ whose leave-one-out choices are fastest (ties: the larger λ, the simpler policy)."""
    y = y.to(torch.float64)
    fixed = int(y.mean(0).argmax())
    gains = {float(lam): realised_gain(loo_predictions(x, y, lam), y, fixed) for lam in lams}
    best = max(sorted(gains, reverse=True), key=lambda lam: gains[lam])
    return Selection(lam=best, fixed=fixed, loo_gain=gains, oracle_gain=realised_gain(y, y, fixed))


# ------------------------------------------------------------------------------------------------ the checkpoint
@dataclass
class Policy:
    """A fitted policy: the arms (``infer.py --draft`` strings, ``DRAFT@TREE`` allowed) and the regression."""

    arms: tuple[str, ...]
    ridge: Ridge
    base_model: str
    hidden_size: int
    vocab_size: int
    dtype: str
    """the dtype the training runs were measured in (where speeds, hence choices, hold)."""
    measured: dict[str, Any] = field(default_factory=dict)
    """what fitting measured: λ, leave-one-out gains, the best fixed arm, the oracle, training and held-out ids."""

    def __post_init__(self) -> None:
        f, a = 2 * self.hidden_size + 1, len(self.arms)
        if a < 2:
            raise ValueError(f"a policy chooses between at least two arms, found {a}: {list(self.arms)}")
        want = {"mean": (f,), "scale": (f,), "weights": (f, a), "bias": (a,)}
        for name, shape in want.items():
            found = tuple(getattr(self.ridge, name).shape)
            if found != shape:
                raise ValueError(f"policy tensor {name!r} should have shape {shape} ({a} arms, hidden size "
                                 f"{self.hidden_size}), found {found}")

    def choose(self, hidden: torch.Tensor) -> int:
        """The arm for a request whose prompt gave final hidden states ``hidden`` [P, D]."""
        return int(self.ridge.predict(prompt_features(hidden)).argmax())

    def save_pretrained(self, directory: str | Path) -> Path:
        """``directory/model.safetensors`` then ``directory/config.json``, each replaced atomically."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {name: getattr(self.ridge, name).contiguous() for name in TENSORS}
        tmp = out / f".{WEIGHTS}.tmp"
        save_file(tensors, str(tmp))
        os.replace(tmp, out / WEIGHTS)
        config = {"draft_type": DRAFT_TYPE, "arms": list(self.arms), "base_model": self.base_model,
                  "hidden_size": self.hidden_size, "vocab_size": self.vocab_size, "dtype": self.dtype,
                  "measured": self.measured}
        atomic_write(out / CONFIG, json.dumps(config, indent=2) + "\n")
        return out

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> "Policy":
        """Strict: unknown or missing config keys, wrong types, missing or misshapen tensors, a corrupt file: all
        raise, saying what was expected and what was found."""
        path = Path(directory).expanduser()
        if not (path / CONFIG).is_file():
            raise FileNotFoundError(f"{path} has no {CONFIG}: expected a policy directory from infer.py fit-policy")
        config = read_json_object(path / CONFIG, "the policy's config")
        kinds: dict[str, type] = {"draft_type": str, "arms": list, "base_model": str, "hidden_size": int,
                                  "vocab_size": int, "dtype": str, "measured": dict}
        if set(config) != set(kinds):
            raise ValueError(f"{path / CONFIG}: expected keys {sorted(kinds)}, found {sorted(config)}")
        for key, kind in kinds.items():
            if not isinstance(config[key], kind) or isinstance(config[key], bool):
                raise TypeError(f"{path / CONFIG}: {key} must be {kind.__name__}, found {config[key]!r}")
        if config["draft_type"] != DRAFT_TYPE:
            raise ValueError(f"{path / CONFIG}: draft_type must be {DRAFT_TYPE!r}, found {config['draft_type']!r}")
        if not all(isinstance(a, str) and a for a in config["arms"]):
            raise TypeError(f"{path / CONFIG}: arms must be a list of --draft strings, found {config['arms']!r}")
        try:
            tensors = load_file(str(path / WEIGHTS))
        except (SafetensorError, OSError) as err:
            raise ValueError(f"{path / WEIGHTS} cannot be read ({err}): the file is missing or corrupt; fit the "
                             "policy again") from err
        if set(tensors) != set(TENSORS):
            raise ValueError(f"{path / WEIGHTS}: expected tensors {list(TENSORS)}, found {sorted(tensors)}")
        ridge = Ridge(**{name: tensors[name].to(torch.float64) for name in TENSORS})
        return cls(arms=tuple(config["arms"]), ridge=ridge, base_model=config["base_model"],
                   hidden_size=config["hidden_size"], vocab_size=config["vocab_size"], dtype=config["dtype"],
                   measured=config["measured"])


# ------------------------------------------------------------------------------------------------ the drafter
class PolicyDrafter(Drafter):
    """Decodes each request with the arm the policy picks from its prefill; ``chosen[a]`` counts requests per arm."""

    def __init__(self, policy: Policy, drafters: Sequence[Drafter]):
        if len(drafters) != len(policy.arms):
            raise ValueError(f"the policy has {len(policy.arms)} arms, found {len(drafters)} drafters")
        for arm, d in zip(policy.arms, drafters):
            if d.verifier() is not None:
                raise ValueError(f"arm {arm!r} verifies with its own target (early exit reuses its early layers), so "
                                 "a policy cannot switch to it per request; leave it out of the arms")
        self.policy, self.drafters = policy, list(drafters)
        self.arm = int(policy.measured.get("fixed", 0))  # until a prefill is seen: the best fixed arm
        self.chosen = [0] * len(self.drafters)

    @property
    def batchable(self) -> bool:  # type: ignore[override]
        return all(d.batchable for d in self.drafters)

    def draft(self, state: DraftState) -> Draft:
        if state.starts_request:
            assert state.new_hidden is not None
            self.arm = self.policy.choose(state.new_hidden)
            self.chosen[self.arm] += 1
        return self.drafters[self.arm].draft(state)

    def update(self, draft: Draft, acceptance: Acceptance) -> None:
        self.drafters[self.arm].update(draft, acceptance)


def read_policy(path_or_repo_id: str | Path, target, tree=None) -> Policy:
    """The policy in a local directory, checked against ``target`` before its arms are built (its loader,
    ``selfspec.registry.load_policy``, builds each arm as ``--draft`` builds it)."""
    if tree is not None:
        raise ValueError("--tree does not apply to a policy: each arm carries its own tree ('DRAFT@TREE' in its arms)")
    if not Path(str(path_or_repo_id)).expanduser().is_dir():
        raise FileNotFoundError(f"policy {path_or_repo_id} is not a local directory (policies name local arms, so "
                                "they are not loaded from the Hub)")
    policy = Policy.from_pretrained(path_or_repo_id)
    d = target.hidden_size
    if d != policy.hidden_size:
        raise ValueError(f"this policy was fitted on {policy.base_model} (hidden size {policy.hidden_size}), but the "
                         f"target's hidden size is {d}: fit a policy for this model (infer.py fit-policy)")
    return policy
