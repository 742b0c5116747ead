"""Shared pieces of the inbox tests: a JSONL validator, a killing file-operations seam, a simulated
training loop, and a command-line entry point so the kill tests can run them in a real child
process that SIGKILLs itself at a chosen operation.

    python tests/test_inbox_support.py intake RUN_DIR KILL_AT MODE ON_BAD_LINES
    python tests/test_inbox_support.py train  RUN_DIR KILL_AT MODE
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from daemon.inbox import ContinuousSource, Inbox  # noqa: E402
from daemon.inbox_files import FsOps, Stage, data_files  # noqa: E402

MAX_CHARS = 200


def validator(path):
    """{"prompt", "completion"} per line; blank lines skipped; examples carry their line."""
    examples, problems = [], []
    with open(path, encoding="utf-8") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw.rstrip("\n"))
            except ValueError as exc:
                problems.append({"line": lineno, "error": f"not JSON: {exc.msg} (column {exc.colno})"})
                continue
            if not isinstance(obj, dict):
                problems.append({"line": lineno, "error": f"expected a JSON object, got {type(obj).__name__}"})
                continue
            missing = [k for k in ("prompt", "completion") if not isinstance(obj.get(k), str)]
            if missing:
                problems.append({"line": lineno, "error": "missing field(s): " + ", ".join(missing)})
                continue
            size = len(obj["prompt"]) + len(obj["completion"])
            if size > MAX_CHARS:
                problems.append({"line": lineno, "error": f"example too long: {size} characters > {MAX_CHARS}"})
                continue
            examples.append({"line": lineno, "prompt": obj["prompt"], "completion": obj["completion"]})
    return examples, problems


def jsonl(n: int, tag: str) -> str:
    return "".join(json.dumps({"prompt": f"{tag} q{i}", "completion": f"{tag} a{i}"}) + "\n" for i in range(n))


def write(path: Path, data, mtime_age: float = 0.0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    path.write_bytes(data)
    if mtime_age:
        t = time.time() - mtime_age
        os.utime(path, (t, t))
    return path


class CountingOps(FsOps):
    """Counts mutating operations; at operation `kill_at` SIGKILLs this process.

    mode "before": dies before the operation; "torn": an append or atomic write gets half its
    bytes to disk first (a torn ledger line, a leftover temporary), then the process dies.
    """

    def __init__(self, kill_at: int = 0, mode: str = "before"):
        self.n = 0
        self.kinds: list[str] = []
        self.kill_at = kill_at
        self.mode = mode

    def _tick(self, kind: str) -> bool:
        self.n += 1
        self.kinds.append(kind)
        return self.n == self.kill_at

    @staticmethod
    def _die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10)

    def rename(self, src, dst):
        if self._tick("rename"):
            self._die()
        super().rename(src, dst)

    def write_file(self, path, data, durable=True):
        if self._tick("write_file"):
            if self.mode == "torn":
                path.with_name(f".tmp-{path.name}-torn").write_bytes(data[: len(data) // 2])
            self._die()
        super().write_file(path, data, durable)

    def append(self, path, data):
        if self._tick("append"):
            if self.mode == "torn":
                FsOps.append(self, path, data[: max(1, len(data) // 2 - 3)])
            self._die()
        super().append(path, data)

    def truncate(self, path, size):
        if self._tick("truncate"):
            self._die()
        super().truncate(path, size)

    def unlink(self, path):
        if self._tick("unlink"):
            self._die()
        super().unlink(path)


# --------------------------------------------------------------------------------------------
# A training loop without a model: the "weights" are the list of examples trained so far, saved
# in an atomically replaced checkpoint together with the source's position.


def sim_train(run_dir: Path, ops: FsOps, *, batch: int = 2, replay_ratio: float = 0.3, seed: int = 1) -> dict:
    ckpt = run_dir / "ckpt.json"
    state = json.loads(ckpt.read_text()) if ckpt.exists() else {"step": 0, "position": None, "trained": []}
    src = ContinuousSource(run_dir, validator, replay_ratio=replay_ratio, seed=seed, ops=ops)
    src.restore(state["position"], state["step"])
    while True:
        items = src.next_batch(batch)
        if not items:
            return state
        state = {"step": state["step"] + 1, "position": src.position(),
                 "trained": state["trained"] + [[it.id, it.replay] for it in items]}
        tmp = ckpt.with_name("ckpt.json.tmp")
        with open(tmp, "w") as f:
            json.dump(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, ckpt)
        src.commit(state["position"], state["step"])


def sim_intake(run_dir: Path, ops: FsOps, on_bad_lines: str) -> None:
    inbox = Inbox(run_dir, validator, on_bad_lines=on_bad_lines, ops=ops, settle_s=0)
    for name in sorted(os.listdir(Stage.INBOX.dir(run_dir))):
        if not name.startswith("."):
            inbox.intake(name)


def where(run_dir: Path) -> dict[str, list[str]]:
    """Content (first 40 bytes) → the stages holding a file with that content."""
    places: dict[str, list[str]] = {}
    for stage in Stage:
        d = stage.dir(run_dir)
        if not d.is_dir():
            continue
        for name in os.listdir(d):
            if name.startswith(".") or name.endswith(".json") or name in ("ledger.jsonl", "replay.jsonl"):
                continue
            places.setdefault((d / name).read_bytes()[:40].decode("utf-8", "replace"), []).append(stage.value)
    return places


def queued_names(run_dir: Path) -> list[str]:
    return [d.name for d in data_files(run_dir, Stage.QUEUED)]


if __name__ == "__main__":
    what, run_dir, kill_at, mode = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    ops = CountingOps(kill_at, mode)
    if what == "intake":
        sim_intake(run_dir, ops, sys.argv[5])
    else:
        sim_train(run_dir, ops)
    print(json.dumps(ops.kinds))
