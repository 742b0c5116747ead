"""torchrun's command line for a multi-node attempt (`worker.nnodes` > 1): torch's own launcher, only named here.

Every node's attempt is `python -m torch.distributed.run` with the c10d rendezvous:

    --nnodes N --nproc-per-node P --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id <rdzv_id>-g<gen>
    --rdzv-conf is_host=false,join_timeout=… --max-restarts M   then the script and its arguments

* `is_host=false`: the store at the endpoint is the one hangwatch's peer link hosts (`supervisor.peers`), which
  outlives torchrun's restarts; a torchrun that hosted it would take it down with it.
* `join_timeout`: torchrun waits at the rendezvous as long as hangwatch does; how long is too long is
  `worker.rdzv_timeout_s`, judged by the supervisor (`nodes.multi_node.MultiNode.overdue_wait`), which says
  who is missing.
* the generation in the id makes every coordinated restart a fresh rendezvous: a torchrun that ends with a
  failure closes its rendezvous for good (its `shutdown()`), so the same id could never be joined again.

The worker is the built-in daemon, a `python script.py …` / `python -m module …` command (the script runs under
torchrun), or a torchrun command line whose own rendezvous options (`--nnodes`, `--rdzv-*`, `--standalone`,
`--max-restarts`) hangwatch replaces.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hangwatch.common.config import Config

JOIN_TIMEOUT_S = 30 * 24 * 3600  # "as long as hangwatch waits": the supervisor's deadline decides
REPLACED = (
    "--nnodes",
    "--rdzv-backend",
    "--rdzv_backend",
    "--rdzv-endpoint",
    "--rdzv_endpoint",
    "--rdzv-id",
    "--rdzv_id",
    "--rdzv-conf",
    "--rdzv_conf",
    "--max-restarts",
    "--max_restarts",
    "--node-rank",
    "--node_rank",
    "--master-addr",
    "--master_addr",
    "--master-port",
    "--master_port",
)
FLAGS = frozenset({"--standalone", "--no-python", "--no_python", "-m", "--module", "--run-path", "--run_path"})
DROPPED_FLAGS = frozenset({"--standalone"})


def rendezvous_args(cfg: Config, rdzv_id: str) -> list[str]:
    w = cfg.worker
    return [
        "--nnodes",
        str(w.nnodes),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        str(w.rdzv_endpoint),
        "--rdzv-id",
        rdzv_id,
        "--rdzv-conf",
        f"is_host=false,join_timeout={JOIN_TIMEOUT_S}",
        "--max-restarts",
        str(w.max_restarts),
    ]


def split_torchrun(argv: list[str]) -> tuple[list[str], list[str], list[str]]:
    """A torchrun command line → (the launcher's words, its options, the script and its arguments)."""
    if Path(argv[0]).name == "torchrun":
        head, rest = argv[:1], argv[1:]
    else:  # python -m torch.distributed.run
        head, rest = argv[:3], argv[3:]
    opts: list[str] = []
    i = 0
    while i < len(rest):
        tok = rest[i]
        if not tok.startswith("-"):
            break
        if tok in FLAGS or "=" in tok:
            opts.append(tok)
            i += 1
        else:
            opts.extend(rest[i : i + 2])
            i += 2
    return head, opts, rest[i:]


def without_rendezvous(opts: list[str]) -> list[str]:
    """The user's torchrun options less those hangwatch sets for a multi-node attempt."""
    out: list[str] = []
    i = 0
    while i < len(opts):
        tok = opts[i]
        name = tok.split("=", 1)[0]
        if tok in DROPPED_FLAGS:
            i += 1
        elif name in REPLACED:
            i += 1 if "=" in tok else 2
        else:
            out.append(tok)
            i += 1
    return out


def multinode_argv(
    cfg: Config, config_path: Path, rdzv_id: str, torchrun_words: bool, python: str = sys.executable
) -> list[str]:
    """The attempt's command line under torchrun's c10d rendezvous; `torchrun_words`: `worker.command` is itself a
    torchrun command line."""
    launcher = [python, "-m", "torch.distributed.run"]
    rdzv = rendezvous_args(cfg, rdzv_id)
    command = cfg.worker.command
    nproc = ["--nproc-per-node", str(cfg.worker.nproc_per_node)]
    if not command:
        daemon = ["-m", "hangwatch.daemon", "--config", str(config_path), "--run-dir", str(cfg.run_dir)]
        return [*launcher, *rdzv, *nproc, *daemon]
    if torchrun_words:
        head, opts, script = split_torchrun(list(command))
        if head[0] in ("python", "python3"):
            head = [python, *head[1:]]
        kept = without_rendezvous(opts)
        has_nproc = any(o.split("=", 1)[0] in ("--nproc-per-node", "--nproc_per_node") for o in kept)
        return [*head, *rdzv, *([] if has_nproc else nproc), *kept, *script]
    # python script.py … / python -m module …: the script runs under torchrun
    rest = list(command[1:])
    return [*launcher, *rdzv, *nproc, *rest]
