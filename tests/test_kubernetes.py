"""The Kubernetes manifests under deploy/kubernetes: each kustomization, rendered, is valid
against the Kubernetes API schemas (offline, strict: unknown fields refused) and says
what the README and the image promise (probes, an unprivileged read-only container,
memory limits, the token from a secret, a GPU in the GPU variant)."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest
import yaml

from service.api.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
KUBE = ROOT / "deploy" / "kubernetes"
VARIANTS = ("base", "gpu", "node-local")
# the oldest Kubernetes release still commonly run, and the newest the validator knows
VERSIONS = ("1.30.0", kubernetes_validate.utils.latest_version())

Doc = dict[str, Any]


def load_docs(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def render(directory: Path) -> list[Doc]:
    """The resources of a kustomization, as ``kubectl kustomize`` builds them: the
    subset these manifests use (resources, RFC 6902 patches with a target); anything
    else is refused so that this rendering cannot silently differ from kustomize's."""
    (kustomization,) = load_docs(directory / "kustomization.yaml")
    unknown = set(kustomization) - {"apiVersion", "kind", "resources", "patches"}
    assert not unknown, f"{directory}: render() does not handle {sorted(unknown)}"
    docs: list[Doc] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        docs.extend(render(path) if path.is_dir() else load_docs(path))
    for patch in kustomization.get("patches", []):
        assert set(patch) == {"path", "target"}, patch
        target = patch["target"]
        ops = jsonpatch.JsonPatch(yaml.safe_load((directory / patch["path"]).read_text()))
        hits = 0
        for i, doc in enumerate(docs):
            group, _, version = doc["apiVersion"].rpartition("/")
            if (
                doc["kind"] == target["kind"]
                and doc["metadata"]["name"] == target.get("name", doc["metadata"]["name"])
                and group == target.get("group", group)
                and version == target.get("version", version)
            ):
                docs[i] = ops.apply(doc)
                hits += 1
        assert hits == 1, f"{directory}: patch {patch['path']} matched {hits} resources"
    return docs


def by_key(docs: list[Doc]) -> dict[tuple[str, str], Doc]:
    out = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert len(out) == len(docs), "two resources with one kind and name"
    return out


def workload(docs: list[Doc]) -> Doc:
    (w,) = [d for d in docs if d["kind"] in ("Deployment", "DaemonSet")]
    return w


def container(w: Doc) -> Doc:
    (c,) = w["spec"]["template"]["spec"]["containers"]
    return c


def env(c: Doc) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c["env"]}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_resource_is_valid_against_the_kubernetes_schemas(variant: str, version: str) -> None:
    docs = render(KUBE / variant)
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("version", VERSIONS)
def test_the_secret_template_is_valid(version: str) -> None:
    (secret,) = load_docs(KUBE / "secret.example.yaml")
    kubernetes_validate.validate(secret, version, strict=True)


def test_the_validator_refuses_what_kubernetes_would() -> None:
    """The schemas are strict enough to catch a misspelt or mistyped field."""
    deployment = workload(render(KUBE / "base"))
    kubernetes_validate.validate(deployment, VERSIONS[0], strict=True)
    misspelt = copy.deepcopy(deployment)
    c = container(misspelt)
    c["readinesProbe"] = c.pop("readinessProbe")
    mistyped = copy.deepcopy(deployment)
    mistyped["spec"]["replicas"] = "one"
    no_image_port = copy.deepcopy(deployment)
    container(no_image_port)["ports"][0]["containerPort"] = "http"
    for bad in (misspelt, mistyped, no_image_port):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, VERSIONS[0], strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_rendering_is_kustomizes(variant: str) -> None:
    run = subprocess.run(
        ["kubectl", "kustomize", str(KUBE / variant)], capture_output=True, text=True, timeout=120, check=True
    )
    ours = by_key(render(KUBE / variant))
    theirs = by_key([d for d in yaml.safe_load_all(run.stdout) if d is not None])
    assert ours == theirs


