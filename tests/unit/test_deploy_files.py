"""Deployment files: the Kubernetes manifests parse and hold what the deployment relies on, the liveness
probe tells a running worker from a gone one, and the Slurm batch script drives stand-ins for srun,
scontrol and the trainguard CLI through a whole job, cleanup included."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from infra.k8s.liveness import alive, process_state, runs_module
from infra.slurm.slurm_job import build_spec, not_ready
from trainguard.models import PoolNode
from trainguard.spec import NODE_ID_PATTERN, SpecError

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "infra" / "k8s"
SLURM = REPO / "infra" / "slurm"
IMAGE = "ghcr.io/your-org/trainguard:0.1.0"
SETTINGS = {"TRAINGUARD_TEMPORAL_ADDRESS", "TRAINGUARD_NAMESPACE", "TRAINGUARD_S3_ENDPOINT", "AWS_REGION",
            "TRAINGUARD_S3_PATH_STYLE"}
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")

# ------------------------------------------------------------------------- manifests: plain-text checks


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_text(path: Path) -> None:
    text = path.read_text()
    assert "\t" not in text, "YAML forbids tabs for indentation"
    assert not re.search(r"privileged:\s*true", text)
    for document in filter(str.strip, re.split(r"^---\s*$", text, flags=re.MULTILINE)):
        for field in ("apiVersion:", "kind:", "metadata:", "  name:"):
            assert re.search(rf"^{field}", document, flags=re.MULTILINE), f"{path.name}: a document lacks {field}"


def test_one_image_everywhere() -> None:
    images = {m for p in MANIFESTS for m in re.findall(r"image:\s*(\S+)", p.read_text())}
    assert images == {IMAGE}
    assert f"-t {IMAGE}" in (K8S / "Dockerfile").read_text()


def test_dockerfile() -> None:
    dockerfile = (K8S / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim$", dockerfile, flags=re.MULTILINE)
    assert re.search(r"^USER 10001", dockerfile, flags=re.MULTILINE)
    assert '"/usr/bin/tini", "--"' in dockerfile
    assert ".venv" in (K8S / "Dockerfile.dockerignore").read_text().split()


# --------------------------------------------------------------------------- manifests: parsed objects


@pytest.fixture(scope="module")
def objects() -> list[dict[str, Any]]:
    yaml = pytest.importorskip("yaml")
    docs: list[dict[str, Any]] = []
    for path in MANIFESTS:
        docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    return docs


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod_spec(workload)
    return [*spec.get("initContainers", []), *spec["containers"]]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_every_object_is_named_and_typed(objects: list[dict[str, Any]]) -> None:
    for obj in objects:
        assert isinstance(obj.get("apiVersion"), str) and obj["apiVersion"]
        assert isinstance(obj.get("kind"), str) and obj["kind"]
        assert isinstance(obj.get("metadata", {}).get("name"), str) and obj["metadata"]["name"]
    kinds = {o["kind"] for o in objects}
    assert kinds >= {"Namespace", "ConfigMap", "Secret", "ServiceAccount", "Deployment", "DaemonSet",
                     "ClusterRole", "ClusterRoleBinding"}


def test_namespaced_objects_live_in_the_namespace(objects: list[dict[str, Any]]) -> None:
    namespace = find(objects, "Namespace")["metadata"]["name"]
    for obj in objects:
        if obj["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding"):
            assert obj["metadata"].get("namespace") == namespace, obj["metadata"]["name"]


def test_config_map_has_every_setting(objects: list[dict[str, Any]]) -> None:
    data = find(objects, "ConfigMap")["data"]

    assert SETTINGS <= set(data)
    assert data["TRAINGUARD_SCHEDULER"] == "none"
    assert all(isinstance(v, str) for v in data.values())
    assert not any("SECRET" in k or "ACCESS_KEY" in k for k in data)


def test_secret_is_a_marked_template_left_out_of_kustomize(objects: list[dict[str, Any]]) -> None:
    yaml = pytest.importorskip("yaml")
    secret = find(objects, "Secret")

    assert set(secret["stringData"]) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    assert all(v.startswith("REPLACE-ME") for v in secret["stringData"].values())
    resources = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert all((K8S / r).exists() for r in resources)
    assert not any("s3-credentials" in r or "rbac" in r for r in resources)


RANK_USER_CAPABILITIES = {"SETUID", "SETGID", "CHOWN", "KILL", "DAC_OVERRIDE", "FOWNER"}
"""What the node agent needs to start ranks as another user (`--run-as`) and mind them; nothing else has any."""


def test_no_container_is_privileged(objects: list[dict[str, Any]]) -> None:
    for workload in (o for o in objects if o["kind"] in ("Deployment", "DaemonSet")):
        pod = pod_spec(workload)
        agent = workload["metadata"]["name"] == "trainguard-node-agent"
        assert pod["securityContext"]["runAsNonRoot"] is not agent
        for container in containers(workload):
            context = container["securityContext"]
            assert context.get("privileged", False) is False, container["name"]
            assert context["allowPrivilegeEscalation"] is False, container["name"]
            assert context["capabilities"]["drop"] == ["ALL"], container["name"]
            allowed = RANK_USER_CAPABILITIES if agent else {"CHOWN"}
            assert set(context["capabilities"].get("add", [])) <= allowed, container["name"]
        for container in pod["containers"]:
            assert (pod["securityContext"]["runAsUser"] == 0) is agent
            assert "runAsUser" not in container["securityContext"]
            assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_node_agent_runs_ranks_as_the_images_rank_user(objects: list[dict[str, Any]]) -> None:
    """Root only to start ranks as another user: the image has that user, the agent is told to use it."""
    agent = find(objects, "DaemonSet", "trainguard-node-agent")
    (container,) = pod_spec(agent)["containers"]
    user = env_of(container)["TRAINGUARD_RUN_AS"]
    assert re.search(rf"useradd --uid (?!0 )\d+ .*\b{user}$", (K8S / "Dockerfile").read_text(), flags=re.MULTILINE)
    assert set(container["securityContext"]["capabilities"]["add"]) == RANK_USER_CAPABILITIES


def test_controller(objects: list[dict[str, Any]]) -> None:
    controller = find(objects, "Deployment", "trainguard-controller")
    (container,) = pod_spec(controller)["containers"]

    assert container["args"] == ["python", "-m", "workers.controller"]
    assert container["image"] == IMAGE
    assert container["livenessProbe"]["exec"]["command"][-1] == "workers.controller"
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    assert "memory" in container["resources"]["limits"]
    assert {"configMapRef": {"name": "trainguard-config"}} in container["envFrom"]
    assert pod_spec(controller)["serviceAccountName"] == find(objects, "ServiceAccount")["metadata"]["name"]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert "/tmp" in mounts  # the only writable place on a read-only root


def test_node_agent_daemonset(objects: list[dict[str, Any]]) -> None:
    agent = find(objects, "DaemonSet", "trainguard-node-agent")
    pod = pod_spec(agent)
    (container,) = pod["containers"]
    args, env = container["args"], env_of(container)

    assert args[:3] == ["python", "-m", "workers.node_agent"]
    assert args[args.index("--node") + 1] == "$(NODE_NAME)"
    assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert args[args.index("--host") + 1] == "$(POD_IP)"
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert pod["hostNetwork"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod["automountServiceAccountToken"] is False
    assert env["TRAINGUARD_ALLOWED_ENTRYPOINTS"] and env["TRAINGUARD_CHAOS"] == "off"
    # The peer tier's secret comes from a Secret, never a value in the manifest (optional: no peer tier).
    assert env["TRAINGUARD_PEER_TOKEN"] == {"secretKeyRef": {"name": "trainguard-peer",
                                                             "key": "TRAINGUARD_PEER_TOKEN", "optional": True}}
    # The workdir is a host directory, mounted where --workdir points.
    workdir = args[args.index("--workdir") + 1]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == workdir]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["hostPath"]["path"] == workdir
    # GPU nodes only, and the GPUs it needs in limits (extended resources are never overcommitted).
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert "nvidia.com/gpu" not in container["resources"].get("requests", {})


def test_scheduler_hook_rbac_is_minimal(objects: list[dict[str, Any]]) -> None:
    role = find(objects, "ClusterRole")
    binding = find(objects, "ClusterRoleBinding")
    account = find(objects, "ServiceAccount")

    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": account["metadata"]["namespace"]}]
    assert not any(o["kind"] in ("Role", "RoleBinding") for o in objects)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kustomize_renders() -> None:
    rendered = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60,
                              check=False)

    assert rendered.returncode == 0, rendered.stderr
    assert re.findall(r"^kind: (\w+)", rendered.stdout, flags=re.MULTILINE) == [
        "Namespace", "ServiceAccount", "ConfigMap", "Deployment", "DaemonSet"]


def test_documented_node_id_pattern_is_trainguards() -> None:
    readme = (REPO / "infra" / "README.md").read_text()
    agent = (K8S / "node-agent.yaml").read_text()
    pattern = NODE_ID_PATTERN

    assert f"`{pattern}`" in readme
    assert pattern in agent


# ---------------------------------------------------------------------------------------- liveness


def test_liveness_matches_python_dash_m_only() -> None:
    assert runs_module(b"python\0-m\0workers.controller\0", "workers.controller")
    assert runs_module(b"/usr/local/bin/python3.11\0-m\0workers.node_agent\0--node\0n\0", "workers.node_agent")
    assert not runs_module(b"/usr/bin/tini\0--\0python\0-m\0workers.controller\0", "workers.controller")
    assert not runs_module(b"python\0/app/infra/k8s/liveness.py\0workers.controller\0", "workers.controller")
    assert not runs_module(b"python\0-m\0workers.node_agent\0", "workers.controller")


def test_process_state_survives_odd_names() -> None:
    assert process_state("42 (python) S 1 42") == "S"
    assert process_state("42 (we) ird) Z 1 42") == "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_liveness_sees_a_running_module_and_a_stopped_one(tmp_path: Path) -> None:
    (tmp_path / "tg_fake_worker.py").write_text("import time\ntime.sleep(60)\n")
    assert not alive("tg_fake_worker")
    worker = subprocess.Popen([sys.executable, "-m", "tg_fake_worker"], cwd=tmp_path)
    try:
        deadline = time.monotonic() + 10
        while not alive("tg_fake_worker") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert alive("tg_fake_worker")
        worker.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while alive("tg_fake_worker") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive("tg_fake_worker")
    finally:
        worker.kill()
        worker.wait()


# -------------------------------------------------------------------------------------- slurm helper

TEMPLATE = json.loads((SLURM / "spec.template.json").read_text())


def test_slurm_template_is_a_valid_spec_once_filled() -> None:
    spec = build_spec(TEMPLATE, ["gpu-01"], entrypoint=["python", "train.py"])

    assert spec.nodes == ["gpu-01"]
    assert "nodes" not in TEMPLATE and "entrypoint" not in TEMPLATE


def test_build_spec_fills_nodes_spares_and_entrypoint() -> None:
    spec = build_spec(TEMPLATE, ["GPU-01", "gpu-02", "gpu-03"], num_spares=1,
                      entrypoint=["python", "train.py", "--steps", "10"], ranks_per_node=4)

    assert spec.nodes == ["gpu-01", "gpu-02"]
    assert spec.spare_nodes == ["gpu-03"]
    assert spec.entrypoint == ["python", "train.py", "--steps", "10"]
    assert spec.ranks_per_node == 4
    assert spec.checkpoint.every_steps == TEMPLATE["checkpoint"]["every_steps"]


@pytest.mark.parametrize(
    ("hosts", "spares", "entrypoint", "message"),
    [
        pytest.param(["gpu-01"], 0, None, "entrypoint", id="no-entrypoint"),
        pytest.param(["gpu-01"], 1, ["python"], "no node to train on", id="all-spares"),
        pytest.param([], 0, ["python"], "no nodes", id="no-nodes"),
        pytest.param(["gpu_01"], 0, ["python"], "item 0 .gpu_01. is not a node id", id="bad-node-id"),
    ],
)
def test_build_spec_refuses(hosts: list[str], spares: int, entrypoint: list[str] | None, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        build_spec(TEMPLATE, hosts, spares, entrypoint)


def test_not_ready_needs_a_poller_and_a_fresh_registration() -> None:
    pool = [PoolNode(node="a", registered_at=1000.0), PoolNode(node="b", registered_at=1000.0),
            PoolNode(node="c", registered_at=10.0)]

    # b polls no more; c registered in an earlier job; d never registered.
    assert not_ready(["a", "b", "c", "d"], pool, missing=["b"], since=1000.0) == ["b", "c", "d"]
    assert not_ready(["a"], pool, missing=[], since=1003.0) == []  # within the clock slack


# --------------------------------------------------------------------------------------- the sbatch

STAND_IN_SRUN = """\
#!{python}
# srun: record the options, run the command as the task of each node (SLURMD_NODENAME set), forward TERM.
import json, os, signal, subprocess, sys
args = sys.argv[1:]
split = next(i for i, a in enumerate(args) if not a.startswith("-"))
with open(os.environ["CALLS"], "a") as f:
    f.write(json.dumps(["srun", *args[:split]]) + "\\n")
