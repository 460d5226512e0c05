"""Publishing files to the Hugging Face Hub in one commit: all of them or none, and an error that says which.

    1. check the repo id ("owner/name") and find a token (argument, HF_TOKEN, `hf auth login`) — before any request
    2. create the repo (exist_ok); a private publish refuses an existing public repo
    3. create the branch from main when the revision is not main
    4. read the branch head: the commit is made on top of it (``parent_commit``), so a concurrent push is refused
    5. one commit holding every file (huggingface_hub's ``create_commit``: preupload, then the commit call)
    6. on failure, read the branch head again: unchanged -> "nothing was published"; moved -> say so

A Hub commit is atomic: a failed or dropped commit call leaves the branch as it was. Step 6 checks instead of
assuming, because a connection can drop after the Hub committed. Every failure raises ``PublishError``; nothing
that failed returns a result.

The endpoint is huggingface_hub's: ``HF_ENDPOINT`` (or ``endpoint=``) points it at a mirror or a test server.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import httpx2
from huggingface_hub import CommitOperationAdd, HfApi, get_token
from huggingface_hub.errors import HFValidationError, HfHubHTTPError, OfflineModeIsEnabled
from huggingface_hub.utils import validate_repo_id

TOKEN_HELP = "pass --token / token=, set HF_TOKEN, or log in once with `hf auth login` (a token with write access)"
NETWORK_ERRORS = (HfHubHTTPError, httpx2.HTTPError, OfflineModeIsEnabled)


class PublishError(RuntimeError):
    """A publish that did not complete. The message says at which step, why, and what the repo holds now."""


@dataclass(frozen=True)
class Published:
    repo_id: str
    revision: str
    commit: str
    """the commit that holds the files (the existing head when nothing had changed)."""
    url: str
    files: tuple[str, ...]
    changed: bool
    """False when the branch already held exactly these files (the Hub then makes no commit)."""


def check_repo_id(repo_id: str) -> None:
    """Refuse anything but 'owner/name' with the Hub's allowed characters, before any request is made."""
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise ValueError(f"{repo_id!r} is not a Hub repo id: expected 'owner/name' ({err})") from None
    if repo_id.count("/") != 1:
        raise ValueError(f"{repo_id!r} is not a Hub repo id: expected 'owner/name' (your user or organisation, "
                         "then a name)")


def find_token(token: str | None = None) -> tuple[str | None, str]:
    """(token, where it came from) from the usual places, in huggingface_hub's order; (None, why) when there is none."""
    if token:
        return token, "the token argument"
    if os.environ.get("HF_TOKEN"):
        return os.environ["HF_TOKEN"], "HF_TOKEN"
    saved = get_token()
    if saved:
        return saved, "huggingface_hub's saved login"
    return None, "no token found"


def _why(err: Exception, repo_id: str) -> str:
    """A short reason for a failed request, naming the status the Hub answered and what to do about it."""
    if isinstance(err, OfflineModeIsEnabled):
        return "HF_HUB_OFFLINE is set, so no request may leave this machine: unset it to publish"
    if isinstance(err, HfHubHTTPError) and err.response is not None:
        status = err.response.status_code
        said = err.response.headers.get("X-Error-Message") or err.server_message or str(err).splitlines()[0]
        if status == 401:
            return f"the Hub refused the token (401: {said}); {TOKEN_HELP}"
        if status == 403:
            return (f"no write access to {repo_id} (403: {said}); "
                    "publish under your user or an organisation you write to")
        return f"the Hub answered {status}: {said}"
    return f"network error ({type(err).__name__}: {err})"


def publish(
    files: dict[str, Path | bytes], repo_id: str, *, private: bool = False, revision: str | None = None,
    token: str | None = None, commit_message: str = "Upload with selfspec", endpoint: str | None = None,
) -> Published:
    """Upload ``files`` (path in repo -> local file or bytes) to ``repo_id`` at branch ``revision`` in one commit."""
    # 1. repo id and token, before any request
    check_repo_id(repo_id)
    token, source = find_token(token)
    if token is None:
        raise PublishError(f"cannot publish to {repo_id}: {source}; {TOKEN_HELP}")
    branch = revision or "main"
    api = HfApi(endpoint=endpoint, token=token)
    where = f"{repo_id} (branch {branch})"
    step = "creating the repo"
    try:
        # 2. the repo, private if asked (and never a private upload into a public repo)
        api.create_repo(repo_id, private=private, repo_type="model", exist_ok=True)
        step = "reading the repo"
        info = api.repo_info(repo_id, repo_type="model")
        if private and not info.private:
            raise PublishError(
                f"{repo_id} already exists and is public, but a private publish was asked for: nothing was published. "
                "Make the repo private on the Hub first, or publish without --private."
            )
        # 3. the branch, and 4. its head, which the commit builds on
        if branch != "main":
            step = f"creating branch {branch}"
            api.create_branch(repo_id, branch=branch, repo_type="model", exist_ok=True)
            step = "reading the branch head"
            info = api.repo_info(repo_id, revision=branch, repo_type="model")
    except NETWORK_ERRORS as err:
        raise PublishError(
            f"publishing to {where} failed while {step}: {_why(err, repo_id)}. Nothing was published."
        ) from err
    parent = info.sha
    operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=data if isinstance(data, bytes) else str(data))
                  for name, data in files.items()]
    # 5. one commit with every file
    try:
        commit = api.create_commit(repo_id, operations=operations, commit_message=commit_message, revision=branch,
                                   parent_commit=parent, repo_type="model")
    except (*NETWORK_ERRORS, ValueError) as err:
        # 6. what the branch holds now
        raise PublishError(
            f"publishing {len(files)} files to {where} failed while uploading and committing: {_why(err, repo_id)}. "
            f"{_after_failure(api, repo_id, branch, parent)}"
        ) from err
    return Published(repo_id=repo_id, revision=branch, commit=commit.oid, url=commit.commit_url, files=tuple(files),
                     changed=commit.oid != parent)


def _after_failure(api: HfApi, repo_id: str, branch: str, parent: str) -> str:
    try:
        now = api.repo_info(repo_id, revision=branch, repo_type="model").sha
    except NETWORK_ERRORS as err:
        return (f"Could not check the branch afterwards ({_why(err, repo_id)}): look at {repo_id} on the Hub before "
                "retrying; a Hub commit holds all of its files or none.")
    if now == parent:
        return f"Nothing was published: branch {branch} is unchanged at {parent[:8]}."
    return (f"Branch {branch} moved from {parent[:8]} to {now[:8]} meanwhile: check whether that commit holds "
            "this upload before retrying.")
