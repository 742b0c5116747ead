"""Which Python processes of a worker tree are ranks: pure functions of a command line and an environment.

A rank writes a heartbeat (`heartbeat-rank<R>.jsonl`); every other Python process of the tree only gets a
stack-dump handler of its own (`stack-rank<R>-pid<PID>.txt`), so the supervisor can still see where it is.

    launcher   torchrun / `python -m torch.distributed.run|launch`, `accelerate` (and `trl`, which runs
               `accelerate launch`), `deepspeed`: they start the ranks, they are none.  A launcher also drops
               any rank claim it inherited, so the ranks it starts are judged afresh.
    helper     a multiprocessing spawn or forkserver child (a DataLoader worker under `spawn`, a resource
               tracker), torch inductor's compile workers: they work for a rank.
    inherited  a Python descendant of a process that already claimed this same rank and trained (a subprocess of
               the training script, inductor's pool when it inherits RANK): the rank is taken.  A claim whose
               process has not stepped an optimizer yet is *open*: a script or module it starts (`python
               train.py` run by a wrapper script, a CLI that runs the trainer in a child) takes the rank over.
    own        hangwatch itself (`python -m hangwatch…`, the `hangwatch` CLI): the built-in worker beats by itself.
    rank       everything else: the worker's top Python process (no RANK: rank 0) and each launcher's rank.

The rank a process stands for: RANK when set (torchrun, accelerate, deepspeed); else LOCAL_RANK when the
launcher says no more than that on a single node (Lightning's own DDP launcher starts its ranks with
LOCAL_RANK only); else 0.

Claims travel in the environment: a rank puts `HANGWATCH_RANK_CLAIM=<rank>:<pid>:<open|held>:<heartbeat dir>`
into its own `os.environ`, which every child inherits; at its first optimizer step it turns `open` into `held`.
A child that stands for the same rank in the same heartbeat directory is `inherited` — unless the claim is
still open and the child runs a script or a module (not `-c` code), which then takes the rank over (the
supervisor follows the newest `start` of a rank, and goes back to an older process of it whose lines go on
when the newer one is gone).  One standing for another rank (a launcher's rank, RANK=1 under a rank 0) is a
rank of its own.  A process that exec'd itself keeps its pid and stays the rank.

Standard library only; nothing here reads the process's own state except `command_line()`.
"""

from __future__ import annotations

import os
import sys
from typing import List, Mapping, MutableMapping, NamedTuple, Optional, Sequence

from hangwatch.common.instrumentation import ENV_RANK_CLAIM

ENV_CLAIM = ENV_RANK_CLAIM

RANK = "rank"
LAUNCHER = "launcher"
HELPER = "helper"
INHERITED = "inherited"
OWN = "own"

LAUNCHER_MODULES = frozenset(
    {
        "torch.distributed.run",
        "torch.distributed.launch",
        "accelerate.commands.launch",
        "accelerate.commands.accelerate_cli",
        "deepspeed.launcher.runner",
        "deepspeed.launcher.launch",
        "trl.cli",
    }
)
LAUNCHER_SCRIPTS = frozenset({"torchrun", "accelerate", "accelerate-launch", "deepspeed", "trl"})
HELPER_MODULE_PREFIXES = ("multiprocessing.", "torch._inductor.")
OWN_SCRIPTS = frozenset({"hangwatch"})

# Interpreter options that take the next word as their value (`python -W ignore -X dev script.py`).
_OPTIONS_WITH_VALUE = frozenset({"-W", "-X", "--check-hash-based-pycs"})


class Command(NamedTuple):
    """What an interpreter command line runs: a module (`-m`), code (`-c`), a script, or none of them
    (an interactive interpreter, stdin); `args` follow it."""

    module: Optional[str] = None
    code: Optional[str] = None
    script: Optional[str] = None
    args: tuple = ()


class Role(NamedTuple):
    kind: str  # RANK, LAUNCHER, HELPER, INHERITED or OWN
    rank: int  # the rank the process stands for (its dump file is named after it)
    why: str  # one phrase, for the record


def command_line() -> List[str]:
    """This interpreter's own command line, interpreter first.  `sys.orig_argv` (3.10+) is the true one: while
    sitecustomize runs, `sys.argv` is still `['-m', …]` for `python -m pkg` (the module name not there yet).
    Before 3.10, Linux's /proc/self/cmdline says the same; elsewhere `sys.argv`, shifted to look alike."""
    orig = getattr(sys, "orig_argv", None)
    if orig:
        return list(orig)
    try:
        with open("/proc/self/cmdline", "rb") as f:
            raw = f.read()
        words = [w.decode(errors="surrogateescape") for w in raw.split(b"\0")]
        if words and words[-1] == "":
            words.pop()
        if words:
            return words
    except OSError:
        pass
    argv = list(getattr(sys, "argv", None) or [])
    return [sys.executable or "python"] + argv


