"""Files as manifests record them: sha256 and size, names that stay inside their directory, and JSON."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from transduce.errors import TransduceError
from transduce.io.pinned import PinnedDir


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_entry(path: str | os.PathLike) -> dict[str, Any]:
    """{"sha256", "bytes"} of one file: how every manifest (model, artifact, engine) records a file."""
    return {"sha256": sha256_file(path), "bytes": os.path.getsize(path)}


def file_entries(directory: str, names) -> dict[str, dict[str, Any]]:
    """{name: {sha256, bytes}} of the named files of `directory`, by name."""
    return {name: file_entry(os.path.join(directory, name)) for name in sorted(names)}


def inside_name(name: Any) -> bool:
    """Whether a file name a manifest lists stays inside its directory: relative, without '..'."""
    return (isinstance(name, str) and bool(name) and not os.path.isabs(name)
            and ".." not in name.replace("\\", "/").split("/"))


def listed_file_problem(directory: str | PinnedDir, name: Any, entry: Any, verify_hash: bool = True,
                        listed_in: str = "the manifest", changed: str = "after it was written") -> str | None:
    """Why a file a manifest lists ({name: {"sha256", "bytes"}}) is not what it recorded (None: it is). The
    name must stay inside `directory` (a relative path without '..': a hand-edited manifest must not make
    a reader hash or load /etc/passwd), the entry must carry both fields, and the file must be readable.
    A PinnedDir is read through its handle (pinned.Replaced where it was replaced meanwhile)."""
    pinned = directory if isinstance(directory, PinnedDir) else None
    shown = pinned.path if pinned is not None else directory
    if not inside_name(name):
        return f"{listed_in} lists {name!r}, which is not a file name inside {shown}"
    if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and isinstance(entry.get("sha256"), str)):
        return f"{listed_in} does not give {name} as {{sha256, bytes}}"
    path = os.path.join(shown, name)
    if not (pinned.is_file(name) if pinned is not None else os.path.isfile(path)):
        return f"{path} is missing"
    try:
        size = pinned.size(name) if pinned is not None else os.path.getsize(path)
        if size != entry["bytes"]:
            return f"{path} has {size} bytes, {listed_in} says {entry['bytes']}: it was truncated or changed {changed}"
        if verify_hash and sha256_file(pinned.path_of(name) if pinned is not None else path) != entry["sha256"]:
            return f"{path} does not match its sha256 in {listed_in}: it was changed {changed}"
    except OSError as e:
        return f"{path} cannot be read ({e.strerror})"
    return None


def read_json(path: str | os.PathLike) -> Any:
    """A JSON file's content (UTF-8); OSError or ValueError as open and json.load raise them. Every reader of a
    description file (config.json, manifest.json, engine.json) goes through here and words its own errors."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_json_object(path: str | os.PathLike, error: type[TransduceError] = TransduceError) -> dict[str, Any]:
    """A JSON object from a file, or `error` saying the file is unreadable, not JSON or not an object."""
    try:
        data = read_json(path)
    except OSError as e:
        raise error(f"{path} cannot be read ({e.strerror})") from None
    except ValueError as e:
        raise error(f"{path} is not valid JSON ({e}); the file is truncated or corrupt") from None
    if not isinstance(data, dict):
        raise error(f"{path} does not hold a JSON object (found {type(data).__name__}); the file is corrupt")
    return data
