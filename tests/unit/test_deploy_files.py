"""Deployment files: the Kubernetes manifests parse and hold what the deployment relies on, the liveness
probe tells a running worker from a gone one. The Slurm job script runs against a real Slurm
(`tests/integration/test_slurm.py`); its static checks are in `tests/unit/test_slurm_files.py`."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from infra.k8s.liveness import alive, process_state, runs_module
from trainguard.spec import NODE_ID_PATTERN

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "infra" / "k8s"
IMAGE = "ghcr.io/your-org/trainguard:0.1.0"
SETTINGS = {"TRAINGUARD_TEMPORAL_ADDRESS", "TRAINGUARD_NAMESPACE", "TRAINGUARD_S3_ENDPOINT", "AWS_REGION",
            "TRAINGUARD_S3_PATH_STYLE"}
MANIFESTS = sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")
CONTROLLER = "trainguard-controller"
"""The controller's ServiceAccount; each release's Deployment is `trainguard-controller-<release>`."""
RELEASE_LABEL = "trainguard.io/release"
RELEASE_PATTERN = r"[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?"
"""A release is part of the Deployment's name (lowercase DNS characters) and a label value (63 at most)."""

# ------------------------------------------------------------------------- manifests: plain-text checks


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.relative_to(K8S).as_posix())
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


def yaml_documents(path: Path, kind: str) -> list[dict[str, Any]]:
    yaml = pytest.importorskip("yaml")
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None and doc["kind"] == kind]


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
    controller = find(objects, "Deployment", CONTROLLER)
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
    # Its build is its release, read from the pod label the release's kustomization sets (no copy to drift).
    assert env_of(container)["TRAINGUARD_BUILD_ID"] == {
        "fieldRef": {"fieldPath": f"metadata.labels['{RELEASE_LABEL}']"}}


def release_of(root: Path) -> dict[str, str]:
    """Where a release is written: the image tag, the controller Deployment's name suffix and its release label."""
    yaml = pytest.importorskip("yaml")
    top = yaml.safe_load((root / "kustomization.yaml").read_text())
    controller = yaml.safe_load((root / "controller" / "kustomization.yaml").read_text())
    (image,) = top["images"]
    (labels,) = controller["labels"]
    return {"image tag": str(image["newTag"]), "name suffix": controller["nameSuffix"].removeprefix("-"),
            "release label": labels["pairs"][RELEASE_LABEL]}


def test_release_is_written_the_same_everywhere() -> None:
    yaml = pytest.importorskip("yaml")
    release = release_of(K8S)
    controller = yaml.safe_load((K8S / "controller" / "kustomization.yaml").read_text())

    assert len(set(release.values())) == 1, f"the release drifted: {release}"
    assert re.fullmatch(RELEASE_PATTERN, release["image tag"]), release
    assert controller["nameSuffix"] == f"-{release['image tag']}"
    # The release joins the selector too: two releases' Deployments then never claim each other's pods.
    assert controller["labels"][0]["includeSelectors"] is True
    assert controller["resources"] == ["deployment.yaml"]  # the ServiceAccount stays release-free, outside


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


def set_release(root: Path, release: str) -> None:
    """The edit a new release makes (docs/operations/upgrades.md): the image tag and the controller's release."""
    top, controller = root / "kustomization.yaml", root / "controller" / "kustomization.yaml"
    top.write_text(re.sub(r"newTag: \S+", f"newTag: {release}", top.read_text()))
    text = re.sub(r"nameSuffix: \S+", f"nameSuffix: -{release}", controller.read_text())
    controller.write_text(re.sub(rf"{re.escape(RELEASE_LABEL)}: \S+", f'{RELEASE_LABEL}: "{release}"', text))


def render(root: Path) -> list[dict[str, Any]]:
    yaml = pytest.importorskip("yaml")
    rendered = subprocess.run(["kubectl", "kustomize", str(root)], capture_output=True, text=True, timeout=60,
                              check=False)
    assert rendered.returncode == 0, rendered.stderr
    return [doc for doc in yaml.safe_load_all(rendered.stdout) if doc is not None]


def controller_of(rendered: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = [o for o in rendered if o["kind"] == "Deployment"]
    return deployment


def selects(deployment: dict[str, Any], pod_labels: dict[str, str]) -> bool:
    return deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")


@needs_kubectl
def test_kustomize_renders_a_controller_of_the_release() -> None:
    rendered = render(K8S)
    release = release_of(K8S)["image tag"]
    controller = controller_of(rendered)
    (container,) = pod_spec(controller)["containers"]
    pod_labels = controller["spec"]["template"]["metadata"]["labels"]
    account = find(rendered, "ServiceAccount")["metadata"]["name"]
    (binding,) = yaml_documents(K8S / "scheduler-hook-rbac.yaml", "ClusterRoleBinding")

    assert [o["kind"] for o in rendered] == ["Namespace", "ServiceAccount", "ConfigMap", "Deployment", "DaemonSet"]
    assert controller["metadata"]["name"] == f"{CONTROLLER}-{release}"
    assert controller["spec"]["selector"]["matchLabels"][RELEASE_LABEL] == release
    assert selects(controller, pod_labels) and pod_labels[RELEASE_LABEL] == release
    # The build id is the pod's release label (kubelet resolves the reference when the container starts).
    assert env_of(container)["TRAINGUARD_BUILD_ID"] == {
        "fieldRef": {"fieldPath": f"metadata.labels['{RELEASE_LABEL}']"}}
    assert container["image"].rsplit(":", 1)[1] == release
    # The ServiceAccount (and the scheduler hook's binding to it) outlives every release.
    assert account == CONTROLLER == pod_spec(controller)["serviceAccountName"]
    assert binding["subjects"][0]["name"] == account


@needs_kubectl
def test_a_new_release_renders_a_controller_beside_the_old_one(tmp_path: Path) -> None:
    """`kubectl apply -k` of the next release creates its controller and updates the rest in place: the old
    controller keeps its pods until it is deleted."""
    shutil.copytree(K8S, tmp_path / "k8s", ignore=shutil.ignore_patterns("__pycache__"))
    set_release(tmp_path / "k8s", "0.2.0")
    old, new = render(K8S), render(tmp_path / "k8s")
    old_controller, new_controller = controller_of(old), controller_of(new)

    assert set(release_of(tmp_path / "k8s").values()) == {"0.2.0"}
    assert new_controller["metadata"]["name"] == f"{CONTROLLER}-0.2.0" != old_controller["metadata"]["name"]
    assert not selects(new_controller, old_controller["spec"]["template"]["metadata"]["labels"])
    assert not selects(old_controller, new_controller["spec"]["template"]["metadata"]["labels"])
    assert pod_spec(new_controller)["containers"][0]["image"].endswith(":0.2.0")
    # Everything else keeps its name (and the DaemonSet its selector, which Kubernetes never lets change).
    shared = [(o["kind"], o["metadata"]["name"]) for o in old if o["kind"] != "Deployment"]
    assert shared == [(o["kind"], o["metadata"]["name"]) for o in new if o["kind"] != "Deployment"]
    assert find(new, "DaemonSet")["spec"]["selector"] == find(old, "DaemonSet")["spec"]["selector"]


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
