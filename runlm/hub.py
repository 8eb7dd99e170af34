"""Models by name from the Hugging Face Hub: `hf.co/<user>/<repo>[:<quant>]` picks one GGUF of the repo (the
quantization asked for, or a sensible default) and its vision projector, downloads them with `huggingface_hub`
(resumed after an interruption, with a progress bar; `HF_TOKEN` for gated repos, `HF_ENDPOINT` for another hub)
and checks each against the sha256 the Hub lists for it.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from runlm.errors import CatalogError
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
    """`hf.co/user/repo[:quant]` (or huggingface.co/..., hf://...) as a HubRef; None for anything else."""
    prefix = next((p for p in PREFIXES if text.startswith(p)), None)
    if prefix is None:
        return None
    rest = text[len(prefix) :]
    repo, _, quant = rest.partition(":")
    parts = repo.strip("/").split("/")
    if len(parts) != 2 or not all(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}", p) for p in parts):
        raise CatalogError(f"{text!r}: expected hf.co/<user>/<repo>[:<quantization>]")
    return HubRef("/".join(parts), quant or None)


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
        raise CatalogError(f"{ref}: the repo has no GGUF model file")
    if ref.quant is not None and ref.quant in models:
        chosen = [ref.quant]
    elif ref.quant is not None:
        chosen = [f for f in models if _tag_in(Path(f).name, ref.quant)]
        if not chosen:
            tags = sorted({m.group(0).upper() for f in models
                           if (m := re.search(r"(?i)(?:I?Q\d[A-Z0-9_]*|BF16|F16|F32)", Path(f).name))})
            raise CatalogError(f"{ref}: no GGUF with {ref.quant!r} in its name (the repo has: "
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


def pull(ref: HubRef, progress: bool = True) -> tuple[Path, Path | None]:
    """Download the model's GGUF, every part of a split one (and its projector) into runlm's hub cache: (the model's
    file or first part, projector or None)."""
    try:
        from huggingface_hub import HfApi, hf_hub_download
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
        )
        from huggingface_hub.utils import disable_progress_bars, enable_progress_bars
    except ImportError as exc:
        raise CatalogError("models from the Hugging Face Hub need huggingface_hub: pip install huggingface_hub") \
            from exc
    try:
        endpoint = os.environ.get("HF_ENDPOINT") or None  # read now: huggingface_hub reads it once, at import
        info = HfApi(endpoint=endpoint).model_info(ref.repo, files_metadata=True)
        siblings = {s.rfilename: s for s in info.siblings or []}
        model, projector = choose_files(ref, list(siblings))
        (enable_progress_bars if progress else disable_progress_bars)()
        paths = []
        for name in [*model, projector]:
            if name is None:
                continue
            path = Path(hf_hub_download(ref.repo, name, revision=info.sha, cache_dir=hub_dir(), endpoint=endpoint))
            lfs = siblings[name].lfs
            if lfs is not None and _sha256(path) != lfs.sha256:
                _forget(path)
                raise CatalogError(f"{ref}: {name} does not match the sha256 the Hub lists for it (removed; pull "
                                   "again)")
            paths.append(path)
        return paths[0], paths[len(model)] if projector is not None else None
    except GatedRepoError as exc:
        raise CatalogError(f"{ref}: the repo is gated: accept its terms on the Hub and set HF_TOKEN "
                           f"({_status(exc)})") from None
    except RepositoryNotFoundError as exc:
        raise CatalogError(f"{ref}: no such repo on the Hub, or it is private (set HF_TOKEN) ({_status(exc)})") \
            from None
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        raise CatalogError(f"{ref}: download failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")\
            from None


def _status(exc: Exception) -> str:
    response = getattr(exc, "response", None)
    return f"HTTP {response.status_code}" if response is not None else type(exc).__name__


def _forget(path: Path) -> None:
    """Remove a downloaded file: the cache's link and the blob it points to."""
    blob = path.resolve()
    path.unlink(missing_ok=True)
    if blob != path:
        blob.unlink(missing_ok=True)


def pulled() -> list[tuple[str, Path, int]]:
    """(hf.co/user/repo:file, path, bytes) of every GGUF in the hub cache; a split model once, by its first part,
    with the bytes of all its parts."""
    out: list[tuple[str, Path, int]] = []
    for repo_dir in sorted(hub_dir().glob("models--*--*")):
        repo = repo_dir.name.removeprefix("models--").replace("--", "/", 1)
        for path in sorted(repo_dir.glob("snapshots/*/**/*.gguf")):
            name = path.relative_to(next(p for p in path.parents if p.parent.name == "snapshots")).as_posix()
            size = path.resolve().stat().st_size
            part = SPLIT_NAME.match(name)
            if part is not None and part["no"] != "00001":
                first = f"hf.co/{repo}:{part['prefix']}-00001-of-{part['count']}{part['ext']}"
                out = [(n, pth, s + size) if n == first else (n, pth, s) for n, pth, s in out]
                continue
            out.append((f"hf.co/{repo}:{name}", path, size))
    return out


def remove(ref: HubRef) -> list[Path]:
    """Delete a pulled repo (all its files) from the hub cache: the paths it held."""
    repo_dir = hub_dir() / f"models--{ref.repo.replace('/', '--')}"
    if not repo_dir.is_dir():
        raise CatalogError(f"{ref}: not pulled")
    held = [path for name, path, _ in pulled() if name.startswith(f"hf.co/{ref.repo}:")]
    shutil.rmtree(repo_dir)
    return held
