"""Models by name: turn a model reference into a local path, downloading from the Hugging Face Hub.

A reference is a local path (a file or directory that exists always wins) or a Hub repo id::

    org/name                 the default branch
    org/name@REVISION        a branch, tag or commit hash
    org/name:QUANT           in a GGUF repo, the file(s) of one quantization (Q4_K_M, q8_0, ...)
    org/name@REVISION:QUANT  both (org/name:QUANT@REVISION also works)

Downloads go through `huggingface_hub` into its cache, and only the files a model needs: config,
safetensors weights and index, tokenizer, chat template and generation config; for GGUF the chosen
file(s) and the small tokenizer/config files beside them. The environment is read at each call
(not at import, as huggingface_hub's own constants are): HF_HUB_CACHE / HF_HOME for the cache,
HF_TOKEN, HF_ENDPOINT, and HF_HUB_OFFLINE, under which only the cache is used. Repo ids, revisions
and patterns are checked before any network use. Errors name the repo id, the revision and what
is missing.
"""
from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from .files import read_json

DEFAULT_REVISION = "main"

# Top-level files of a safetensors model (fnmatch patterns, matched against names without a folder).
MODEL_FILES = (
    "config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "*.tiktoken", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
)
# What a GGUF file may come with (its tokenizer is inside it; these are small and optional).
GGUF_COMPANIONS = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
)

_COMMIT = re.compile(r"[0-9a-f]{40}")
# Git ref names as the Hub takes them (branches, tags, refs/pr/N): no "..", no leading "/" or "-",
# nothing a cache path could be escaped with.
_REVISION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-/]{0,255}")
_PATTERN = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_SHARD = re.compile(r"-(\d{5})-of-(\d{5})(?=\.gguf$)", re.IGNORECASE)
# llama.cpp's quantization names as they appear in file names (Q4_K_M, IQ2_XXS, Q8_0, BF16, ...).
_QUANT = re.compile(r"(?:I?Q\d(?:_[A-Z0-9]+)*|TQ\d_\d|BF16|F16|F32|MXFP4(?:_MOE)?)", re.IGNORECASE)


class HubReferenceError(ValueError):
    """The reference is neither an existing path nor a valid repo id / revision / pattern."""


class HubModelNotFoundError(FileNotFoundError):
    """The repo, revision or a file the model needs is not on the Hub or (offline) not in the cache."""


class QuantizationError(ValueError):
    """A GGUF repo's quantization pattern matches no file, or files of several quantizations;
    the message lists the quantizations the repo has."""


@dataclass(frozen=True)
class ModelReference:
    """A parsed Hub reference: `repo_id`, optional `revision` and GGUF quantization `pattern`."""

    repo_id: str
    revision: str | None = None
    pattern: str | None = None

    @property
    def rev(self) -> str:
        return self.revision or DEFAULT_REVISION

    def __str__(self) -> str:
        return (self.repo_id + (f"@{self.revision}" if self.revision else "")
                + (f":{self.pattern}" if self.pattern else ""))

    def where(self) -> str:
        return f"{self.repo_id!r} at revision {self.rev!r}"


# ---------------------------------------------------------------------- the environment, read per call

