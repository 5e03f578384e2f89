"""deploy/k8s/ against the Kubernetes API schema, plain and with the secure patches applied.

The schemas are the OpenAPI-derived JSON schemas the `kubernetes-validate` package ships,
in their strict form: an unknown or misspelt field is refused, as `kubectl apply
--validate=strict` (the default since 1.25's server-side field validation) refuses it.
Validated against the oldest release we state support for and the newest the package has.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_validate.utils import ValidationError, validate

ROOT = Path(__file__).resolve().parents[1]
K8S_DIR = ROOT / "deploy" / "k8s"
SECURE_DIR = K8S_DIR / "secure"
# docs/deployment/kubernetes.md states these: 1.34 the oldest supported, 1.37 the newest
# schema kubernetes-validate 1.37.0 ships.
K8S_VERSIONS = ("1.34", "1.37")
# Strategic merge keys of the lists the patches touch (k8s.io/api core/v1 types:
# `patchMergeKey`); any other list is replaced whole, as the API server does for lists
# without one (args, command, items).
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
}


def _documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S_DIR.glob("*.yaml")):
        for n, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc:
                docs.append((f"{path.name}#{n}", doc))
    return docs


def _deployments() -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for _, d in _documents() if d["kind"] == "Deployment"}


def strategic_merge(base: Any, patch: Any, key: str | None = None) -> Any:
    """`patch` applied onto `base` as `kubectl patch --type strategic` does, for what the
    patches here use: maps merge, a null deletes its key, lists with a merge key merge by
    it, other lists are replaced."""
    if isinstance(patch, dict) and isinstance(base, dict):
        out = copy.deepcopy(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            elif k in out:
                out[k] = strategic_merge(out[k], v, k)
            else:
                out[k] = copy.deepcopy(v)
        return out
    if isinstance(patch, list) and isinstance(base, list) and key in MERGE_KEYS:
        field = MERGE_KEYS[key]
        out = copy.deepcopy(base)
        index = {item[field]: i for i, item in enumerate(out)}
        for item in patch:
            if item[field] in index:
                out[index[item[field]]] = strategic_merge(out[index[item[field]]], item)
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(patch)


def _patched() -> list[tuple[str, dict[str, Any]]]:
    deployments = _deployments()
    out = []
    for path in sorted(SECURE_DIR.glob("patch-*.yaml")):
        name = path.stem.removeprefix("patch-")
        patch = yaml.safe_load(path.read_text())
        out.append((name, strategic_merge(deployments[name], patch)))
    return out


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize(
    "where_doc",
    [*_documents(), *((f"{n} + secure/patch-{n}.yaml", d) for n, d in _patched())],
    ids=lambda wd: wd[0],
)
def test_manifest_is_valid_in_strict_mode(
    where_doc: tuple[str, dict[str, Any]], version: str
) -> None:
    where, doc = where_doc
    try:
        validate(doc, version, strict=True)
    except ValidationError as exc:
        pytest.fail(f"{where} is not a valid {doc['kind']} in Kubernetes {version}: {exc}")


def test_every_deployment_has_a_secure_patch_that_changes_it() -> None:
    patched = dict(_patched())
    assert set(patched) == set(_deployments())
    for name, doc in patched.items():
        assert doc != _deployments()[name], f"patch-{name}.yaml changes nothing"


def test_secure_patches_keep_the_base_server_flags() -> None:
    """The nats and redis patches replace `args` whole: every base flag must remain."""
    base = _deployments()
    for name, doc in _patched():
        [before] = base[name]["spec"]["template"]["spec"]["containers"]
        [after] = doc["spec"]["template"]["spec"]["containers"]
        old, new = before.get("args", []), after.get("args", [])
        assert after.get("command") == before.get("command"), name
        flags = {(a, b) for a, b in zip(old, old[1:], strict=False) if a.startswith("-")}
        assert flags <= set(zip(new, new[1:], strict=False)), f"{name} drops {flags}"


def test_strategic_merge_follows_the_api_rules() -> None:
    base = {
        "containers": [{"name": "a", "env": [{"name": "X", "value": "1"}], "args": ["p", "q"]}],
        "probe": {"grpc": {"port": 1}, "periodSeconds": 5},
    }
    patch = {
        "containers": [{"name": "a", "env": [{"name": "Y", "value": "2"}], "args": ["r"]}],
        "probe": {"grpc": None, "exec": {"command": ["true"]}},
    }
    assert strategic_merge(base, patch) == {
        "containers": [
            {"name": "a", "env": [{"name": "X", "value": "1"}, {"name": "Y", "value": "2"}],
             "args": ["r"]},
        ],
        "probe": {"periodSeconds": 5, "exec": {"command": ["true"]}},
    }  # fmt: skip


@pytest.mark.parametrize(
    "breakage",
    [
        "an unknown container field",
        "a probe with two handlers' fields misplaced",
        "a string where an integer belongs",
        "an unknown top-level field",
    ],
)
def test_the_schema_refuses_a_broken_manifest(breakage: str) -> None:
    """The check is not vacuous: each mistake below, made in a real manifest, fails it."""
    doc = copy.deepcopy(_deployments()["frontend"])
    [container] = doc["spec"]["template"]["spec"]["containers"]
    if breakage == "an unknown container field":
        container["imagePullPolicyy"] = "IfNotPresent"
    elif breakage == "a probe with two handlers' fields misplaced":
        container["readinessProbe"]["httpGet"]["periodSeconds"] = 3
    elif breakage == "a string where an integer belongs":
        doc["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "thirty"
    else:
        doc["spec"]["replica"] = 2
    validate(_deployments()["frontend"], K8S_VERSIONS[0], strict=True)  # the unbroken passes
    with pytest.raises(ValidationError):
        validate(doc, K8S_VERSIONS[0], strict=True)
