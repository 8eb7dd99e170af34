"""Models by name from the Hugging Face Hub: `hf.co/<user>/<repo>[:<quant>]` picks one GGUF of the repo (the
quantization asked for, or a sensible default) and its vision projector, downloads them with `huggingface_hub`
(resumed after an interruption, with a progress bar or a progress hook; `HF_TOKEN` for gated repos, `HF_ENDPOINT`
for another hub) and checks each against the sha256 the Hub lists for it.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import io
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runlm.errors import CatalogError, DownloadError, ModelAccessError, ModelNotFoundError
from runlm.formats.gguf import SPLIT_NAME

PREFIXES = ("hf.co/", "huggingface.co/", "https://huggingface.co/", "hf://")
# the default quantization where none is asked for: the first the repo has, llama.cpp's usual choices first
DEFAULT_QUANTS = ("Q4_K_M", "Q4_K_S", "Q4_0", "Q5_K_M", "Q8_0", "Q6_K", "Q4_1", "Q3_K_M", "Q2_K", "BF16", "F16")


@dataclass(frozen=True)
class HubRef:
    repo: str  # user/repo
    quant: str | None  # a quantization tag ("Q4_K_M") or a file name in the repo; None: the default

    def __str__(self) -> str:
        return f"hf.co/{self.repo}" + (f":{self.quant}" if self.quant else "")


def parse_ref(text: str) -> HubRef | None:
    """`hf.co/user/repo[:quant]` (or huggingface.co/..., hf://...) as a HubRef; None for anything else. `:latest`
    (Ollama's default tag) means the default quantization, as it does to Ollama."""
    prefix = next((p for p in PREFIXES if text.startswith(p)), None)
    if prefix is None:
        return None
    rest = text[len(prefix) :]
    repo, _, quant = rest.partition(":")
    parts = repo.strip("/").split("/")
    if len(parts) != 2 or not all(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}", p) for p in parts):
        raise CatalogError(f"{text!r}: expected hf.co/<user>/<repo>[:<quantization>]")
    return HubRef("/".join(parts), quant if quant and quant.lower() != "latest" else None)


def hub_dir() -> Path:
    from runlm.catalog import runlm_home

    return runlm_home() / "hub"


def _tag_in(name: str, tag: str) -> bool:
    """Whether a file name carries the quantization tag as a whole word (Q4_K does not match Q4_K_M)."""
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(tag)}(?![A-Za-z0-9_])", name, re.IGNORECASE) is not None


def choose_files(ref: HubRef, files: list[str]) -> tuple[list[str], str | None]:
    """(the model's GGUF, or every part of a split one in order; its vision projector or None) among the repo's
    files."""
    ggufs = [f for f in files if f.lower().endswith(".gguf")]
    projectors = sorted((f for f in ggufs if "mmproj" in Path(f).name.lower()),
                        key=lambda f: (not _tag_in(f, "F16"), f))
    models = sorted(f for f in ggufs if f not in projectors)
    if not models:
        raise ModelNotFoundError(f"{ref}: the repo has no GGUF model file")
    if ref.quant is not None and ref.quant in models:
        chosen = [ref.quant]
    elif ref.quant is not None:
        chosen = [f for f in models if _tag_in(Path(f).name, ref.quant)]
        if not chosen:
            tags = sorted({m.group(0).upper() for f in models
                           if (m := re.search(r"(?i)(?:I?Q\d[A-Z0-9_]*|BF16|F16|F32)", Path(f).name))})
            raise ModelNotFoundError(f"{ref}: no GGUF with {ref.quant!r} in its name (the repo has: "
                                     f"{', '.join(tags) or ', '.join(models)})")
    else:
        chosen = next(([f for f in models if _tag_in(Path(f).name, tag)] for tag in DEFAULT_QUANTS
                       if any(_tag_in(Path(f).name, tag) for f in models)), models)
    projector = projectors[0] if projectors else None
    splits = [SPLIT_NAME.match(f) for f in chosen]
    if any(splits):
        models_of = {m["prefix"] if m else f for m, f in zip(splits, chosen)}
        if len(models_of) > 1:
            raise CatalogError(f"{ref}: several split GGUFs match ({', '.join(sorted(models_of))}); name one: "
                               f"hf.co/{ref.repo}:<file>")
        parts, count = sorted(chosen), int(splits[0]["count"])
        if len(parts) != count:
            raise CatalogError(f"{ref}: the repo has {len(parts)} of the {count} parts of {parts[0]}")
        return parts, projector
    if len(chosen) > 1:
        raise CatalogError(f"{ref}: several GGUFs match ({', '.join(chosen)}); name one: hf.co/{ref.repo}:<file>")
    return chosen, projector


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as source:
        while chunk := source.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class HubFile:
    """One file of a repo to download: its name there, its bytes, and the sha256 the Hub lists (None for a file kept
    in git rather than LFS, which the Hub lists no sha256 for)."""

    name: str
    size: int | None
    sha256: str | None


@dataclass(frozen=True)
class HubPlan:
    """What pulling a ref downloads, as the Hub lists it: the model's GGUF (every part of a split one, in order) and
    its vision projector, at one revision. Asked for apart from the download so that a server can answer a missing
    repo or quantization before it starts streaming progress."""

    ref: HubRef
    revision: str | None
    model: tuple[HubFile, ...]
    projector: HubFile | None

    @property
    def files(self) -> tuple[HubFile, ...]:
        return self.model + ((self.projector,) if self.projector is not None else ())


@dataclass(frozen=True)
class FileProgress:
    """Where one file of a pull stands, for a display other than the terminal's bar (Ollama's /api/pull): `completed`
    of `total` bytes are in; `verifying` once they all are and its sha256 is being checked."""

    name: str
    sha256: str | None
    completed: int
    total: int
    verifying: bool = False


ProgressHook = Callable[[FileProgress], None]


def _require_huggingface_hub() -> None:
    try:
        import huggingface_hub  # noqa: F401
    except ImportError as exc:
        raise CatalogError("models from the Hugging Face Hub need huggingface_hub: pip install huggingface_hub") \
            from exc


def _endpoint() -> str | None:
    """HF_ENDPOINT read now: huggingface_hub reads it once, at import."""
    return os.environ.get("HF_ENDPOINT") or None


def _http_errors() -> tuple[type[BaseException], ...]:
    """The errors of the HTTP client huggingface_hub uses (requests, httpx or httpx2, by its version) for a host that
    cannot be reached or a connection that breaks: among the modules loaded, as huggingface_hub has loaded its own."""
    found = (getattr(sys.modules.get(module), name, None)
             for module, name in (("httpx2", "HTTPError"), ("httpx", "HTTPError"), ("requests", "RequestException")))
    return tuple(error for error in found if isinstance(error, type) and issubclass(error, BaseException))


@contextmanager
def _hub_errors(ref: HubRef) -> Iterator[None]:
    """huggingface_hub's exceptions as runlm's typed ones, each one line."""
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        yield
    except GatedRepoError as exc:
        raise ModelAccessError(f"{ref}: the repo is gated: accept its terms on the Hub and set HF_TOKEN "
                               f"({_status(exc)})") from None
    except RepositoryNotFoundError as exc:
        raise ModelNotFoundError(f"{ref}: no such repo on the Hub, or it is private (set HF_TOKEN) "
                                 f"({_status(exc)})") from None
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, *_http_errors()) as exc:
        raise DownloadError(f"{ref}: download failed: "
                            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None


def files_to_pull(ref: HubRef) -> HubPlan:
    """Ask the Hub (one call; HF_ENDPOINT and HF_TOKEN honored) which files pulling `ref` downloads."""
    _require_huggingface_hub()
    from huggingface_hub import HfApi

    with _hub_errors(ref):
        info = HfApi(endpoint=_endpoint()).model_info(ref.repo, files_metadata=True)
    siblings = {s.rfilename: s for s in info.siblings or []}
    model, projector = choose_files(ref, list(siblings))

    def described(name: str) -> HubFile:
        sibling = siblings[name]
        lfs = sibling.lfs
        size = sibling.size if sibling.size is not None else (lfs.size if lfs is not None else None)
        return HubFile(name, size, lfs.sha256 if lfs is not None else None)

    return HubPlan(ref, info.sha, tuple(described(name) for name in model),
                   described(projector) if projector is not None else None)


def download(plan: HubPlan, progress: bool = True, on_progress: ProgressHook | None = None) -> tuple[Path, Path | None]:
    """Download a plan's files into runlm's hub cache, each checked against its sha256 (a file in the cache already is
    checked, not downloaded again): (the model's file or first part, projector or None). `progress` draws a bar on
    the terminal; `on_progress` is told instead, from this thread, as bytes arrive.

    Two pulls of one file at once (threads or processes) are safe: huggingface_hub downloads each file under a lock
    of its own, into a temporary file renamed into place, and a pull that finds it there downloads nothing."""
    _require_huggingface_hub()
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    if on_progress is None:
        (enable_progress_bars if progress else disable_progress_bars)()
    paths = []
    with _hub_errors(plan.ref):
        for file in plan.files:
            tell = _teller(file, on_progress)
            tell(0)
            bar = {"tqdm_class": _reporting_bar(tell)} if on_progress is not None and _takes_tqdm_class() else {}
            path = Path(hf_hub_download(plan.ref.repo, file.name, revision=plan.revision, cache_dir=hub_dir(),
                                        endpoint=_endpoint(), **bar))
            size = path.stat().st_size
            tell(size, size)
            if file.sha256 is not None:
                tell(size, size, verifying=True)
                if _sha256(path) != file.sha256:
                    _forget(path)
                    raise DownloadError(f"{plan.ref}: {file.name} does not match the sha256 the Hub lists for it "
                                        "(removed; pull again)")
            paths.append(path)
    return paths[0], paths[len(plan.model)] if plan.projector is not None else None


def pull(ref: HubRef, progress: bool = True, on_progress: ProgressHook | None = None) -> tuple[Path, Path | None]:
    """Download the model's GGUF, every part of a split one (and its projector) into runlm's hub cache: (the model's
    file or first part, projector or None). See `download` for `progress` and `on_progress`."""
    return download(files_to_pull(ref), progress, on_progress)


Teller = Callable[..., None]  # (completed, total=None, verifying=False)


def _teller(file: HubFile, on_progress: ProgressHook | None) -> Teller:
    """What reports one file's bytes to `on_progress` (nothing where there is none)."""

    def tell(completed: int, total: int | None = None, verifying: bool = False) -> None:
        if on_progress is not None:
            on_progress(FileProgress(file.name, file.sha256, int(completed), int(total or file.size or completed),
                                     verifying))

    return tell


@functools.cache
def _takes_tqdm_class() -> bool:
    """Whether this huggingface_hub's hf_hub_download reports bytes through a `tqdm_class` (older ones: each file is
    reported when it starts and when it is done)."""
    from huggingface_hub import hf_hub_download

    return "tqdm_class" in inspect.signature(hf_hub_download).parameters


class _Nowhere(io.TextIOBase):
    """Where a reporting bar draws."""

    def write(self, text: str) -> int:
        return len(text)


def _reporting_bar(tell: Teller) -> type:
    """A tqdm class for hf_hub_download's `tqdm_class`: it tells its bytes and draws nothing. A real tqdm (drawing
    nowhere, never disabled), because huggingface_hub uses more of a bar than `update`."""
    from tqdm import tqdm

    class ReportingBar(tqdm):
        def __init__(self, *args: Any, **kwargs: Any):
            kwargs.pop("name", None)  # given to huggingface_hub's own bar class only by some versions; tqdm refuses it
            kwargs.update(disable=False, file=_Nowhere())
            super().__init__(*args, **kwargs)
            tell(self.n, self.total)

        def update(self, n: float | None = 1) -> bool | None:
            shown = super().update(n)
            tell(self.n, self.total)
            return shown

    return ReportingBar


def _status(exc: Exception) -> str:
    response = getattr(exc, "response", None)
    return f"HTTP {response.status_code}" if response is not None else type(exc).__name__


def _forget(path: Path) -> None:
    """Remove a downloaded file: the cache's link and the blob it points to."""
    blob = path.resolve()
    path.unlink(missing_ok=True)
    if blob != path:
        blob.unlink(missing_ok=True)


def _repo_dir(repo: str) -> Path:
    return hub_dir() / f"models--{repo.replace('/', '--')}"


def _pulled_ggufs(repo_dir: Path) -> Iterator[tuple[str, Path]]:
    """(name in the repo, path) of each GGUF pulled from a repo, in order of name."""
    for path in sorted(repo_dir.glob("snapshots/*/**/*.gguf")):
        yield path.relative_to(next(p for p in path.parents if p.parent.name == "snapshots")).as_posix(), path


def pulled() -> list[tuple[str, Path, int]]:
    """(hf.co/user/repo:file, path, bytes) of every GGUF in the hub cache; a split model once, by its first part,
    with the bytes of all its parts."""
    out: list[tuple[str, Path, int]] = []
    for repo_dir in sorted(hub_dir().glob("models--*--*")):
        repo = repo_dir.name.removeprefix("models--").replace("--", "/", 1)
        for name, path in _pulled_ggufs(repo_dir):
            size = path.resolve().stat().st_size
            part = SPLIT_NAME.match(name)
            if part is not None and part["no"] != "00001":
                first = f"hf.co/{repo}:{part['prefix']}-00001-of-{part['count']}{part['ext']}"
                out = [(n, pth, s + size) if n == first else (n, pth, s) for n, pth, s in out]
                continue
            out.append((f"hf.co/{repo}:{name}", path, size))
    return out


def pulled_file(ref: HubRef) -> tuple[str, Path] | None:
    """The pulled model a ref names, chosen among its repo's pulled files as a pull chooses among the repo's files
    (so `hf.co/user/repo:Q4_K_M` finds what pulling it fetched; without a quantization, the default among those
    pulled), as (the name `pulled` lists it under, its file or first part); None where none is. Reads the cache
    only: the Hub is not asked."""
    files = dict(_pulled_ggufs(_repo_dir(ref.repo)))
    try:
        model, _ = choose_files(ref, list(files))
    except CatalogError:
        return None
    path = files[model[0]]
    return (f"hf.co/{ref.repo}:{model[0]}", path) if path.is_file() else None


def remove(ref: HubRef) -> list[Path]:
    """Delete a pulled repo (all its files) from the hub cache: the paths it held."""
    repo_dir = _repo_dir(ref.repo)
    if not repo_dir.is_dir():
        raise CatalogError(f"{ref}: not pulled")
    held = [path for name, path, _ in pulled() if name.startswith(f"hf.co/{ref.repo}:")]
    shutil.rmtree(repo_dir)
    return held
