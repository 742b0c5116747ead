"""Failures the worker turns into specific exit codes and last-words kinds.

Each carries what a user needs to fix it; `daemon.lastwords.classify` maps them (and any other
exception) to the `kind` recorded in exit.json and the process exit code (docs/operations.md, the CLI's exit codes).
"""

from __future__ import annotations


class DataError(Exception):
    """The data cannot train this run at all (exit 65: a restart would fail the same way)."""

    def __init__(self, message: str, problems: list | tuple = ()):
        self.problems = [str(p) for p in problems]
        super().__init__(message)


class NonFiniteStreak(Exception):
    """Too many non-finite steps in a row (exit 75: restart from the last good checkpoint)."""

    def __init__(self, streak: int, step: int):
        self.streak = streak
        self.step = step
        super().__init__(f"{streak} non-finite optimizer steps in a row after step {step}")


class DoesNotFit(Exception):
    """The device ran out of memory while the model was being loaded (exit 78: a restart would load the same model
    onto the same device).  `estimate`: the doctor's words on what the model needs, when they could be had."""

    def __init__(self, cause: BaseException, estimate: str = ""):
        self.cause, self.estimate = cause, estimate
        super().__init__(
            f"out of memory while loading the model: {cause}"
            + (f" — {estimate}" if estimate else "")
            + "; use a smaller model, model.load_in_4bit or model.dtype bfloat16, or a device with more memory"
        )


class CheckpointSaveError(Exception):
    """A checkpoint could not be written (exit 74 when the disk refused: a person must make room).

    The half-written temporary directory is already gone when this is raised; the last good
    checkpoint was never touched."""

    def __init__(self, step: int, root: str, cause: OSError):
        self.step, self.root, self.cause = step, root, cause
        super().__init__(f"checkpoint of step {step} could not be written under {root}: {cause}")
