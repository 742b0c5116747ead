"""Slurm: the multi-node settings a job already holds, so that one config runs on every node of an allocation.

    srun --ntasks-per-node=1 hangwatch run CONFIG

Each task of the step is one node's hangwatch.  With `worker.nnodes: auto`, or `worker.nnodes` not written
and the process inside a Slurm job, `load.py` asks `resolve` for what the job says (pure: the environment is
a mapping handed in, the host name a string), before the records validate anything:

    worker.nnodes         SLURM_STEP_NUM_NODES, else SLURM_NNODES, else SLURM_JOB_NUM_NODES
    worker.rdzv_endpoint  <first host of SLURM_STEP_NODELIST (else SLURM_NODELIST, SLURM_JOB_NODELIST)>:
                          <worker.rdzv_port>
    worker.rdzv_id        <SLURM_JOB_ID>.<SLURM_STEP_ID>
    worker.node_name      SLURMD_NODENAME, else the host name
    run dir               <run_dir>/node<SLURM_NODEID>

Each of the last four only when the job has more than one node and only where the config does not write it
(an explicit `worker.nnodes: N` turns all of this off: the config then says everything, as before).

Why the step's variables first: under `srun`, SLURM_JOB_NODELIST stays the allocation's, while the step may
run on fewer nodes (`srun -N2` in a 4-node job); the rendezvous host must be a node that runs a hangwatch.
srun also overwrites SLURM_NNODES and SLURM_NODELIST with the step's values (not under --preserve-env).

Why the step id in the rendezvous id: the id keys everything in the store (the generation, each node's
record, the agreed resume point) and torchrun's own rendezvous.  Two steps of one job that reach the same
endpoint (two `srun … &` whose node lists start with the same node, or a new step while the previous step's
supervisors still wind down and host the store) would otherwise join one another's generations.

Why the node's index in the run dir: the config sits on a shared filesystem in most allocations, so one
`run_dir` would be every node's; `node<SLURM_NODEID>` gives each its own, and the same one again when the job
is resubmitted onto other machines, so each node finds its record of the last good checkpoint.

Not derived: `worker.nproc_per_node`.  SLURM_GPUS_ON_NODE exists only when GPUs were requested through the
GPU options, counts what the job holds on the node rather than what the worker should run (the built-in
worker on CPUs has ranks without GPUs), and SLURM_NTASKS_PER_NODE is 1 here by construction.  A node whose
GPUs outnumber `nproc_per_node` gets a warning instead (`gpus_on_node`).

One hangwatch per node: a step that starts several tasks on a node (SLURM_STEP_TASKS_PER_NODE above 1, or
this task's SLURM_LOCALID above 0) is refused on every one of them.  SLURM_NTASKS_PER_NODE is not the test:
it is the job's request, inherited by every step and set only when --ntasks-per-node was given, so it does
not say how many tasks this step put on this node.

The node list is expanded by `expand_hostlist` (Slurm's compressed syntax) rather than `scontrol show
hostnames`: the config is loaded several times per start (validate, preflight, the worker), and a call to
the controller each time would buy nothing the syntax below does not already say.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional

AUTO = "auto"
DEFAULT_RDZV_PORT = 29400

JOB_ID = "SLURM_JOB_ID"
STEP_ID = "SLURM_STEP_ID"
NODE_COUNTS = ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
NODE_LISTS = ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
NODE_NAME = "SLURMD_NODENAME"
NODE_ID = "SLURM_NODEID"
LOCAL_ID = "SLURM_LOCALID"
STEP_TASKS = "SLURM_STEP_TASKS_PER_NODE"
GPUS_ON_NODE = "SLURM_GPUS_ON_NODE"

NNODES = ("worker", "nnodes")
Problem = tuple[tuple, str]  # (key path, what is wrong), as rules.Finding


class SlurmProblems(Exception):
    """What the job's environment cannot give; one (key path, message) per problem."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("; ".join(m for _, m in problems))


@dataclass(frozen=True)
class Derived:
    """What a Slurm job supplied.  `values`: worker keys → the value to use (only keys the config did not
    write); `sources`: the same keys → where each came from, in words; `run_subdir`: this node's directory
    under the config's run dir (multi-node only) and `subdir_source` where its name came from;
    `gpus_on_node`: SLURM_GPUS_ON_NODE, when it is a number."""

    job_id: str
    step_id: Optional[str]
    values: dict[str, Any]
    sources: dict[str, str]
    run_subdir: Optional[str] = None
    subdir_source: str = ""
    gpus_on_node: Optional[int] = None

    @property
    def nnodes(self) -> int:
        return int(self.values["nnodes"])


