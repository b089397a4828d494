"""`transduce.runtime.load`: an artifact directory (or an engine directory) -> a Translator; `open_backend`: the
backend a BackendSpec names, opened by the registry."""

from __future__ import annotations

import os
from typing import Any

from transduce.errors import ArtifactError
from transduce.formats.model_dir import TOKENIZER_FILE
from transduce.runtime.backends.base import Backend
from transduce.runtime.backends.registry import entry
from transduce.runtime.spec import BackendSpec


def open_backend(path: str | os.PathLike, spec: BackendSpec | None = None) -> Backend:
    """The backend `spec` names over `path`: an artifact directory (transduce export), or an engine directory
    (transduce build) for a backend that decodes engines."""
    spec = spec or BackendSpec()
    return entry(spec.backend).open(os.fspath(path), spec)


def make_backend(path: str | os.PathLike, backend: str = "onnxruntime", device: str = "cpu", threads: int = 0,
                 model_dir: str | None = None, **given: Any) -> Backend:
    """open_backend with the spec as keywords: BackendSpec's fields and the backend's own options by name."""
    return open_backend(path, BackendSpec.of(backend, device=device, threads=threads, model_dir=model_dir, **given))


def load(path: str | os.PathLike, spec: BackendSpec | None = None, *, max_batch_tokens: int = 4096,
         **given: Any):
    """A Translator over an exported artifact (or, for backend="tensorrt", an engine directory). The backend is
    `spec`, or BackendSpec.of(**given): load(path, backend="torch", device="cuda", cuda_graph=True)."""
    from transduce.models.tokenizer import Tokenizer
    from transduce.runtime.translator import Translator

    if spec is not None and given:
        raise TypeError(f"load() takes a spec or its fields as keywords, not both ({', '.join(given)})")
    be = open_backend(path, spec or BackendSpec.of(**given))
    artifact = be.artifact  # the artifact it decodes (an engine directory's copy; the torch model's export)
    tokenizer = Tokenizer.from_file(artifact.file(TOKENIZER_FILE))
    if tokenizer.vocab_size != be.config.vocab_size:  # another model's tokenizer.json put in its place
        raise ArtifactError(f"{artifact.files.display(TOKENIZER_FILE)} has {tokenizer.vocab_size} tokens, the model "
                            f"{be.config.vocab_size}: it is not the tokenizer this model was trained with",
                            hint=artifact.rebuild_hint())
    return Translator(be, tokenizer, max_batch_tokens=max_batch_tokens)
