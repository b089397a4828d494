"""One exception hierarchy for everything transduce reports to a user.

Every error a user can cause (bad input, a missing or tampered file, an artifact built by
another version) is a `TransduceError` whose message says what was wrong and what to do.
The CLI prints the message without a traceback and exits with status 2. `assert` is used
only for internal invariants.
"""

from __future__ import annotations


class TransduceError(Exception):
    """Base class. `hint` (optional) is the action that fixes the problem."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint

    def __str__(self) -> str:
        msg = super().__str__()
        return f"{msg}\n  hint: {self.hint}" if self.hint else msg


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


class TransduceWarning(UserWarning):
    """Base class of the warnings transduce gives (the work goes on; the CLI prints them on stderr)."""


class TruncatedInput(TransduceWarning):
    """A line longer than the model takes was cut to its first tokens (truncate=True, --truncate).
    `line`: its number in the input, so that a CLI can print it beside that line's other messages."""

    def __init__(self, message: str, line: int):
        super().__init__(message, line)  # both in args: it pickles and copies
        self.line = line

    def __str__(self) -> str:
        return str(self.args[0])
