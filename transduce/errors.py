"""One exception hierarchy for everything transduce reports to a user.

Every error a user can cause (bad input, a missing or tampered file, an artifact built by
another version) is a `TransduceError` whose message says what was wrong and what to do.
The CLI prints the message without a traceback and exits with status 2. `assert` is used
only for internal invariants.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping


def spell(text: str, params: Iterable[str], names: Mapping[str, str]) -> str:
    """`text` with each of `params` that `names` has written as `names` says, as a whole word ("min_length"
    in "min_length must be", not in "min_lengths"), where it first appears: a message names a parameter once,
    and a later use of the word is prose ("precision fp16: ... runs the precision of its export"); the others
    as they are."""
    for param in params:
        if param in names:
            pattern = re.compile(r"(?<![\w.-])" + re.escape(param) + r"(?![\w=])")
            text = pattern.sub(lambda _, new=names[param]: new, text, count=1)
    return text


class TransduceError(Exception):
    """Base class. `hint` (optional) is the action that fixes the problem.

    `params`: the parameters the message and hint name, each as Python spells it ("min_length",
    "truncate=True"). The library writes a message once, in those names; a command line prints it with
    its own spelling of each (`spelled`: "--min-length", "--truncate").

    `mirrored`: this is a copy of the same error another process reports (a training run on several
    processes: each rank raises rank 0's), which the command line exits with but does not print again."""

    mirrored = False

    def __init__(self, message: str, hint: str | None = None, *, params: Iterable[str] = ()):
        super().__init__(message)
        self.hint = hint
        self.params = tuple(params)

    def __str__(self) -> str:
        return self.spelled({})

    def spelled(self, names: Mapping[str, str]) -> str:
        """The message and hint with the parameters spelled as `names` says (see spell)."""
        msg = spell(super().__str__(), self.params, names)
        return f"{msg}\n  hint: {spell(self.hint, self.params, names)}" if self.hint else msg


class ConfigError(TransduceError):
    """An invalid model or run configuration."""


class DataError(TransduceError):
    """A corpus or input file that cannot be used."""


class CheckpointError(TransduceError):
    """A model directory that is missing, truncated, tampered or inconsistent."""


class ExportError(TransduceError):
    """Export failed, or the exported graphs failed validation."""


class ArtifactError(TransduceError):
    """An exported artifact or engine directory that the runtime must refuse."""


class BackendUnavailable(TransduceError):
    """A backend whose framework (onnxruntime, tensorrt, CUDA) is not installed here."""


class InputError(TransduceError):
    """Text given to the decoder that cannot be translated as asked."""


class ParityError(TransduceError):
    """A parity check that could not run (not a parity failure: that is a report)."""


class EngineError(TransduceError):
    """TensorRT engine building or loading failed."""


class TrainingDiverged(TransduceError):
    """The training loss became NaN or infinite; the last checkpoint is kept as it was."""


class DistributedError(TransduceError):
    """A training run on several processes (ranks) lost one of them: it ended, hung past the collectives'
    timeout, or could not be reached; the last checkpoint is kept as it was."""


class TransduceWarning(UserWarning):
    """Base class of the warnings transduce gives (the work goes on; the CLI prints them on stderr).
    `params`: as TransduceError's."""

    def __init__(self, message: str, *args, params: Iterable[str] = ()):
        super().__init__(message, *args)
        self.params = tuple(params)

    def spelled(self, names: Mapping[str, str]) -> str:
        return spell(str(self), self.params, names)


class TruncatedInput(TransduceWarning):
    """A line longer than the model takes was cut to its first tokens (truncate=True, --truncate).
    `line`: its number in the input, so that a CLI can print it beside that line's other messages."""

    def __init__(self, message: str, line: int):
        super().__init__(message, line)  # both in args: it pickles and copies
        self.line = line

    def __str__(self) -> str:
        return str(self.args[0])


class ImportCheckpointError(TransduceError):
    """A pretrained checkpoint (Marian, FSMT, fairseq) that cannot be imported: unsafe, incomplete, or not
    the architecture the reference model can be."""
