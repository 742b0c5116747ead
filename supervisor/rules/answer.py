"""What a decider answers when the episode's decision is asked (once, when the tree is gone): a value, never an act.

An `Answer` carries the decision it replaces the one so far with (or None: it keeps it), the fields it adds to the
episode's incident, the files it wants written (`Write`: a path and its bytes) and, where it writes, what it answers
instead should the disk refuse (`refused`, handed the error).  A decider computes all of it and writes nothing; one
owner (`concerns.decide`) writes the files through the run's `FsOps`, amends the incident once, and sets the decision.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from hangwatch.supervisor.rules.policy import Decision


@dataclass(frozen=True)
class Write:
    """A file a decider wants on disk, whole (written durably, replacing what was there)."""

    path: Path
    data: bytes

    @classmethod
    def json(cls, path: Path, record: dict) -> "Write":
        """A JSON record, indented by 2 as the run dir's records always were."""
        return cls(Path(path), (json.dumps(record, indent=2, default=str) + "\n").encode())


@dataclass(frozen=True)
class Answer:
    """A decider's answer: `decision` (None: the decision so far stands), `fields` for the incident, `writes` to make
    before the decision holds, `kind` the incident is renamed to (what the evidence showed: a victim's), and
    `refused(exc)`: the answer instead when a write is refused (its decision, its fields; it writes nothing)."""

    decision: Optional[Decision] = None
    fields: dict = field(default_factory=dict)
    writes: tuple[Write, ...] = ()
    kind: Optional[str] = None
    refused: Optional[Callable[[OSError], "Answer"]] = None