tasks, stopping = [], []
signal.signal(signal.SIGTERM, lambda *_: stopping.append([t.terminate() for t in tasks]))
tasks += [subprocess.Popen(args[split:], env={{**os.environ, "SLURMD_NODENAME": host}})
          for host in os.environ["FAKE_HOSTS"].split()]
if stopping:
    [t.terminate() for t in tasks]
sys.exit(max(t.wait() for t in tasks))
"""

STAND_IN_SCONTROL = """\
#!/bin/sh
[ "$1 $2" = "show hostnames" ] && [ "$3" = "$SLURM_JOB_NODELIST" ] || exit 9
for host in $FAKE_HOSTS; do echo "$host"; done
"""

STAND_IN_TRAINGUARD = """\
#!{python}
# trainguard CLI: record the call; `run result` prints a result, or fails when FAKE_RESULT_FAILS is set.
import json, os, sys, time
with open(os.environ["CALLS"], "a") as f:
    f.write(json.dumps(["trainguard", *sys.argv[1:]]) + "\\n")
if sys.argv[1:3] == ["run", "result"]:
    time.sleep(float(os.environ.get("FAKE_RESULT_DELAY_S", "0")))
    if os.environ.get("FAKE_RESULT_FAILS"):
        sys.exit("trainguard: run failed: restart budget spent")
    print(json.dumps({{"workflow_id": sys.argv[3], "steps_completed": 10}}))