def _is_true(value: str | None) -> bool:
    return value is not None and value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache: $HF_HUB_CACHE, else $HUGGINGFACE_HUB_CACHE, else $HF_HOME/hub,
    else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub (huggingface_hub's order)."""
    env = os.environ
    explicit = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(explicit)).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def is_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) now, or as huggingface_hub read it at its import
    (its HTTP session refuses every request then)."""
    from huggingface_hub import constants

    return _is_true(os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")) or bool(
        constants.HF_HUB_OFFLINE)


# ---------------------------------------------------------------------- parsing

def _looks_like_repo(text: str) -> bool:
    """'org/name' with optional @revision / :pattern, not something that is plainly a path."""
    if not text or text[0] in "/.~" or "\\" in text or os.path.isabs(text):
        return False
    return text.split("@", 1)[0].split(":", 1)[0].count("/") == 1


def parse_reference(text: str) -> ModelReference:
    """Split and check `org/name[@revision][:pattern]` (or `org/name:pattern@revision`) with
    huggingface_hub's repo id validator; raises `HubReferenceError` naming the bad part."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id  # type: ignore[attr-defined]  # a lazy export

    # Repo ids, revisions (git refs) and patterns cannot hold ':'; repo ids and patterns cannot hold '@'.
    head, colon, pattern = text.partition(":")
    revision: str | None = None
    if colon and "@" in pattern:
        pattern, _, revision = pattern.partition("@")
    repo_id, at, rev = head.partition("@")
    if at:
        if revision is not None:
            raise HubReferenceError(f"model reference {text!r} names two revisions")
        revision = rev
    if revision is not None and (not _REVISION.fullmatch(revision) or ".." in revision
                                 or revision.endswith(("/", ".lock")) or "//" in revision):
        raise HubReferenceError(f"model reference {text!r}: {revision!r} is not a valid revision (a branch, tag "
                                f"or commit hash)")
    if colon and not _PATTERN.fullmatch(pattern):
        raise HubReferenceError(f"model reference {text!r}: {pattern!r} is not a valid quantization pattern "
                                f"(letters, digits, '_', '-' or '.', such as Q4_K_M)")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise HubReferenceError(f"{text!r} is not an existing file or directory, nor a valid Hugging Face repo id: "
                                f"{exc}") from None
    if repo_id.count("/") != 1:
        raise HubReferenceError(f"{text!r} is not an existing file or directory, nor a Hugging Face repo id "
                                f"of the form 'org/name'")
    return ModelReference(repo_id, revision, pattern if colon else None)


# ---------------------------------------------------------------------- choosing the files

def _matches(name: str, patterns: Iterable[str]) -> bool:
    from fnmatch import fnmatchcase

    return any(fnmatchcase(name, p) for p in patterns)


def is_model_gguf(path: str) -> bool:
    name = PurePosixPath(path).name.lower()
    return name.endswith(".gguf") and not name.startswith("mmproj")  # vision projectors are not models


def gguf_group(path: str) -> str:
    """The file a GGUF path is (a shard of): its path without the -0000k-of-0000n part."""
    return _SHARD.sub("", path)


def quant_label(group: str) -> str:
    """The quantization a GGUF file's name states (Q4_K_M), else its file name."""
    stem = PurePosixPath(group).name[: -len(".gguf")]
    parts = [p for p in re.split(r"[-.]", stem) if _QUANT.fullmatch(p)]
    return parts[-1].upper() if parts else PurePosixPath(group).name


def _describe_ggufs(ggufs: Sequence[str]) -> str:
    groups = sorted({gguf_group(f) for f in ggufs})
    labels = sorted({quant_label(g) for g in groups})
    return f"quantizations: {', '.join(labels)} (files: {', '.join(groups)})"


def _pick_gguf(ref: ModelReference, ggufs: Sequence[str], where: str) -> list[str]:
    """The .gguf file(s) of one quantization: those whose path contains `ref.pattern` (any case),
    preferring files that state exactly that quantization; shards of one file are one match."""
    if not ggufs:
        raise QuantizationError(f"{ref.where()} has no GGUF files {where} to pick {ref.pattern!r} from")
    want = (ref.pattern or "").lower()
    exact = [f for f in ggufs if want in (p.lower() for p in re.split(r"[-./]", gguf_group(f)))]
    found = exact or [f for f in ggufs if want in f.lower()]
    groups = sorted({gguf_group(f) for f in found})
    if not groups:
        raise QuantizationError(f"no GGUF file of {ref.where()} {where} matches {ref.pattern!r}; "
                                f"{_describe_ggufs(ggufs)}")
    if len(groups) > 1:
        raise QuantizationError(f"{ref.pattern!r} matches files of several quantizations in {ref.where()} {where}: "
                                f"{', '.join(groups)}; name one of {_describe_ggufs(ggufs)}")
    return sorted(f for f in found if gguf_group(f) == groups[0])


def _check_shards(ref: ModelReference, chosen: Sequence[str], where: str) -> None:
    counts = {int(m.group(2)) for f in chosen if (m := _SHARD.search(f))}
    if not counts:
        return
    have = {int(m.group(1)) for f in chosen if (m := _SHARD.search(f))}
    missing = sorted(set(range(1, max(counts) + 1)) - have)
    if len(counts) > 1 or missing:
        raise HubModelNotFoundError(f"{ref.where()} {where}: the split GGUF file {gguf_group(chosen[0])} lacks "
                                    f"parts {', '.join(str(i) for i in missing) or '(inconsistent part counts)'}")


