"""examples/kubernetes/ holds together (docs/kubernetes.md): every YAML document there validates against Kubernetes'
own schemas — kubernetes-validate's bundled OpenAPI-derived JSON schemas, strict (an unknown field is an error), for
the oldest version the page asks for and a recent one; no cluster, no network — and says what the page says: the
pod failure policy keyed on `hangwatch run`'s exit codes, the liveness probe on the supervisor's socket, the grace
period above the config's, hangwatch's own config valid for the command the pod runs.

JobSet is a CRD whose schema the validator does not bundle: its Job template is validated as a batch/v1 Job, and
its own fields only against `JOBSET`, the field names and values of JobSet's v1alpha2 API written out below.
"""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from hangwatch.common.config import parse_config
from hangwatch.common.exitcodes import DO_NOT_RETRY, EXIT_TEMPFAIL

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "kubernetes"
# The oldest Kubernetes the page asks for (podFailurePolicy is GA from 1.31) and a recent one.
K8S_VERSIONS = ("1.31", "1.35")
MESSAGE_FILE = "/dev/termination-log"

_NAME = {"type": "string", "minLength": 1}
_NAMES = {"type": "array", "items": _NAME}
JOBSET = {  # JobSet v1alpha2's fields (its API's types): what the examples can use, nothing else
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "jobset.x-k8s.io/v1alpha2"},
        "kind": {"const": "JobSet"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["replicatedJobs"],
            "additionalProperties": False,
            "properties": {
                "replicatedJobs": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["name", "template"],
                        "additionalProperties": False,
                        "properties": {
                            "name": _NAME,
                            "groupName": _NAME,
                            "replicas": {"type": "integer", "minimum": 0},
                            "template": {"type": "object"},  # a batch/v1 JobTemplateSpec: checked as a Job
                            "dependsOn": {"type": "array"},
                        },
                    },
                },
                "network": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "enableDNSHostnames": {"type": "boolean"},
                        "subdomain": _NAME,
                        "publishNotReadyAddresses": {"type": "boolean"},
                    },
                },
                "successPolicy": {
                    "type": "object",
                    "required": ["operator"],
                    "additionalProperties": False,
                    "properties": {"operator": {"enum": ["All", "Any"]}, "targetReplicatedJobs": _NAMES},
                },
                "failurePolicy": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "maxRestarts": {"type": "integer", "minimum": 0},
                        "restartStrategy": {"enum": ["Recreate", "BlockingRecreate"]},
                        "rules": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["name", "action"],
                                "additionalProperties": False,
                                "properties": {
                                    "name": {"type": "string", "pattern": "^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"},
                                    "action": {
                                        "enum": ["FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts"]
                                    },
                                    "onJobFailureReasons": {
                                        "type": "array",
                                        "uniqueItems": True,
                                        "items": {
                                            "enum": [
                                                "BackoffLimitExceeded",
                                                "DeadlineExceeded",
                                                "FailedIndexes",
                                                "MaxFailedIndexesExceeded",
                                                "PodFailurePolicy",
                                            ]
                                        },
                                    },
                                    "onJobFailureMessagePatterns": _NAMES,
                                    "targetReplicatedJobs": _NAMES,
                                },
                            },
                        },
                    },
                },
                "startupPolicy": {
                    "type": "object",
                    "required": ["startupPolicyOrder"],
                    "additionalProperties": False,
                    "properties": {"startupPolicyOrder": {"enum": ["AnyOrder", "InOrder"]}},
                },
                "suspend": {"type": "boolean"},
                "coordinator": {"type": "object"},
                "managedBy": _NAME,
                "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
            },
        },
    },
}


def documents() -> list[tuple[str, dict]]:
    """(file #n, document) of every YAML document under examples/kubernetes/."""
    files = sorted(EXAMPLES.glob("*.yaml")) + sorted(EXAMPLES.glob("*.yml"))
    assert files, f"no manifests under {EXAMPLES}"
    out = []
    for path in files:
        for n, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is not None:
                out.append((f"{path.name} #{n}", doc))
    return out