@pytest.mark.parametrize("variant", VARIANTS)
def test_probes_security_and_resources(variant: str) -> None:
    w = workload(render(KUBE / variant))
    pod = w["spec"]["template"]["spec"]
    c = container(w)
    port_names = {p["name"]: p["containerPort"] for p in c["ports"]}
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz"), ("startupProbe", "/healthz")):
        get = c[probe]["httpGet"]
        assert get["path"] == path and get["port"] in port_names, probe
    # liveness never waits on models: a long preload must not get the pod restarted
    assert "/readyz" not in (c["livenessProbe"]["httpGet"]["path"], c["startupProbe"]["httpGet"]["path"])

    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["automountServiceAccountToken"] is False
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
    assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")

    res = c["resources"]
    assert res["requests"]["memory"] and res["requests"]["cpu"] and res["limits"]["memory"]

    # the only writable places are volumes: /tmp, as the image expects
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert {m["name"] for m in mounts.values()} <= set(volumes)
    assert "emptyDir" in volumes[mounts["/tmp"]["name"]]
    e = env(c)
    assert mounts[e["HOIST_MODELS_DIR"]]["readOnly"] is True


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_token_comes_from_the_secret_and_only_from_it(variant: str) -> None:
    docs = render(KUBE / variant)
    w = workload(docs)
    c = container(w)
    e = env(c)
    assert "HOIST_API_TOKEN" not in e, "a token in the environment is visible to anyone who can read the pod"
    assert not any(d["kind"] == "Secret" for d in docs), "a kustomization must not apply a token"
    (secret,) = load_docs(KUBE / "secret.example.yaml")
    token_file = Path(e["HOIST_API_TOKEN_FILE"])
    (mount,) = [m for m in c["volumeMounts"] if token_file.is_relative_to(m["mountPath"])]
    assert mount["readOnly"] is True
    (volume,) = [v for v in w["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    (item,) = volume["secret"]["items"]
    assert Path(mount["mountPath"]) / item["path"] == token_file
    assert set(secret["stringData"]) == {item["key"]}
    # readable by the pod's group only (fsGroup), not by others
    assert volume["secret"]["defaultMode"] & 0o007 == 0
    assert w["spec"]["template"]["spec"]["securityContext"]["fsGroup"] is not None


def test_the_secret_template_holds_no_token() -> None:
    (secret,) = load_docs(KUBE / "secret.example.yaml")
    assert "data" not in secret
    assert all(v.startswith("REPLACE-") for v in secret["stringData"].values())


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_manifests_match_the_image_and_the_settings(variant: str) -> None:
    from tests.test_docker import image_user, runtime_stage

    docs = render(KUBE / variant)
    w = workload(docs)
    pod = w["spec"]["template"]["spec"]
    c = container(w)
    uid, gid = image_user()
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == (uid, gid)
    exposed = {int(v.split("/")[0]) for word, v in runtime_stage() if word == "EXPOSE" for v in v.split()}
    assert {p["containerPort"] for p in c["ports"]} <= exposed
    # every HOIST_ variable is a setting (HOIST_PRELOAD: the preload setting, added beside this)
    known = {f"HOIST_{name.upper()}" for name in Settings.model_fields} | {"HOIST_PRELOAD"}
    assert set(env(c)) <= known
    assert all(not Path(m).is_absolute() and ".." not in Path(m).parts for m in env(c)["HOIST_PRELOAD"].split(","))

    (service,) = [d for d in docs if d["kind"] == "Service"]
    labels = w["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert w["spec"]["selector"]["matchLabels"].items() <= labels.items()
    port_names = {p["name"] for p in c["ports"]}
    assert all(p["targetPort"] in port_names for p in service["spec"]["ports"])


def test_the_base_serves_models_from_its_claim() -> None:
    docs = by_key(render(KUBE / "base"))
    deployment = docs[("Deployment", "hoist")]
    # two pods would hold the models twice while rolling
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    claim = volumes["models"]["persistentVolumeClaim"]
    assert claim["readOnly"] is True and ("PersistentVolumeClaim", claim["claimName"]) in docs


def test_the_gpu_variant_asks_for_one_gpu_and_the_cuda_image() -> None:
    base = workload(render(KUBE / "base"))
    gpu = workload(render(KUBE / "gpu"))
    c = container(gpu)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in container(base)["resources"]["limits"]
    assert c["image"].endswith(":cuda") and container(base)["image"] != c["image"]
    tolerations = gpu["spec"]["template"]["spec"]["tolerations"]
    assert any(t["key"] == "nvidia.com/gpu" and t["effect"] == "NoSchedule" for t in tolerations)
    # everything else is the base's
    for key in ("livenessProbe", "readinessProbe", "securityContext", "volumeMounts", "env"):
        assert c[key] == container(base)[key]


def test_the_node_local_variant_runs_one_hoist_per_node_on_the_nodes_models() -> None:
    docs = render(KUBE / "node-local")
    ds = workload(docs)
    assert ds["kind"] == "DaemonSet"
    volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    assert volumes["models"]["hostPath"]["path"].startswith("/")
    (service,) = [d for d in docs if d["kind"] == "Service"]
    assert service["spec"]["internalTrafficPolicy"] == "Local"
