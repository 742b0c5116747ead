"""Errors no restart can cure, on any rank: configuration (78), data (65), disk (74).

A single worker process says it with its own exit code.  Under torchrun the rank's code is lost: torchrun
exits 1 whatever its failed rank exited with, and a restart policy that read only that 1 would restart a
configuration error for ever.  The ranks say it in their last words (`exit.json`, `exit-rank<R>.json`: `kind`,
`message`, `exit_code`), and torchrun says which rank failed first and with which exit code in its root-cause
report (`episode.kernel_evidence.torchrun_root_cause`).  `no_retry_code` reads all three, in that order of trust:

    the worker's own exit code 78/65/74        that code (a single process; the words of a rank that said the same)
    a rank's last words with a do-not-restart  that rank's code and message — the rank torchrun names first when it
      exit code or kind (not a victim's)         is one of them, else the lowest
    torchrun's root cause exited 78/65/74      that rank and code, when the rank left no last words
      (not by a signal)

Exit 0 is never a failure, whatever was written.  Pure: the caller reads the files and the log.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Optional

from hangwatch.common.exitcodes import EXIT_CONFIG, EXIT_DATAERR, EXIT_IOERR, NO_RESTART_CODES

# The last words' kinds that mean the same as the codes (`daemon.lastwords.classify` writes both; a script of
# one's own may write only the kind).  `checkpoint_failed` is not here: it is a disk error only when its
# exit_code says 74.
KIND_CODES = {
    "config_error": EXIT_CONFIG,
    "config": EXIT_CONFIG,
    "data_error": EXIT_DATAERR,
    "data": EXIT_DATAERR,
    "disk": EXIT_IOERR,
}
CODE_NAMES = {EXIT_CONFIG: "EX_CONFIG", EXIT_DATAERR: "EX_DATAERR", EXIT_IOERR: "EX_IOERR"}


class NoRetry(NamedTuple):
    code: int  # 78, 65 or 74: what the run ends with
    rank: Optional[int]  # the rank that failed so; None: the worker's own code, no rank said it
    message: str  # the rank's own words, or what torchrun's report says of it


def words_code(words: Mapping) -> Optional[int]:
    """The do-not-restart code a rank's last words carry (their `exit_code`, else their `kind`'s), or None: another
    failure, or a victim (`collective_error`: its collective broke because a peer failed)."""
    if words.get("collective_error"):
        return None
    code = words.get("exit_code")
    if isinstance(code, int) and not isinstance(code, bool) and code in NO_RESTART_CODES:
        return code
    return KIND_CODES.get(str(words.get("kind") or ""))


def words_message(words: Mapping, code: int) -> str:
    return str(words.get("message") or words.get("kind") or f"exit {code} ({CODE_NAMES[code]})")


def no_retry_code(
    code: Optional[int], last_words_by_rank: Mapping[int, Mapping], root_cause: Optional[Mapping]
) -> Optional[NoRetry]:
    """(code, rank, message) of a do-not-restart error on any rank, or None (restart as the policy says).

    `code`: the worker's exit code (None: ended by a signal); `last_words_by_rank`: {rank: its last words};
    `root_cause`: torchrun's report (`rank`, `exitcode`, `signal`, `exception`), None when the log holds none."""
    if code == 0:
        return None
    said = {r: c for r, w in last_words_by_rank.items() if (c := words_code(w)) is not None}
    if code in NO_RESTART_CODES:
        rank = min((r for r, c in said.items() if c == code), default=None)
        words = last_words_by_rank[rank] if rank is not None else {}
        return NoRetry(code, rank, words_message(words, code))
    if said:
        first = root_cause.get("rank") if root_cause else None
        rank = first if first in said else min(said)
        return NoRetry(said[rank], rank, words_message(last_words_by_rank[rank], said[rank]))
    if not root_cause or root_cause.get("signal") or root_cause.get("rank") is None:
        return None
    rank, failed = root_cause["rank"], root_cause.get("exitcode")
    if failed not in NO_RESTART_CODES or rank in last_words_by_rank:
        return None  # a rank's own last words outrank the launcher's account of it
    exc = root_cause.get("exception")
    return NoRetry(
        failed,
        rank,
        f"exit {failed} ({CODE_NAMES[failed]}) per torchrun's root-cause report, no last words"
        + (f"; the log's last exception: {exc}" if exc else ""),
    )