def as_job(template: dict, name: str) -> dict:
    """A JobSet's replicated-job template (a JobTemplateSpec) as the Job the JobSet controller makes of it."""
    meta = {**copy.deepcopy(template.get("metadata") or {}), "name": name}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": copy.deepcopy(template["spec"])}


def validate(doc: dict, version: str) -> None:
    """Raises when `doc` is not valid for Kubernetes `version` (a JobSet: `JOBSET`, then each Job it makes)."""
    if doc.get("kind") == "JobSet":
        jsonschema.validate(doc, JOBSET, cls=jsonschema.Draft202012Validator)
        for rj in doc["spec"]["replicatedJobs"]:
            kubernetes_validate.validate(as_job(rj["template"], f"{doc['metadata']['name']}-{rj['name']}-0"), version,
                                         strict=True)  # fmt: skip
        return
    kubernetes_validate.validate(doc, version, strict=True)  # a kind without a bundled schema raises too


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_document_validates_against_the_kubernetes_schemas(version):
    kinds = set()
    for where, doc in documents():
        try:
            validate(doc, version)
        except (jsonschema.ValidationError, kubernetes_validate.utils.SchemaNotFoundError) as exc:
            pytest.fail(f"{where} ({doc.get('kind')}) is not valid for Kubernetes {version}: {exc}")
        kinds.add(doc["kind"])
    assert {"ConfigMap", "Service", "Job", "JobSet", "PersistentVolumeClaim"} <= kinds, kinds


