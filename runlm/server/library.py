"""The models a server can load by name: GGUF files in a models directory, the models pulled into runlm's cache
(catalog and Hugging Face Hub models, under the names `runlm list` shows), and the one the server was started with.

Listed afresh on every look-up, so a file copied into the directory is servable at once. What a listing says of a
model that is not loaded (its family, size label, quantization, template) comes from its GGUF header, read once per
version of the file.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from runlm import catalog, hub
from runlm.errors import ModelLoadError, RunlmError
from runlm.formats.gguf import SPLIT_NAME, split_parts

LATEST = ":latest"  # Ollama's default tag, which its clients add to a bare name
# what /api/copy may name a new file: a plain file name, no path
COPY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def model_names(path: Path, name: str | None = None) -> tuple[str, frozenset[str]]:
    """The name a model is listed under (`name`, else its catalog name, else its file's stem), and every name a
    client may use: that, the file name, the stem, the catalog name, and each with Ollama's `:latest` tag."""
    catalog_name = catalog.name_for_file(path.name)
    listed = name or catalog_name or path.stem
    names = {listed, path.name, path.stem} | ({catalog_name} if catalog_name else set())
    return listed, frozenset(names | {n + LATEST for n in names})


@dataclass(frozen=True)
class ModelSource:
    """A model the server can load: the name it is listed under, its file, what runlm.load is given to load it
    (a path, or a catalog name, whose built-in chat format a file without a template needs), and its aliases."""

    name: str
    path: Path
    ref: str
    aliases: frozenset[str] = field(default_factory=frozenset)
    in_models_dir: bool = False  # a file of the models directory: /api/delete and /api/copy act on these only

    @classmethod
    def of(cls, path: Path, name: str | None = None, ref: str | None = None,
           in_models_dir: bool = False) -> ModelSource:
        listed, aliases = model_names(path, name)
        return cls(listed, path, ref or str(path), aliases, in_models_dir)

    def answers_to(self, name: str) -> bool:
        return name in self.aliases or name.removesuffix(LATEST) in self.aliases


def directory_sources(directory: Path) -> list[ModelSource]:
    """The GGUF models of a directory (not its subdirectories): each file by its stem, a split model once by the
    name before its part number; vision projectors (`mmproj` files) are not models."""
    sources = []
    for path in sorted(directory.iterdir()):
        if path.suffix.lower() != ".gguf" or "mmproj" in path.name.lower() or not path.is_file():
            continue
        split = SPLIT_NAME.match(path.name)
        if split is not None and int(split["no"]) != 1:
            continue
        sources.append(ModelSource.of(path, split["prefix"] if split else path.stem, in_models_dir=True))
    return sources


def cache_sources() -> list[ModelSource]:
    """The models pulled into runlm's cache, named as `runlm list` names them: catalog names, hf.co/... names."""
    pulled = [ModelSource.of(catalog.model_path(name), name, ref=name)
              for name in catalog.CATALOG if catalog.is_pulled(name)]
    try:
        from_hub = hub.pulled()
    except OSError:  # a cache being written or removed meanwhile: listed next time
        from_hub = []
    return pulled + [ModelSource.of(path, name) for name, path, _ in from_hub]


class ModelLibrary:
    """The models a server started with --models-dir can load: the directory's GGUF files, the pulled models,
    and `add`ed ones (the model named with -m). Where two would share a name, the first listed keeps it."""

    def __init__(self, directory: str | Path | None, pulled: bool = True):
        self.directory = Path(directory).expanduser() if directory is not None else None
        if self.directory is not None and not self.directory.is_dir():
            raise ModelLoadError(f"--models-dir {self.directory}: no such directory")
        self.pulled = pulled
        self._added: list[ModelSource] = []

    def add(self, source: ModelSource) -> None:
        self._added.append(source)

    def sources(self) -> list[ModelSource]:
        found = [*self._added, *(directory_sources(self.directory) if self.directory else []),
                 *(cache_sources() if self.pulled else [])]
        return unique(found)

    def find(self, name: str) -> ModelSource | None:
        sources = self.sources()
        found = next((source for source in sources if source.answers_to(name)), None)
        return found or (self._pulled_as(name, sources) if self.pulled else None)

    @staticmethod
    def _pulled_as(name: str, sources: list[ModelSource]) -> ModelSource | None:
        """A model of the Hub by the name it was pulled as (`hf.co/user/repo:Q4_K_M`, `hf.co/user/repo`), which names
        no file: the file that pull chose, answering to that name too, so a client serves what it just pulled."""
        try:
            ref = hub.parse_ref(name)
        except RunlmError:
            return None
        pulled = hub.pulled_file(ref) if ref is not None else None
        if pulled is None:
            return None
        listed_name, _ = pulled
        source = next((s for s in sources if s.answers_to(listed_name)), None)
        return replace(source, aliases=source.aliases | {name}) if source is not None else None

    def delete(self, source: ModelSource) -> None:
        """Remove a model's file (every part of a split one) from the models directory (a link: the link only)."""
        self._check_own(source)
        try:
            for part in split_parts(source.path):
                part.unlink(missing_ok=True)
        except OSError as exc:
            raise RunlmError(f"{source.path.name}: cannot delete ({exc.strerror or exc})") from None

    def copy(self, source: ModelSource, destination: str) -> Path:
        """A copy of a model under a new name in the models directory: a hard link where the file system allows
        (the same bytes, at once), else a copy of the file. ValueError for a name that is no plain file name or a
        split model, FileExistsError for a name taken."""
        self._check_own(source)
        name = destination.removesuffix(LATEST).removesuffix(".gguf")
        if not COPY_NAME.fullmatch(name):
            raise ValueError("destination: a plain name of letters, digits, '.', '_' and '-' (no path)")
        if len(split_parts(source.path)) > 1:
            raise ValueError(f"source: {source.name!r} is split into parts; copy its files by hand")
        target = source.path.with_name(name + ".gguf")
        if self.find(name) is not None or target.exists():
            raise FileExistsError(f"destination: a model named {name!r} exists already")
        try:
            os.link(source.path.resolve(), target)
        except FileExistsError:
            raise FileExistsError(f"destination: a model named {name!r} exists already") from None
        except OSError:  # another file system, or one without hard links
            shutil.copyfile(source.path, target)
        return target

    def _check_own(self, source: ModelSource) -> None:
        if not source.in_models_dir or self.directory is None:
            raise PermissionError(f"{source.name}: only models in the models directory can be deleted or copied "
                                  "here (pulled models: `runlm rm`)")


def unique(sources: Iterable[ModelSource]) -> list[ModelSource]:
    """Sources in order, less those whose name an earlier one already answers to."""
    kept: list[ModelSource] = []
    for source in sources:
        if not any(earlier.answers_to(source.name) for earlier in kept):
            kept.append(source)
    return kept


@dataclass(frozen=True)
class FileFacts:
    """What a GGUF header says of a model that is not loaded: what /api/tags and /api/show report."""

    architecture: str
    family: str
    quantization: str
    size_label: str
    context_length: int | None
    embedding_length: int | None
    block_count: int | None
    chat_template: str
    metadata: dict[str, Any]  # the header's scalar keys (no tokenizer arrays)


def file_facts(path: Path) -> FileFacts | None:
    """The header's facts of a GGUF file (None for a directory, or a file that cannot be read as GGUF)."""
    try:
        stat = path.stat()
    except OSError:
        return None
    if not path.is_file():
        return None
    return _facts(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=128)
def _facts(path: str, size: int, mtime_ns: int) -> FileFacts | None:
    """Cached by the file's size and time: a file replaced under the same name is read again."""
    from runlm.families.registry import for_gguf
    from runlm.formats.gguf import GGUFFile, quantization_of

    try:
        gguf = GGUFFile(path)
    except RunlmError:
        return None
    meta = gguf.metadata
    arch = str(meta.get("general.architecture", ""))
    try:
        family = for_gguf(arch, path).name
    except RunlmError:  # listed all the same; loading it says why it cannot run
        family = arch
    try:
        quantization = quantization_of(gguf)
    except (RunlmError, KeyError, ValueError):
        quantization = ""

    def number(key: str) -> int | None:
        value = meta.get(f"{arch}.{key}")
        return int(value) if isinstance(value, int | float) else None

    template = meta.get("tokenizer.chat_template")
    scalars = {k: v for k, v in meta.items()
               if isinstance(v, str | int | float | bool) and k != "tokenizer.chat_template"}
    return FileFacts(arch, family, quantization, str(meta.get("general.size_label", "")),
                     number("context_length"), number("embedding_length"), number("block_count"),
                     template if isinstance(template, str) else "", scalars)