@dataclass(frozen=True)
class FileChoice:
    """What `choose_files` picked from a repo's listing."""

    files: list[str]  # repo paths to fetch
    gguf: list[str]  # the model's .gguf file(s), empty for a safetensors model


def choose_files(ref: ModelReference, files: Sequence[str], where: str) -> FileChoice:
    """The files of `files` (a repo's listing) that the model `ref` needs."""
    top = [f for f in files if "/" not in f]
    ggufs = sorted(f for f in files if is_model_gguf(f))
    weights = [f for f in top if f.endswith(".safetensors") and not f.startswith("adapter")]
    if ref.pattern is not None:
        picked = _pick_gguf(ref, ggufs, where)
    elif "config.json" in top and weights:
        return FileChoice([f for f in top if _matches(f, MODEL_FILES) and not f.startswith("adapter")], [])
    elif ggufs:
        groups = sorted({gguf_group(f) for f in ggufs})
        if len(groups) > 1:
            raise QuantizationError(f"{ref.where()} holds several GGUF files {where}; pick one as "
                                    f"'{ref.repo_id}:QUANT' -- {_describe_ggufs(ggufs)}")
        picked = ggufs
    else:
        needs = (("config.json", "config.json" in top), ("*.safetensors weights", bool(weights)))
        missing = " and ".join(name for name, ok in needs if not ok)
        shown = ", ".join(sorted(files)[:20]) + (", ..." if len(files) > 20 else "") or "no files"
        raise HubModelNotFoundError(f"{ref.where()} {where} is not a model pymlxc can load: no GGUF file, and "
                                    f"{missing} missing (files: {shown})")
    _check_shards(ref, picked, where)
    return FileChoice(picked + [f for f in top if f in GGUF_COMPANIONS], picked)


def _check_folder(ref: ModelReference, folder: Path, choice: FileChoice, where: str) -> Path:
    """The path to hand to a backend, after checking that what the model needs is in `folder`."""
    missing = [f for f in choice.files if not (folder / f).is_file()]  # a link to a missing blob too
    if not missing and not choice.gguf:
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = read_json(index, what="safetensors index").get("weight_map")
            if isinstance(weight_map, dict):
                missing = sorted({str(v) for v in weight_map.values() if not (folder / str(v)).is_file()})
    if missing:
        raise HubModelNotFoundError(f"{ref.where()} {where} lacks {', '.join(missing)} (in {folder})")
    return folder / choice.gguf[0] if choice.gguf else folder


# ---------------------------------------------------------------------- the cache and the Hub

def _storage(cache: Path, repo_id: str) -> Path:
    return cache / ("models--" + repo_id.replace("/", "--"))


def _from_cache(ref: ModelReference, cache: Path, reason: str) -> Path:
    """Resolve `ref` from the hub cache alone (refs/<revision> -> snapshots/<commit>)."""
    where = f"in the Hugging Face cache {cache} ({reason})"
    storage = _storage(cache, ref.repo_id)
    if not storage.is_dir():
        raise HubModelNotFoundError(f"{ref.repo_id!r} is not {where}")
    if _COMMIT.fullmatch(ref.rev):
        commit = ref.rev
    else:
        ref_file = storage / "refs" / ref.rev
        if not ref_file.is_file():
            raise HubModelNotFoundError(f"revision {ref.rev!r} of {ref.repo_id!r} is not {where}")
        commit = _read_ref(ref_file).strip()
        if not _COMMIT.fullmatch(commit):
            raise HubModelNotFoundError(f"{ref_file} (revision {ref.rev!r} of {ref.repo_id!r}) does not hold a commit "
                                        f"hash")
    snapshot = storage / "snapshots" / commit
    if not snapshot.is_dir():
        raise HubModelNotFoundError(f"{ref.where()} (commit {commit}) is not {where}")
    files = [p.relative_to(snapshot).as_posix() for p in sorted(snapshot.rglob("*")) if p.is_file()]
    return _check_folder(ref, snapshot, choose_files(ref, files, where), where)


def _read_ref(path: Path) -> str:
    from .files import read_bytes

    return read_bytes(path, what="cache ref file", max_bytes=4096).decode("utf-8", errors="replace")