def one(kind: str, name: str = "") -> dict:
    found = [d for _, d in documents() if d["kind"] == kind and (not name or d["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def broken(doc: dict, change) -> dict:
    doc = copy.deepcopy(doc)
    change(doc)
    return doc


def pod_of_job(job: dict) -> dict:
    return job["spec"]["template"]["spec"]


def set_type(doc):
    doc["spec"]["backoffLimit"] = "four"


def set_typo(doc):
    pod_of_job(doc)["containers"][0]["terminationMessagePolicyy"] = "File"


def set_no_action(doc):
    del doc["spec"]["podFailurePolicy"]["rules"][0]["action"]  # the schemas know no enums, but what is required


@pytest.mark.parametrize(
    "change", [set_type, set_typo, set_no_action], ids=["wrong type", "unknown field", "missing field"]
)
def test_a_job_broken_on_purpose_is_rejected(change):
    with pytest.raises(jsonschema.ValidationError):
        validate(broken(one("Job"), change), K8S_VERSIONS[0])


def jobset_action(doc):
    doc["spec"]["failurePolicy"]["rules"][0]["action"] = "FailJob"  # a Job's action, not a JobSet's


def jobset_template(doc):
    doc["spec"]["replicatedJobs"][0]["template"]["spec"]["completions"] = "2"


@pytest.mark.parametrize("change", [jobset_action, jobset_template], ids=["its own field", "its Job template"])
def test_a_jobset_broken_on_purpose_is_rejected(change):
    with pytest.raises(jsonschema.ValidationError):
        validate(broken(one("JobSet"), change), K8S_VERSIONS[0])


# ---- what the page says the manifests do ---------------------------------------------------------------------------


def jobs() -> list[tuple[dict, dict, dict]]:
    """(the Job — a JobSet's as the Job it makes —, the JobSet or None, hangwatch's config for its pods)."""
    out = []
    for kind in ("Job", "JobSet"):
        top = one(kind)
        job = as_job(top["spec"]["replicatedJobs"][0]["template"], "x") if kind == "JobSet" else top
        volumes = {v["name"]: v for v in pod_of_job(job)["volumes"]}
        config_map = one("ConfigMap", volumes["config"]["configMap"]["name"])
        (text,) = config_map["data"].values()
        out.append((job, top if kind == "JobSet" else None, yaml.safe_load(text)))
    return out


@pytest.mark.parametrize("i", [0, 1], ids=["Job", "JobSet"])
def test_the_pod_failure_policy_is_keyed_on_the_exit_code_table(i):
    job, _, _ = jobs()[i]
    rules = job["spec"]["podFailurePolicy"]["rules"]
    container = pod_of_job(job)["containers"][0]["name"]
    by_code = [(r["action"], r["onExitCodes"]) for r in rules if "onExitCodes" in r]
    assert all(codes["containerName"] == container and codes["operator"] == "In" for _, codes in by_code)
    assert by_code[0][0] == "FailJob" and sorted(by_code[0][1]["values"]) == sorted(DO_NOT_RETRY)
    assert ("Ignore", [EXIT_TEMPFAIL]) in [(action, codes["values"]) for action, codes in by_code]
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules
    spec = pod_of_job(job)
    assert spec["restartPolicy"] == "Never" and job["spec"]["podReplacementPolicy"] == "Failed"


def test_the_jobset_fails_at_once_when_a_job_failed_by_its_pod_failure_policy():
    _, jobset, _ = jobs()[1]
    first = jobset["spec"]["failurePolicy"]["rules"][0]
    assert first["action"] == "FailJobSet" and first["onJobFailureReasons"] == ["PodFailurePolicy"]


@pytest.mark.parametrize("i", [0, 1], ids=["Job", "JobSet"])
def test_the_pod_runs_hangwatch_over_torchrun_one_pod_per_node_with_a_valid_config(i):
    job, jobset, data = jobs()[i]
    spec, container = pod_of_job(job), pod_of_job(job)["containers"][0]
    command = container["command"]
    assert command[:2] == ["hangwatch", "run"] and command[command.index("--") + 1] == "torchrun"
    run_dir = command[command.index("--run-dir") + 1]
    assert run_dir.endswith("/node$(JOB_COMPLETION_INDEX)")  # each node its own run dir on the shared volume
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == data["worker"]["nnodes"]
    # the rendezvous is pod 0's stable name in the headless Service
    if jobset is None:
        service, subdomain, pod0 = (
            one("Service")["metadata"]["name"],
            spec["subdomain"],
            f"{one('Job')['metadata']['name']}-0",
        )
        assert one("Service")["spec"]["clusterIP"] == "None"
    else:
        subdomain = service = jobset["spec"]["network"]["subdomain"]
        pod0 = f"{jobset['metadata']['name']}-{jobset['spec']['replicatedJobs'][0]['name']}-0-0"
    assert subdomain == service and data["worker"]["rdzv_endpoint"].startswith(f"{pod0}.{subdomain}.")
    # hangwatch's own loader takes the config with the command the pod runs
    data["worker"]["command"] = command[command.index("--") + 1 :]
    cfg = parse_config(yaml.safe_dump(data), source="examples/kubernetes", environ={})
    assert cfg.worker.nnodes > 1 and cfg.logging.termination_log == "auto"


@pytest.mark.parametrize("i", [0, 1], ids=["Job", "JobSet"])
def test_liveness_asks_the_supervisors_socket_and_the_grace_covers_the_configs(i):
    job, _, data = jobs()[i]
    spec, container = pod_of_job(job), pod_of_job(job)["containers"][0]
    probe = container["livenessProbe"]["exec"]["command"]
    assert probe[:2] == ["hangwatch", "status"] and probe[probe.index("--socket") + 1] == data["control"]["socket"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in volumes[mounts[str(Path(data["control"]["socket"]).parent)]]  # the pod's own, not shared
    assert spec["terminationGracePeriodSeconds"] > data["watchdog"]["term_grace_s"]
    assert container["terminationMessagePolicy"] == "File" and container["terminationMessagePath"] == MESSAGE_FILE
    assert "USR1" in " ".join(container["lifecycle"]["preStop"]["exec"]["command"])  # deleted: checkpoint, exit 75
