"""Making a lean image: once per model file and kernel build, in a child process that loads the model with PyTorch
(so the caller never imports it), cached under $RUNLM_HOME/lean/images.

    python -m runlm.lean.prepare MODEL IMAGE     (what `image_for` runs)
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from runlm.catalog import runlm_home
from runlm.errors import ModelLoadError, RunlmError
from runlm.lean import image, native
from runlm.lean.image import LeanRefusal
from runlm.quant import build


def image_path(model: Path) -> Path:
    """Where the image of `model` for this process's kernel build and this runlm's code is cached: named by the
    model's path, and keyed by the file's size and time, the kernels (their build and their source: the regrouped
    layout) and the code that builds models (families, formats, layers), so a change to any makes a new image."""
    stat = model.stat()
    stamp = {
        "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "version": image.VERSION, "variant": build.variant(),
        "isa": native.isa(), "group_rows": [native.group_rows(build.KERNEL_TYPES[t]) for t in build.X4_TYPES],
    }  # fmt: skip
    key = hashlib.sha1(json.dumps(stamp, sort_keys=True).encode() + _building_code_digest())
    return _images() / f"{_model_prefix(model)}{key.hexdigest()[:12]}.lean"


@functools.cache
def _building_code_digest() -> bytes:
    """The code that builds models, hashed once per process (a command asks for its image twice: to choose the path
    and to open it)."""
    digest = hashlib.sha1()
    for source in _BUILDING_CODE:
        digest.update(source.read_bytes())
    return digest.digest()


def _images() -> Path:
    return runlm_home() / "lean" / "images"


def _model_prefix(model: Path) -> str:
    """The start of every image name of `model` (its stem, and a hash of its full path)."""
    return f"{model.stem}-{hashlib.sha1(str(model.resolve()).encode()).hexdigest()[:8]}-"


# What an image's bytes depend on besides the model file: the kernels' layout and the code that builds the model.
_PACKAGE = Path(__file__).resolve().parents[1]
_BUILDING_CODE = sorted(
    [build.SOURCE, _PACKAGE / "nn.py", _PACKAGE / "rope.py", _PACKAGE / "lean" / "image.py"]
    + [f for folder in ("models", "formats", "quant") for f in (_PACKAGE / folder).glob("*.py")]
)


# prepare's exit status for a model that cannot run lean (LeanRefusal), as against a failure
_REFUSED = 3


def refusal_note(target: Path) -> Path:
    """Where the reason a model cannot run lean is kept beside its would-be image, so the next run knows at once."""
    return target.with_name(target.name + ".refused")


def image_for(model: Path, log=None, target: Path | None = None) -> Path:
    """The image of `model` at `target` (default: the cache's, `image_path`), made first where there is none
    (`log`: called with a line of progress). A model that cannot run lean raises LeanRefusal, and says so at once
    the next time (the note is keyed like the image: a new runlm or model file asks again)."""
    if not model.is_file():
        raise ModelLoadError(f"{model}: runlm lean runs GGUF files (not a file)")
    target = target or image_path(model)
    if target.is_file():
        return target
    note = refusal_note(target)
    if note.is_file():
        raise LeanRefusal(note.read_text(encoding="utf-8").strip())
    if log is not None:
        size = model.stat().st_size / 2**30
        log(f"runlm: preparing {model.name} once for the process without PyTorch (a process with PyTorch loads it; "
            f"~{size:.1f} GiB under {target.parent}) ...")
    started = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    result = subprocess.run([sys.executable, "-m", "runlm.lean.prepare", str(model), str(target)],
                            capture_output=True, text=True, env=env)
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    if result.returncode == _REFUSED:
        why = lines[-1].removeprefix("runlm lean: ") if lines else f"{model}: cannot run without PyTorch"
        note.parent.mkdir(parents=True, exist_ok=True)
        note.write_text(why + "\n", encoding="utf-8")
        raise LeanRefusal(why)
    if result.returncode != 0 or not target.is_file():
        raise ModelLoadError(lines[-1] if lines else f"{model}: preparing the lean image failed")
    if log is not None:
        log(f"runlm: prepared in {time.perf_counter() - started:.1f} s: {target}")
    if target.parent == _images():  # older images of this model file (another version of it, or of runlm)
        prefix = _model_prefix(model)
        for old in [*target.parent.glob(f"{prefix}*.lean"), *target.parent.glob(f"{prefix}*.lean.refused")]:
            if old != target:
                old.unlink(missing_ok=True)
        _forget_orphans(target.parent)
    return target


def _forget_orphans(images: Path) -> None:
    """Images whose model file is gone (deleted, or moved: an image is named by its model's path): nothing will map
    them again, and each is about its model's size."""
    for old in images.glob("*.lean"):
        try:
            source = image.read_header(old)["source"]["path"]
        except (OSError, ValueError, KeyError, TypeError, RunlmError):
            continue  # not an image this runlm reads: left as it is
        if not Path(source).exists():
            old.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m runlm.lean.prepare MODEL IMAGE", file=sys.stderr)
        return 2
    from runlm.loading import load  # the child process: torch is wanted here

    try:
        image.write(load(args[0]), Path(args[1]))
    except LeanRefusal as exc:
        print(f"runlm lean: {exc}", file=sys.stderr)
        return _REFUSED
    except (RunlmError, OSError) as exc:
        print(f"runlm lean: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