def _transport_errors() -> tuple[type[BaseException], ...]:
    """What huggingface_hub raises when the Hub cannot be reached (it catches the same ones)."""
    import httpx2  # huggingface_hub's HTTP client since 2.0 (the dependency's floor is 2.4)
    from huggingface_hub.errors import OfflineModeIsEnabled

    return (httpx2.TransportError, OfflineModeIsEnabled)


def _tqdm_class(progress: bool) -> Any:
    from huggingface_hub.utils.tqdm import tqdm as hf_tqdm

    if progress:
        return hf_tqdm

    class Silent(hf_tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]  # huggingface_hub's is unannotated

    return Silent


def _download(ref: ModelReference, cache: Path, progress: bool) -> Path:
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
        RevisionResolutionError,
    )

    endpoint = os.environ.get("HF_ENDPOINT") or None
    token = os.environ.get("HF_TOKEN") or None  # None: huggingface_hub's own lookup (a saved login)
    api = HfApi(endpoint=endpoint, token=token, library_name="pymlxc")
    where = f"on {api.endpoint}"
    try:
        revision = api.resolve_revision(ref.repo_id, revision=ref.revision, cache_dir=cache)
        files = api.list_repo_files(ref.repo_id, revision=revision.resolved)
    except _transport_errors() as exc:
        return _from_cache(ref, cache, f"the Hub could not be reached: {type(exc).__name__}: {exc}")
    except GatedRepoError:
        raise HubModelNotFoundError(f"{ref.repo_id!r} {where} is gated: accept its terms on the Hub and set "
                                    f"HF_TOKEN") from None
    except RevisionNotFoundError:
        raise HubModelNotFoundError(f"{ref.repo_id!r} {where} has no revision {ref.rev!r}") from None
    except RepositoryNotFoundError:
        raise HubModelNotFoundError(f"no repo {ref.repo_id!r} {where} (or it is private: set HF_TOKEN), and no "
                                    f"such local file or directory") from None
    except RevisionResolutionError as exc:  # the Hub unreachable and the revision not cached
        cause = exc.__cause__ or exc
        return _from_cache(ref, cache, f"the Hub could not be reached: {type(cause).__name__}: {cause}")
    except HfHubHTTPError as exc:
        if exc.response is not None and exc.response.status_code >= 500:
            return _from_cache(ref, cache, f"the Hub answered {exc.response.status_code}")
        raise HubModelNotFoundError(f"{ref.where()} {where}: {exc}") from None
    choice = choose_files(ref, files, where)
    try:
        folder = snapshot_download(
            ref.repo_id, revision=revision, cache_dir=cache, endpoint=endpoint, token=token,
            allow_patterns=[glob.escape(f) for f in choice.files], tqdm_class=_tqdm_class(progress),
            library_name="pymlxc")
    except HfHubHTTPError as exc:
        raise HubModelNotFoundError(f"downloading {ref.where()} {where} failed: {exc}") from None
    return _check_folder(ref, Path(folder), choice, where)


def resolve(reference: str | os.PathLike[str], *, progress: bool = True) -> Path:
    """The local path for `reference`: itself when it exists (or is not shaped like a repo id, so
    that a backend reports the missing path as before); else the snapshot directory (or, for GGUF,
    the .gguf file) of the Hub repo it names, downloaded into the hub cache if needed. `progress`:
    huggingface_hub's progress bars while downloading."""
    text = os.fspath(reference)
    if not text.strip():
        raise HubReferenceError("the model reference is empty: give a model directory, a .gguf file or a repo id")
    if os.path.exists(os.path.expanduser(text)) or not _looks_like_repo(text):
        return Path(text).expanduser()
    ref = parse_reference(text)  # checked before any network use
    cache = hub_cache_dir()
    if is_offline():
        return _from_cache(ref, cache, "HF_HUB_OFFLINE is set")
    return _download(ref, cache, progress)


__all__ = ["DEFAULT_REVISION", "FileChoice", "HubModelNotFoundError", "HubReferenceError", "ModelReference",
           "QuantizationError", "choose_files", "gguf_group", "hub_cache_dir", "is_model_gguf", "is_offline",
           "parse_reference", "quant_label", "resolve"]