"""

STAND_IN_PYTHON = """\
#!/bin/sh
# The venv's python: a node agent records its arguments and runs until SIGTERM; `wait-agents` waits for
# every agent to have reported itself (no Temporal here); everything else (the spec helper) is real python.
if [ "$1 $2" = "-m workers.node_agent" ]; then
    shift 2
    trap 'echo "stopped $2" >>"$AGENTS"; exit 0' TERM  # before it reports itself: it is up from then on
    echo "agent $* allow=$TRAINGUARD_ALLOWED_ENTRYPOINTS chaos=$TRAINGUARD_CHAOS" \\
        "peer=$TRAINGUARD_PEER_TOKEN" >>"$AGENTS"
    [ -n "$FAKE_AGENT_DIES" ] && exit 3
    while :; do sleep 0.05; done
fi
if [ "$2" = "wait-agents" ]; then
    echo "wait $*" >>"$AGENTS"
    [ -n "$FAKE_AGENT_DIES" ] && exec sleep 30
    for _ in $(seq 200); do  # until every agent reported itself (at most 10 s)
        [ "$(grep -c '^agent ' "$AGENTS")" -eq "$(echo $FAKE_HOSTS | wc -w)" ] && exit 0
        sleep 0.05
    done
    exit 1
fi
exec {python} "$@"
"""


def _write(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def slurm_job(tmp_path: Path) -> dict[str, Any]:
    """Stand-ins for srun, scontrol, the venv's python and the trainguard CLI, and a job's environment."""
    bin_dir, venv_bin = tmp_path / "bin", tmp_path / "venv" / "bin"
    bin_dir.mkdir()
    venv_bin.mkdir(parents=True)
    _write(bin_dir / "srun", STAND_IN_SRUN.format(python=sys.executable))
    _write(bin_dir / "scontrol", STAND_IN_SCONTROL)
    _write(venv_bin / "python", STAND_IN_PYTHON.format(python=sys.executable))
    _write(venv_bin / "trainguard", STAND_IN_TRAINGUARD.format(python=sys.executable))
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "CALLS": str(tmp_path / "calls.jsonl"),
        "AGENTS": str(tmp_path / "agents.log"),
        "FAKE_HOSTS": "GPU-01 gpu-02",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "gpu-[01-02]",
        "SLURM_NNODES": "2",
        "SLURM_CPUS_ON_NODE": "64",
        "SLURM_SUBMIT_DIR": str(REPO),
        "TMPDIR": str(tmp_path / "node-tmp"),
        "TRAINGUARD_TEMPORAL_ADDRESS": "temporal.example:7233",
        "TRAINGUARD_PYTHON": str(venv_bin / "python"),
        "TRAINGUARD_CLI": str(venv_bin / "trainguard"),
        "TRAINGUARD_JOB_DIR": str(tmp_path / "job"),
        "TRAINGUARD_STOP_GRACE_S": "5",
    }
    return {"env": env, "tmp": tmp_path, "venv_bin": venv_bin}


def calls_of(job: dict[str, Any]) -> list[list[str]]:
    path = Path(job["env"]["CALLS"])
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def agents_log(job: dict[str, Any]) -> list[str]:
    path = Path(job["env"]["AGENTS"])
    return path.read_text().splitlines() if path.exists() else []


def run_sbatch(job: dict[str, Any], *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SLURM / "trainguard.sbatch"), *args], env={**job["env"], **env},
                          capture_output=True, text=True, timeout=60, check=False)


def test_sbatch_header_and_syntax() -> None:
    script = (SLURM / "trainguard.sbatch").read_text()

    assert subprocess.run(["bash", "-n", str(SLURM / "trainguard.sbatch")], check=False).returncode == 0
    assert re.search(r"^#SBATCH --ntasks-per-node=1$", script, flags=re.MULTILINE)
    assert "trap cleanup EXIT" in script


def test_sbatch_runs_a_job_end_to_end(slurm_job: dict[str, Any]) -> None:
    done = run_sbatch(slurm_job, "python", "examples/train.py", "--steps", "10")

    assert done.returncode == 0, done.stderr
    job_dir, tmp = Path(slurm_job["env"]["TRAINGUARD_JOB_DIR"]), slurm_job["tmp"]
    calls = calls_of(slurm_job)
    (srun,) = [c for c in calls if c[0] == "srun"]
    assert {"--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=64", "--mem=0"} <= set(srun)
    # One agent per node, named after its Slurm node name lowercased, in a per-job node-local workdir.
    agents = agents_log(slurm_job)
    for node in ("gpu-01", "gpu-02"):
        (line,) = [a for a in agents if a.startswith(f"agent --node {node} ")]
        assert f"--workdir {tmp}/node-tmp/trainguard-4242 --host " in line
        assert f"allow={slurm_job['venv_bin']} chaos=off" in line
    (wait,) = [a for a in agents if a.startswith("wait ")]
    assert wait.endswith(" gpu-01 gpu-02")
    # The agents of the job share one random peer token, and it goes nowhere near the spec.
    tokens = {a.rsplit("peer=", 1)[1] for a in agents if a.startswith("agent ")}
    assert len(tokens) == 1 and re.fullmatch(r"[0-9a-f]{64}", token := tokens.pop())
    assert token not in (Path(slurm_job["env"]["TRAINGUARD_JOB_DIR"]) / "spec.json").read_text()
    # The spec names the same nodes and the command line's entrypoint.
    spec = json.loads((job_dir / "spec.json").read_text())
    assert spec["nodes"] == ["gpu-01", "gpu-02"]
    assert spec["entrypoint"] == ["python", "examples/train.py", "--steps", "10"]
    assert [c for c in calls if c[0] == "trainguard"] == [
        ["trainguard", "run", "start", str(job_dir / "spec.json"), "--id", "slurm-4242"],
        ["trainguard", "run", "result", "slurm-4242"],
    ]
    assert json.loads((job_dir / "result.json").read_text())["steps_completed"] == 10
    # Cleanup stopped every agent (and cancelled nothing: the run had finished).
    assert sorted(a for a in agents if a.startswith("stopped")) == ["stopped gpu-01", "stopped gpu-02"]


def test_sbatch_takes_the_entrypoint_and_spares_from_the_environment(slurm_job: dict[str, Any]) -> None:
    done = run_sbatch(slurm_job, TRAINGUARD_ENTRYPOINT='["python", "train.py"]', TRAINGUARD_SPARES="1",
                      TRAINGUARD_RUN_ID="my-run")

    assert done.returncode == 0, done.stderr
    spec = json.loads((Path(slurm_job["env"]["TRAINGUARD_JOB_DIR"]) / "spec.json").read_text())
    assert (spec["nodes"], spec["spare_nodes"], spec["entrypoint"]) == (["gpu-01"], ["gpu-02"],
                                                                        ["python", "train.py"])
    assert ["trainguard", "run", "result", "my-run"] in calls_of(slurm_job)


def test_sbatch_fails_with_the_run_and_still_stops_the_agents(slurm_job: dict[str, Any]) -> None:
    done = run_sbatch(slurm_job, "python", "train.py", FAKE_RESULT_FAILS="1")

    assert done.returncode == 1
    assert "restart budget spent" in done.stderr
    assert not any(c[1:3] == ["run", "cancel"] for c in calls_of(slurm_job) if c[0] == "trainguard")
    assert sorted(a for a in agents_log(slurm_job) if a.startswith("stopped")) == ["stopped gpu-01",
                                                                                  "stopped gpu-02"]


def test_sbatch_refuses_a_bad_spec_before_starting_anything(slurm_job: dict[str, Any]) -> None:
    done = run_sbatch(slurm_job)  # no entrypoint anywhere

    assert done.returncode == 2
    assert "entrypoint" in done.stderr
    assert calls_of(slurm_job) == [] and agents_log(slurm_job) == []


def test_sbatch_gives_up_when_the_agents_die(slurm_job: dict[str, Any]) -> None:
    started = time.monotonic()
    done = run_sbatch(slurm_job, "python", "train.py", FAKE_AGENT_DIES="1")

    assert done.returncode == 1
    assert "node agents exited before they were all up" in done.stderr
    assert time.monotonic() - started < 20  # not the 30 s the wait would have taken
    assert not any(c[0] == "trainguard" for c in calls_of(slurm_job))


def test_sbatch_cancelled_mid_run_cancels_the_run_before_stopping_agents(slurm_job: dict[str, Any]) -> None:
    process = subprocess.Popen(["bash", str(SLURM / "trainguard.sbatch"), "python", "train.py"],
                               env={**slurm_job["env"], "FAKE_RESULT_DELAY_S": "30"},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while not any(c[1:3] == ["run", "result"] for c in calls_of(slurm_job)) and time.monotonic() < deadline:
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)  # scancel, or the time limit
        _, stderr = process.communicate(timeout=30)
    finally:
        process.kill()

    assert process.returncode == 143, stderr
    calls = [c for c in calls_of(slurm_job) if c[0] == "trainguard"]
    assert calls[-1] == ["trainguard", "run", "cancel", "slurm-4242"]
    assert sorted(a for a in agents_log(slurm_job) if a.startswith("stopped")) == ["stopped gpu-01",
                                                                                  "stopped gpu-02"]
    # The cancel came first: the log says so before the agents were stopped.
    assert stderr.index("cancelling run slurm-4242") < stderr.index("stopping node agents")
