"""Which kind of directory a path is: a model (transduce train), an artifact (transduce export) or an engine
directory (transduce build), recognised by its description file, the same way everywhere.

An engine directory holds a copy of its artifact (manifest.json), and an artifact a copy of its model's
config.json, so the description files are looked for in that order: engine.json, manifest.json, config.json.
"""

from __future__ import annotations

import os

from transduce.formats.contract import ENCODER_FILE
from transduce.io.paths import marked_as

MODEL_CONFIG_FILE = "config.json"  # a model directory's description (transduce.formats.model_dir)
MODEL_FORMAT = "transduce-model"  # its "format" (also in an artifact's copy of it)
WEIGHTS_FILE = "model.safetensors"  # its weights
MANIFEST_FILE = "manifest.json"  # an artifact's description (transduce.formats.artifact)
ARTIFACT_KIND = "transduce-artifact"  # its "kind"
ENGINE_MANIFEST_FILE = "engine.json"  # an engine directory's description (transduce.formats.engine)
ENGINE_KIND = "transduce-engine"  # its "kind"
ENCODER_PLAN = "encoder.plan"  # an engine directory's encoder engine

KINDS = ("engine", "artifact", "model")  # in the order they are recognised
DESCRIPTION_FILES = {"engine": ENGINE_MANIFEST_FILE, "artifact": MANIFEST_FILE, "model": MODEL_CONFIG_FILE}
# kind -> (the description's key, its value, a file only such a directory has: a damaged description beside it
# is still one of ours)
_MARKS = {"engine": ("kind", ENGINE_KIND, ENCODER_PLAN), "artifact": ("kind", ARTIFACT_KIND, ENCODER_FILE),
          "model": ("format", MODEL_FORMAT, WEIGHTS_FILE)}


def detect_kind(directory: str | os.PathLike) -> str | None:
    """"engine", "artifact" or "model" by the first description file `directory` holds, None if it holds none."""
    for kind in KINDS:
        if os.path.lexists(os.path.join(directory, DESCRIPTION_FILES[kind])):
            return kind
    return None


def written_as(directory: str | os.PathLike, kind: str) -> bool:
    """Whether transduce wrote `directory` as a `kind` directory, complete or damaged: it is that kind
    (detect_kind) and its description file says so, or is damaged beside a file only that kind has. What
    --force may replace (paths.check_replaceable)."""
    directory = os.fspath(directory)
    key, value, signature = _MARKS[kind]
    return detect_kind(directory) == kind and marked_as(directory, DESCRIPTION_FILES[kind], key, value, signature)


def is_model_dir(directory: str | os.PathLike) -> bool:
    return written_as(directory, "model")


def is_artifact_dir(directory: str | os.PathLike) -> bool:
    return written_as(directory, "artifact")


def is_engine_dir(directory: str | os.PathLike) -> bool:
    return written_as(directory, "engine")