# ---- the hostlist syntax ---------------------------------------------------------------------------


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list → host names, in order: `node[01-03,07],gpu-a[1-2]` → node01 node02 node03
    node07 gpu-a1 gpu-a2.  A range keeps the width of its low bound (`[08-10]` → 08 09 10, `[8-10]` → 8 9 10);
    several bracket groups in one name multiply (`r[1-2]n[1-2]` → r1n1 r1n2 r2n1 r2n2).  ValueError on
    anything else (an unclosed bracket, a range that runs backwards, a letter in a range)."""
    return list(iter_hostlist(text))


def first_host(text: str) -> str:
    """The first host of a compressed host list, without expanding the rest."""
    for host in iter_hostlist(text):
        return host
    raise ValueError("no host in it")


def iter_hostlist(text: str) -> Iterator[str]:
    for entry in _split_top(text.strip()):
        if entry:
            yield from _expand_entry(entry)


def _split_top(text: str) -> list[str]:
    """Split on the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            if depth:
                raise ValueError(f"a bracket inside a bracket at character {i + 1}")
            depth = 1
        elif ch == "]":
            if not depth:
                raise ValueError(f"a ']' without its '[' at character {i + 1}")
            depth = 0
        elif ch == "," and not depth:
            parts.append(text[start:i].strip())
            start = i + 1
    if depth:
        raise ValueError("a '[' that is never closed")
    parts.append(text[start:].strip())
    return parts


RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _expand_entry(entry: str) -> Iterator[str]:
    pieces = re.split(r"\[([^\]]*)\]", entry)  # literal, group, literal, group, …, literal
    literals, groups = pieces[0::2], [_ranges(g) for g in pieces[1::2]]  # every group checked before the first name

    def build(i: int, prefix: str) -> Iterator[str]:
        if i == len(groups):
            yield prefix + literals[i]
            return
        for number in _numbers(groups[i]):
            yield from build(i + 1, prefix + literals[i] + number)

    yield from build(0, "")


def _ranges(group: str) -> list[tuple[int, int, int]]:
    """`01-04,07` → [(1, 4, 2), (7, 7, 2)]: (low, high, width of the low bound)."""
    if not group.strip():
        raise ValueError("an empty '[]'")
    out = []
    for item in group.split(","):
        m = RANGE.match(item.strip())
        if not m:
            raise ValueError(f"{item.strip()!r} in '[{group}]' is not a number or a range N-M")
        low, high = m.group(1), m.group(2) or m.group(1)
        if int(high) < int(low):
            raise ValueError(f"the range {low}-{high} runs backwards")
        out.append((int(low), int(high), len(low)))
    return out


def _numbers(ranges: list[tuple[int, int, int]]) -> Iterator[str]:
    for low, high, width in ranges:  # lazily: a range of a million nodes costs nothing until it is walked
        for n in range(low, high + 1):
            yield f"{n:0{width}d}"


# ---- what the job says -----------------------------------------------------------------------------


def in_slurm(env: Mapping[str, str]) -> bool:
    """A Slurm job: SLURM_JOB_ID and a node count are set."""
    return bool(env.get(JOB_ID)) and any(env.get(k) for k in NODE_COUNTS)


def missing_words(env: Mapping[str, str]) -> str:
    """Which of the variables that make a Slurm job are not set, in words."""
    missing = [] if env.get(JOB_ID) else [f"{JOB_ID} is not set"]
    if not any(env.get(k) for k in NODE_COUNTS):
        missing.append(f"none of {', '.join(NODE_COUNTS)} is set")
    return "; ".join(missing)


def written(section: Mapping[str, Any], key: str) -> bool:
    """A key the config gives a value (null is the default of those that may be null: not a value)."""
    return section.get(key) is not None


