"""The disk cache: where it lives, how an entry is keyed, written, and trusted when read back.

Every cached result (dequantised GGUF weights, position-0 tables, inverse heads and their corpus
states, margins) is derived from one model, so every key of a model-derived entry starts with
:func:`model_key`: a hash of every parameter and buffer of the model (names, shapes, dtypes and
bytes) and of every change made to its forward pass outside the weights (a hook registered with
:meth:`sipit.whitebox.WhiteBox.transform_layer` declares its own key). Two models share an entry
only when they compute the same function: a quantised, tied or fine-tuned copy, a model directory
whose weights changed in place, or a served copy with other parameters never reads another's
files. A model whose forward draws random numbers (noise inside the network) has no key, and its
results are never cached on disk.

Files are written whole or not at all (:func:`save`, through sipit.atomic) and read back through
:func:`load`, which validates them: a file that cannot be read, or that fails the caller's
check, is removed with a one-line warning and rebuilt by the caller, never trusted and never left
to fail the next run. A folder of a build interrupted by SIGKILL (``.partial-<pid>-*``) is
removed by the next process that writes beside it (:func:`remove_stale_partials`).

``$SIPIT_CACHE_DIR`` overrides the user cache folder; set to anything but a folder (a file, a path
under a file) it is an error, never a silently disabled cache.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from sipit.atomic import PARTIAL_PREFIX, replace_atomically
from sipit.memo import memoised
from sipit.whitebox import SipitInputError, WhiteBox

CACHE_ENV = "SIPIT_CACHE_DIR"
log = logging.getLogger("sipit.cache")


class CacheDirError(SipitInputError):
    """``$SIPIT_CACHE_DIR`` names something that cannot be the cache folder."""


def cache_dir() -> Path:
    """``$SIPIT_CACHE_DIR`` or the user cache folder (``platformdirs``); refuses a path that is not a folder."""
    env = os.environ.get(CACHE_ENV)
    if env is None or not env.strip():
        import platformdirs

        return Path(platformdirs.user_cache_dir("sipit-bench"))
    path = Path(env).expanduser()
    for part in (path, *path.parents):
        if part.exists():
            if not part.is_dir():
                raise CacheDirError(f"${CACHE_ENV}={env!r}: {part} is a file, not a folder; point it at a folder")
            break
    return path


def _hash_tensors(named: list[tuple[str, torch.Tensor]], extra: tuple[str, ...] = ()) -> str:
    """blake2b (12 bytes, hex) of each tensor's name, shape, dtype and bytes, in order, then ``extra``."""
    digest = hashlib.blake2b(digest_size=12)
    for name, tensor in named:
        data = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{tuple(data.shape)}:{data.dtype}".encode())
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    for item in extra:
        digest.update(b"\0" + item.encode())
    return digest.hexdigest()


def _forward_changes(whitebox: WhiteBox) -> tuple[str, ...] | None:
    """The keys of the model's forward changes (WhiteBox.transform_layer); None when one has no key."""
    changes = getattr(whitebox.model, "_sipit_forward_changes", ())
    return None if any(key is None for key in changes) else tuple(changes)


def model_key(whitebox: WhiteBox) -> str | None:
    """The identity of the function the model computes: its parameters and buffers (names, shapes, dtypes,
    bytes), its keyed forward changes and its exposure; None while a forward change is random (nothing is
    cached).

    Hashing every byte costs about a second per 135M parameters; memoised per WhiteBox and set of changes."""
    changes = _forward_changes(whitebox)
    if changes is None:
        return None
    model = whitebox.model
    key = memoised(whitebox, "model-key", changes, lambda: _hash_tensors(
        list(model.named_parameters()) + list(model.named_buffers()), changes))
    return _with_exposure(key, whitebox)


def body_key(whitebox: WhiteBox) -> str | None:
    """The identity of what the layer states depend on besides the input rows: every parameter and buffer
    of the decoder except the input embedding (the LM head is outside it), and the forward changes. Two
    models with the same one map equal rows to equal states. Memoised per WhiteBox and set of changes."""
    changes = _forward_changes(whitebox)
    if changes is None:
        return None
    rows = whitebox.embedding.weight
    named = [(n, t) for n, t in list(whitebox.base.named_parameters()) + list(whitebox.base.named_buffers())
             if t is not rows]
    return _with_exposure(memoised(whitebox, "body-key", changes, lambda: _hash_tensors(named, changes)), whitebox)


def _with_exposure(key: str, whitebox: WhiteBox) -> str:
    """The key of what ``whitebox`` exposes: the residual stream's is the model's own, another exposure's is
    suffixed with its name (``-kv``), so a table of K/V rows never stands in for one of residual states."""
    return key if whitebox.exposure == "residual" else f"{key}-{whitebox.exposure}"


def entry_path(family: str, name: str) -> Path:
    """``cache_dir() / family / name``: the file of one cache entry."""
    return cache_dir() / family / name


def save(obj: Any, path: str | Path) -> bool:
    """``torch.save(obj)`` to ``path`` whole or not at all; False (nothing written) when the cache cannot be
    written: a read-only cache only costs a rebuild next time."""
    path = Path(path)
    try:
        remove_stale_partials(path.parent)
        replace_atomically(path, lambda tmp: torch.save(obj, tmp))
    except OSError as err:
        log.warning("warning: cannot write the cache file %s (%s): it will be rebuilt next time", path, err)
        return False
    return True


def load(path: str | Path, check: Callable[[Any], str | None] | None = None) -> Any | None:
    """The object stored at ``path`` (``torch.load``, tensors only), or None when there is none.

    A file that cannot be read, or for which ``check(obj)`` returns a reason, is damaged: it is removed
    with a one-line warning naming it and the reason, and None is returned so the caller rebuilds it."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
        reason = check(obj) if check is not None else None
    except Exception as err:  # noqa: BLE001 - a damaged file fails with many types (pickle, zip, EOF, keys)
        reason = f"{type(err).__name__}: {err}"
    if reason is None:
        return obj
    discard(path, reason)
    return None


def discard(path: Path, reason: str) -> None:
    """Remove the damaged cache file ``path``, saying so in one line."""
    log.warning("warning: damaged cache file %s (%s): removed, rebuilding it", path, " ".join(str(reason).split())[:200])
    try:
        path.unlink()
    except OSError:
        pass


def check_tensor(shape: tuple[int, ...]) -> Callable[[Any], str | None]:
    """A :func:`load` check: a finite tensor of exactly ``shape``."""

    def check(obj: Any) -> str | None:
        if not isinstance(obj, torch.Tensor):
            return f"holds a {type(obj).__name__}, not a tensor"
        if tuple(obj.shape) != tuple(shape):
            return f"shape {tuple(obj.shape)}, expected {tuple(shape)}"
        if obj.is_floating_point() and not bool(torch.isfinite(obj).all()):
            return "holds NaN or inf"
        return None

    return check


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_partials(folder: Path) -> None:
    """Remove ``.partial-<pid>-*`` files and folders in ``folder`` whose process is gone (a build or a save
    killed before it could clean up)."""
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return
    for entry in entries:
        rest = entry.name[len(PARTIAL_PREFIX):] if entry.name.startswith(PARTIAL_PREFIX) else ""
        pid = rest.split("-", 1)[0]
        if not pid.isdigit() or _pid_alive(int(pid)):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