def parse_command(argv: Sequence[str]) -> Command:
    """The Command of an interpreter command line (argv[0] is the interpreter)."""
    i = 1
    n = len(argv)
    while i < n:
        word = argv[i]
        if word == "--":
            return Command(script=argv[i + 1], args=tuple(argv[i + 2 :])) if i + 1 < n else Command()
        if word == "-":
            return Command(args=tuple(argv[i + 1 :]))
        if word in _OPTIONS_WITH_VALUE:
            i += 2
            continue
        if word.startswith("--"):
            i += 1
            continue
        if word.startswith("-") and len(word) > 1:
            # Short options, possibly bundled (`-uB`), `-m`/`-c` taking the rest of the word or the next one,
            # `-W`/`-X` likewise (`-Wd`).
            for j in range(1, len(word)):
                flag = word[j]
                rest = word[j + 1 :]
                if flag in "mc":
                    if rest:
                        value, after = rest, i + 1
                    elif i + 1 < n:
                        value, after = argv[i + 1], i + 2
                    else:
                        return Command()
                    if flag == "m":
                        return Command(module=value, args=tuple(argv[after:]))
                    return Command(code=value, args=tuple(argv[after:]))
                if flag in "WX":
                    if not rest:
                        i += 1  # its value is the next word
                    break
            i += 1
            continue
        return Command(script=word, args=tuple(argv[i + 1 :]))
    return Command()


def effective_rank(env: Mapping[str, str]) -> int:
    """The rank this process stands for (see the module's docstring)."""
    value = env.get("RANK")
    if value not in (None, ""):
        try:
            return int(value)
        except ValueError:
            return 0
    local = env.get("LOCAL_RANK")
    if local not in (None, "") and env.get("NODE_RANK", "0") in ("", "0") and env.get("GROUP_RANK", "0") in ("", "0"):
        try:
            return int(local)
        except ValueError:
            return 0
    return 0


OPEN, HELD = "open", "held"


class Claim(NamedTuple):
    rank: int
    pid: int
    directory: str
    held: bool  # the claimant stepped an optimizer: its children never take the rank over


def parse_claim(value: Optional[str]) -> Optional[Claim]:
    """The claim in `value`, None when there is none or it cannot be read."""
    if not value:
        return None
    parts = value.split(":", 3)
    if len(parts) != 4 or parts[2] not in (OPEN, HELD):
        return None
    try:
        return Claim(int(parts[0]), int(parts[1]), parts[3], parts[2] == HELD)
    except ValueError:
        return None


def format_claim(rank: int, pid: int, directory: str, held: bool = False) -> str:
    return "%d:%d:%s:%s" % (rank, pid, HELD if held else OPEN, directory)


def is_launcher(cmd: Command) -> bool:
    if cmd.module is not None:
        return cmd.module in LAUNCHER_MODULES
    if cmd.script is not None:
        return os.path.basename(cmd.script) in LAUNCHER_SCRIPTS
    return False


def is_helper(cmd: Command, argv: Sequence[str]) -> bool:
    """A process that works for a rank: multiprocessing's children (spawn_main, forkserver, resource tracker)
    and torch inductor's compile workers."""
    if "--multiprocessing-fork" in argv:
        return True
    if cmd.module is not None and cmd.module.startswith(HELPER_MODULE_PREFIXES):
        return True
    if (
        cmd.code is not None
        and "multiprocessing" in cmd.code
        and any(word in cmd.code for word in ("spawn_main", "forkserver", "resource_tracker", "semaphore_tracker"))
    ):
        return True
    return False


def is_own(cmd: Command) -> bool:
    if cmd.module is not None:
        return cmd.module == "hangwatch" or cmd.module.startswith("hangwatch.")
    return cmd.script is not None and os.path.basename(cmd.script) in OWN_SCRIPTS


def decide(env: Mapping[str, str], argv: Sequence[str], heartbeat_dir: str, pid: int) -> Role:
    """The role of the process that runs `argv` with environment `env` and pid `pid`, whose heartbeats go to
    `heartbeat_dir`."""
    cmd = parse_command(argv)
    rank = effective_rank(env)
    if is_own(cmd):
        return Role(OWN, rank, "hangwatch's own program")
    if is_launcher(cmd):
        return Role(LAUNCHER, rank, "a launcher (%s)" % (cmd.module or os.path.basename(cmd.script or "")))
    if is_helper(cmd, argv):
        return Role(HELPER, rank, "a helper process of a rank")
    claim = parse_claim(env.get(ENV_CLAIM))
    if claim is not None and claim.rank == rank and claim.directory == heartbeat_dir and claim.pid != pid:
        if claim.held or (cmd.script is None and cmd.module is None):
            return Role(INHERITED, rank, "rank %d is claimed by process %d" % (rank, claim.pid))
        return Role(RANK, rank, "rank %d, taken over from process %d, which had not trained" % (rank, claim.pid))
    return Role(RANK, rank, "rank %d" % rank)


def claim(env: MutableMapping[str, str], rank: int, pid: int, heartbeat_dir: str, held: bool = False) -> None:
    env[ENV_CLAIM] = format_claim(rank, pid, heartbeat_dir, held)


def release_claim(env: MutableMapping[str, str]) -> None:
    env.pop(ENV_CLAIM, None)


__all__ = [
    "Command",
    "Role",
    "Claim",
    "ENV_CLAIM",
    "RANK",
    "LAUNCHER",
    "HELPER",
    "INHERITED",
    "OWN",
    "command_line",
    "parse_command",
    "effective_rank",
    "decide",
    "claim",
    "release_claim",
    "parse_claim",
    "format_claim",
]