def resolve(worker: Mapping[str, Any], env: Mapping[str, str], hostname: str) -> Optional[Derived]:
    """What the Slurm job supplies to the worker section `worker` (as written in the file); None when Slurm has no
    say (`nnodes` written as a number, or not written outside a job).  Raises SlurmProblems."""
    nnodes = worker.get("nnodes")
    if nnodes is not None and nnodes != AUTO:
        return None  # a number (or a mistake the record will name): the config's word
    if not in_slurm(env):
        if nnodes == AUTO:
            raise SlurmProblems(
                [
                    (
                        NNODES,
                        f"auto takes the node count from Slurm, but this process is not in a Slurm "
                        f"job ({missing_words(env)}): run it as an srun task inside an "
                        "allocation, or write the number of nodes (1 on a single machine)",
                    )
                ]
            )
        return None
    job = env[JOB_ID]
    count_key = next(k for k in NODE_COUNTS if env.get(k))
    count = _positive(env[count_key])
    if count is None:
        raise SlurmProblems([(NNODES, f"{count_key}={env[count_key]!r} is not a node count")])
    problems = _one_task_per_node(env)
    step = env.get(STEP_ID) or None
    if count > 1 and step is None:
        problems.append(
            (
                NNODES,
                f"Slurm job {job} has {count} nodes ({count_key}), but this process is not an srun "
                f"task ({STEP_ID} not set): it runs on this node only and the other {count - 1} start "
                "no hangwatch; start it on every node with `srun --ntasks-per-node=1 hangwatch run "
                "CONFIG`, or write worker.nnodes: 1 to train on this node alone",
            )
        )
    if problems:
        raise SlurmProblems(problems)
    values: dict[str, Any] = {"nnodes": count}
    sources = {"nnodes": count_key}
    gpus = _positive(env.get(GPUS_ON_NODE) or "")
    if count == 1:  # one node: no peers to meet, nothing else to name
        return Derived(job, step, values, sources, gpus_on_node=gpus)
    if not written(worker, "rdzv_endpoint"):
        list_key = next((k for k in NODE_LISTS if env.get(k)), None)
        if list_key is None:
            raise SlurmProblems(
                [
                    (
                        ("worker", "rdzv_endpoint"),
                        f"no node list to take the rendezvous host from ({', '.join(NODE_LISTS)} not set): write it",
                    )
                ]
            )
        try:
            host = first_host(env[list_key])
        except ValueError as exc:
            raise SlurmProblems(
                [
                    (
                        ("worker", "rdzv_endpoint"),
                        f"{list_key}={env[list_key]!r} is not a Slurm host list ({exc}): write the endpoint",
                    )
                ]
            ) from None
        port = worker.get("rdzv_port")
        port = port if isinstance(port, int) and not isinstance(port, bool) else DEFAULT_RDZV_PORT
        values["rdzv_endpoint"] = f"{host}:{port}"
        sources["rdzv_endpoint"] = f"the first node of {list_key}, port worker.rdzv_port"
    if not written(worker, "rdzv_id"):
        values["rdzv_id"] = f"{job}.{step}"
        sources["rdzv_id"] = f"{JOB_ID}.{STEP_ID}"
    if not written(worker, "node_name"):
        values["node_name"] = env.get(NODE_NAME) or hostname
        sources["node_name"] = NODE_NAME if env.get(NODE_NAME) else "the host name"
    index = env.get(NODE_ID)
    if index and index.isdigit():
        subdir, subdir_source = f"node{index}", NODE_ID
    else:
        subdir, subdir_source = _safe_dir(str(values.get("node_name") or worker.get("node_name"))), "the node name"
    return Derived(job, step, values, sources, run_subdir=subdir, subdir_source=subdir_source, gpus_on_node=gpus)


def _one_task_per_node(env: Mapping[str, str]) -> list[Problem]:
    fix = (
        "each task would be a hangwatch of its own, and one per node starts that node's worker.nproc_per_node "
        "ranks itself: use `srun --ntasks-per-node=1`"
    )
    per_node = env.get(STEP_TASKS)
    counts = _task_counts(per_node) if per_node else []
    if counts and max(counts) > 1:
        return [(NNODES, f"this srun step puts {max(counts)} tasks on a node ({STEP_TASKS}={per_node}): {fix}")]
    local = env.get(LOCAL_ID)
    if local and local.isdigit() and int(local) > 0:
        return [(NNODES, f"this is task {local} on its node ({LOCAL_ID}={local}): {fix}")]
    return []


TASK_COUNT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def _task_counts(text: str) -> list[int]:
    """SLURM_STEP_TASKS_PER_NODE (`2(x3),1`) → the distinct per-node counts; [] when it is not that syntax."""
    out = []
    for item in text.split(","):
        m = TASK_COUNT.match(item.strip())
        if not m:
            return []
        out.append(int(m.group(1)))
    return out


def _positive(text: str) -> Optional[int]:
    text = text.strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def _safe_dir(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "-" for c in name).strip(".-") or "node"


def gpu_advice(derived: Optional[Derived], nproc_per_node: int) -> list[Problem]:
    """A node with more GPUs of the job than ranks per node: said, never changed (see the module's doc)."""
    if derived is None or derived.gpus_on_node is None or derived.gpus_on_node <= nproc_per_node:
        return []
    return [
        (
            ("worker", "nproc_per_node"),
            f"{nproc_per_node}, but Slurm gave this node {derived.gpus_on_node} GPUs "
            f"({GPUS_ON_NODE}): {derived.gpus_on_node - nproc_per_node} would sit idle; "
            f"write worker.nproc_per_node: {derived.gpus_on_node} to use them all",
        )
    ]


def describe(derived: Derived, run_dir: Optional[str] = None) -> str:
    """One line of what came from the job: `Slurm job 4242 step 0: worker.nnodes 2 (SLURM_STEP_NUM_NODES), …`."""
    head = f"Slurm job {derived.job_id}" + (f" step {derived.step_id}" if derived.step_id is not None else "")
    parts = [f"worker.{k} {v} ({derived.sources[k]})" for k, v in derived.values.items()]
    if run_dir is not None and derived.run_subdir:
        parts.append(f"run dir {run_dir} ({derived.run_subdir} after the config's run_dir: {derived.subdir_source})")
    return f"{head}: " + ", ".join(parts)
