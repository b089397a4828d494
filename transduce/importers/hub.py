"""A checkpoint named on the Hugging Face Hub (`org/name`) rather than given as a directory: its snapshot, taken
from the Hugging Face cache or downloaded into it with huggingface_hub.snapshot_download, fetching only the files
the family's importer reads.

The cache is huggingface_hub's own (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub), read when
the import runs; HF_HUB_OFFLINE=1 uses only what the cache holds. A revision (a branch, tag or commit) picks the
snapshot; the default is the Hub's main branch. Weights are taken as safetensors where the repository has them,
else as PyTorch pickles (read without running code, as a local directory's are)."""

from __future__ import annotations

import os
import re

from transduce.errors import ImportCheckpointError

# a Hub model id: one "org/name", each part letters, digits, "-", "_" or "." (not a path that exists)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
SAFETENSORS = ["model.safetensors", "model.safetensors.index.json", "model-*.safetensors"]
PICKLES = ["pytorch_model.bin", "pytorch_model.bin.index.json", "pytorch_model-*.bin"]
HF_CONFIG = ["config.json", "generation_config.json", "tokenizer_config.json", "special_tokens_map.json"]
# what each family's importer reads besides weights (a family not listed: the config and tokenizer files)
FILES = {
    "marian": HF_CONFIG + ["source.spm", "target.spm", "vocab.json", "target_vocab.json"],
    "fsmt": HF_CONFIG + ["vocab-src.json", "vocab-tgt.json", "merges.txt"],
    "m2m100": HF_CONFIG + ["sentencepiece.bpe.model", "vocab.json", "tokenizer.json", "added_tokens.json"],
    "nllb": HF_CONFIG + ["sentencepiece.bpe.model", "tokenizer.json", "added_tokens.json"],
    "mbart": HF_CONFIG + ["sentencepiece.bpe.model", "tokenizer.json", "added_tokens.json"],
    "fairseq": ["*.pt", "dict.*.txt", "bpecodes", "*.model", "*.json"],
}
OTHER = HF_CONFIG + ["*.model", "*.spm", "vocab*.json", "tokenizer.json", "added_tokens.json", "merges.txt"]


def is_name(src: str) -> bool:
    """Whether `src` is to be looked up on the Hub: an `org/name` that is not a local path."""
    return not os.path.exists(src) and NAME.fullmatch(src) is not None


def cache_dir() -> str:
    """The Hugging Face cache as huggingface_hub resolves it, from the environment as it is now."""
    env = os.environ.get
    home = env("HF_HOME") or os.path.join(env("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                                          "huggingface")
    path = env("HF_HUB_CACHE") or env("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return os.path.expandvars(os.path.expanduser(path))


def offline() -> bool:
    return any(os.environ.get(k, "").upper() in ("1", "ON", "YES", "TRUE") for k in ("HF_HUB_OFFLINE",
                                                                                    "TRANSFORMERS_OFFLINE"))


def snapshot(family: str, name: str, revision: str | None = None) -> tuple[str, dict[str, str]]:
    """(the local snapshot directory of the Hub model `name` at `revision`, what to record of it: {"hub": name,
    "revision": its commit}); an ImportCheckpointError saying what is missing and where it was looked for."""
    try:
        from huggingface_hub import errors as hub_errors
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ImportCheckpointError(f"{name!r} is not a directory; importing it by its Hub name needs the "
                                    "huggingface_hub package", hint="pip install 'transduce[import]', or give the "
                                                                    "model's downloaded directory") from None
    files = FILES.get(family, OTHER)
    cache, local_only = cache_dir(), offline()
    where = f"the Hugging Face cache ({cache})"
    at = f" at revision {revision!r}" if revision else ""
    try:
        path = snapshot_download(name, revision=revision, cache_dir=cache, local_files_only=local_only,
                                 allow_patterns=files + SAFETENSORS)
        if family != "fairseq" and not any(os.path.exists(os.path.join(path, f)) for f in SAFETENSORS[:2]):
            path = snapshot_download(name, revision=revision, cache_dir=cache, local_files_only=local_only,
                                     allow_patterns=files + PICKLES)  # no safetensors: the pickled weights
    except hub_errors.LocalEntryNotFoundError:
        how = "HF_HUB_OFFLINE is set" if local_only else "the Hub cannot be reached"  # or the revision is absent
        raise ImportCheckpointError(
            f"{name!r} is not a local directory, and {name}{at} is not in {where}, and {how}",
            hint=("download it where HF_HUB_CACHE points (with network access, unset HF_HUB_OFFLINE), or point "
                  "HF_HUB_CACHE at the cache that holds it; or give the model's directory")) from None
    except hub_errors.RevisionNotFoundError:
        raise ImportCheckpointError(f"the Hub model {name} has no revision {revision!r}",
                                    hint="give a branch, tag or commit of the repository to --revision") from None
    except hub_errors.RepositoryNotFoundError:  # gated ones too
        raise ImportCheckpointError(f"{name!r} is neither a directory nor a model on the Hugging Face Hub that "
                                    "you can access", hint="check the name, or log in (hf auth login) for a "
                                                           "gated or private model") from None
    except (hub_errors.HfHubHTTPError, hub_errors.HFValidationError, OSError) as e:
        raise ImportCheckpointError(f"{name}{at} could not be fetched from the Hugging Face Hub "
                                    f"({type(e).__name__}: {e})", hint=f"check the name and {where}") from None
    return path, {"hub": name, "revision": os.path.basename(os.path.normpath(path))}
