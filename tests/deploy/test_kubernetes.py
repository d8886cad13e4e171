"""The Kubernetes manifests in deploy/kubernetes render, validate and fit together, without a cluster.

* rendering: a small renderer of the kustomize features the manifests use (resources, components,
  ConfigMap/Secret generators with labels, annotations and kustomize's name hash suffix, or without it, the
  references in pod templates rewritten to the suffixed names, replacements of one field or of one
  part of a delimited string, JSON 6902 patches that add or replace a field); any other
  kustomization key, generator or replacement option is an error here, and so is a generated name
  in a field the renderer does not rewrite, so a manifest change that needs real kustomize shows
  up instead of being rendered wrongly. Where kubectl is installed, its kustomize must render
  exactly the same objects;
* every rendered object against the Kubernetes JSON schemas (strict: unknown fields are errors) of
  the ``kubernetes-validate`` package (``dev`` extra);
* cross-references: Service selectors and target ports, StatefulSet Services, the ConfigMaps and
  Secrets (and their keys) that volumes mount, the file flags under those mounts, every flag known
  to its service, the URLs between the services, the run config, the device shards (the union of
  the agent pods' slices, from their Job completion indexes, is every shard exactly once), the scrape
  config's targets, and the security settings (non-root 10001, read-only root file system, probes
  on the health routes, resource requests and limits).

* the policy scan: checkov's Kubernetes checks on what every entry point renders, with no failure
  and each skipped check's reason in the manifests.

A check is skipped only when its tool is missing: kubernetes-validate (``dev`` extra), promtool
(``.ci/run``) and checkov (``make scan-setup``, which ``make check`` runs) are always there in CI;
kubectl is optional (the comparison with real kustomize).
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from device_agent.agent import parse_shards
from device_agent.slices import JOB_INDEX_ENV, agent_shards
from shared.run_config import resolve_run_config

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
COMPOSE = ROOT / "docker-compose.yml"
UID = 10001
WORKLOADS = ("Deployment", "StatefulSet", "Job")
# The kustomization keys the renderer implements; anything else fails the render.
KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "components", "generatorOptions",
                      "configMapGenerator", "secretGenerator", "replacements", "patches"}
AGENTS = ("Job", "device-agents")
ALL_COMPONENTS = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                  "resources": ["../../base"],
                  "components": [f"../../components/{c}" for c in ("cert-manager-tls", "testbed-devices",
                                                                     "arm64-boards", "monitoring")]}
# What an operator applies: the default entry point, the two overlays and one with every component.
ENTRY_POINTS = (".", "overlays/testbed", "overlays/external-devices", "overlays/all")
# checkov in its own virtual environment (`make scan-setup`; .ci/run installs it before the tests).
CHECKOV = ROOT / ".venv-scan" / "bin" / "checkov"
# The checks the manifests skip, each with its reason in a `checkov.io/skipN` annotation.
SKIPPED_CHECKS = {"CKV_K8S_15", "CKV_K8S_21", "CKV_K8S_43"}
# The keys of the Secret cert-manager writes for a Certificate (its spec.secretName).
ISSUED_KEYS = ("tls.crt", "tls.key", "ca.crt")
# Custom resources (cert-manager, Prometheus Operator): no schema in kubernetes-validate; checked here.
CUSTOM_GROUPS = ("cert-manager.io/", "monitoring.coreos.com/")


class RenderError(Exception):
    """The kustomization uses something the renderer does not implement, or refers to a missing file."""


def _generated_files(base: Path, entries: list[str]) -> dict[str, str]:
    """``key=path`` or ``path`` generator entries as key -> file text. Like kustomize's default load
    restrictor, a file must lie inside the kustomization's folder."""
    out: dict[str, str] = {}
    for entry in entries:
        key, _, rel = entry.partition("=") if "=" in entry else (Path(entry).name, "", entry)
        path = (base / rel).resolve()
        if base.resolve() not in path.parents:
            raise RenderError(f"{base}: generator file {rel} is outside the kustomization")
        if not path.is_file():
            raise RenderError(f"{base}: generator file {rel}: no such file")
        out[key] = path.read_text()
    return out


def render(directory: Path) -> list[dict]:
    """What ``kubectl apply -k directory`` would apply, for the subset of kustomize used here. Like
    kustomize, the generated names get their hash suffix once everything is accumulated (so the hash
    is of the final content), and then every reference to them is rewritten."""
    hashed: list[dict] = []
    objects = _accumulate(directory, [], hashed)
    renamed = {}
    for obj in hashed:
        suffixed = f"{obj['metadata']['name']}-{name_hash(obj)}"
        renamed[(obj["kind"], obj["metadata"]["name"])] = suffixed
        obj["metadata"]["name"] = suffixed
    _rename_references(objects, renamed)
    return objects


def _go_json(value: object) -> str:
    """``value`` as Go's ``json.Marshal`` writes it: keys sorted, no spaces, UTF-8 kept, and ``<``,
    ``>``, ``&``, U+2028 and U+2029 escaped."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    for char in "<>&\u2028\u2029":
        text = text.replace(char, f"\\u{ord(char):04x}")
    return text


def name_hash(obj: dict) -> str:
    """kustomize's name suffix for a generated ConfigMap or Secret (api/hasher/hasher.go): the
    sha256 of the JSON of its kind, data (and a Secret's type; binaryData or stringData when
    present) and name, the first 10 hex digits with 0, 1, 3, a, e replaced by g, h, k, m, t (no
    vowels, no look-alikes). The name it hashes is always empty: kustomize looks it up as one field
    called ``metadata/name``, which no object has."""
    fields = {"kind": obj["kind"], "name": "", "data": obj.get("data", "")}
    extra = ("type", "stringData") if obj["kind"] == "Secret" else ("binaryData",)
    fields |= {key: obj[key] for key in extra if key in obj}
    if obj["kind"] == "Secret":
        fields.setdefault("type", "")
    digest = hashlib.sha256(_go_json(fields).encode()).hexdigest()
    return digest[:10].translate(str.maketrans("013ae", "ghkmt"))


def _base64_lines(value: bytes) -> str:
    """A Secret value as kustomize's generator writes it: base64 in lines of 70 characters, each
    ended by a newline once there is more than one line's worth (this text enters the hash)."""
    text = base64.b64encode(value).decode()
    if len(text) < 70:
        return text
    return "".join(text[i:i + 70] + "\n" for i in range(0, len(text), 70))


def _accumulate(directory: Path, objects: list[dict], hashed: list[dict]) -> list[dict]:
    """The objects of one kustomization added to ``objects`` (a component is rendered onto its
    parent's objects so far: like kustomize, it adds its own and its generators, replacements and
    patches act on all of them); the generated objects that get a hash suffix go to ``hashed``."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(spec) - KUSTOMIZATION_KEYS
    if unknown:
        raise RenderError(f"{directory}: kustomization keys the renderer does not implement: {sorted(unknown)}")
    for item in spec.get("resources", []):
        path = directory / item
        if path.is_dir():
            _accumulate(path, objects, hashed)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    for item in spec.get("components", []):
        _accumulate(directory / item, objects, hashed)
    shared = spec.get("generatorOptions", {})
    for kind, key in (("ConfigMap", "configMapGenerator"), ("Secret", "secretGenerator")):
        for gen in spec.get(key, []):
            if set(gen) - {"name", "files", "options"}:
                raise RenderError(f"{directory}: generator {gen} not rendered here")
            # kustomize merges the two: labels and annotations of both, no hash if either says so.
            own = gen.get("options", {})
            for options in (shared, own):
                if set(options) - {"disableNameSuffixHash", "labels", "annotations"}:
                    raise RenderError(f"{directory}: generator options {options} not rendered here")
            metadata = {"name": gen["name"]}
            for field in ("labels", "annotations"):
                if field in shared or field in own:
                    metadata[field] = {**shared.get(field, {}), **own.get(field, {})}
            data = _generated_files(directory, gen["files"])
            obj = {"apiVersion": "v1", "kind": kind, "metadata": metadata}
            if kind == "Secret":
                obj |= {"type": "Opaque", "data": {k: _base64_lines(v.encode()) for k, v in data.items()}}
            else:
                obj["data"] = data
            objects.append(obj)
            if not (shared.get("disableNameSuffixHash") or own.get("disableNameSuffixHash")):
                hashed.append(obj)
    for replacement in spec.get("replacements", []):
        _replace(directory, objects, replacement)
    for patch in spec.get("patches", []):
        _patch(directory, objects, patch)
    return objects


def _pod_references(pod: dict):
    """Each place a pod spec names a ConfigMap or Secret, as (kind, the dict holding the name, its
    key): volumes (also projected), env ``valueFrom`` and ``envFrom`` of every container."""
    for volume in pod.get("volumes", []):
        sources = [volume, *volume.get("projected", {}).get("sources", [])]
        for source in sources:
            if "configMap" in source:
                yield "ConfigMap", source["configMap"], "name"
            if "secret" in source:
                yield "Secret", source["secret"], "secretName" if source is volume else "name"
    for container in pod.get("initContainers", []) + pod.get("containers", []):
        for env in container.get("env", []):
            ref = env.get("valueFrom", {})
            if "configMapKeyRef" in ref:
                yield "ConfigMap", ref["configMapKeyRef"], "name"
            if "secretKeyRef" in ref:
                yield "Secret", ref["secretKeyRef"], "name"
        for env in container.get("envFrom", []):
            if "configMapRef" in env:
                yield "ConfigMap", env["configMapRef"], "name"
            if "secretRef" in env:
                yield "Secret", env["secretRef"], "name"


def _rename_references(objects: list[dict], renamed: dict[tuple[str, str], str]) -> None:
    """kustomize's name reference fix for the suffixed names, in the pod templates of the workloads.
    A generated name anywhere else fails the render: kustomize might rewrite a field this does not."""
    for obj in objects:
        if obj["kind"] in WORKLOADS:
            for kind, holder, key in _pod_references(obj["spec"]["template"]["spec"]):
                holder[key] = renamed.get((kind, holder[key]), holder[key])
    old_names = {name for _, name in renamed}
    for obj in objects:
        stray = old_names & set(_strings(obj))
        if stray:
            raise RenderError(f"{obj['kind']} {obj['metadata']['name']} names {sorted(stray)} where the renderer "
                              "does not rewrite references")


def _strings(node: object):
    """Every string value in a parsed manifest."""
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from _strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value)


def _patch(directory: Path, objects: list[dict], patch: dict) -> None:
    """An inline JSON 6902 patch of the one object its target names: ``add`` or ``replace`` of a
    field (an object's key, not a list item)."""
    target = patch.get("target", {})
    if set(patch) != {"target", "patch"} or set(target) != {"kind", "name"}:
        raise RenderError(f"{directory}: patch {patch} not rendered here")
    matches = [o for o in objects if (o["kind"], o["metadata"]["name"]) == (target["kind"], target["name"])]
    if len(matches) != 1:
        raise RenderError(f"{directory}: patch target {target} matches {len(matches)} objects")
    for op in yaml.safe_load(patch["patch"]):
        if op["op"] not in ("add", "replace") or set(op) != {"op", "path", "value"}:
            raise RenderError(f"{directory}: patch operation {op} not rendered here")
        *parents, last = [step.replace("~1", "/").replace("~0", "~") for step in op["path"].split("/")[1:]]
        node = matches[0]
        for step in parents:
            node = node[step]
        if not isinstance(node, dict) or (op["op"] == "replace" and last not in node):
            raise RenderError(f"{directory}: patch path {op['path']} not rendered here")
        node[last] = op["value"]


def _field(node, path: str):
    """The parent of the last step of a kustomize field path (``a.b.[name=x].c``) in ``node``, and
    that step: a key, or a list item's index for a ``[key=value]`` step."""
    steps = path.split(".")
    for step in steps[:-1]:
        node = node[_step(node, step)]
    return node, _step(node, steps[-1])


def _step(node, step: str):
    """The key or list index one field path step names in ``node``."""
    if step.startswith("[") and step.endswith("]"):
        key, _, value = step[1:-1].partition("=")
        matches = [i for i, item in enumerate(node) if item.get(key) == value]
        if len(matches) != 1:
            raise RenderError(f"field path step {step} matches {len(matches)} items")
        return matches[0]
    if step not in node:
        raise RenderError(f"field path step {step}: no such field")
    return step


def _replace(directory: Path, objects: list[dict], replacement: dict) -> None:
    """A kustomize replacement: the source field's value into each target field, whole or (option
    ``delimiter``, ``index``) as one part of the target's delimited string."""
    source = replacement["source"]
    sources = [o for o in objects if o["kind"] == source["kind"] and o["metadata"]["name"] == source["name"]]
    if len(sources) != 1 or set(source) != {"kind", "name", "fieldPath"}:
        raise RenderError(f"{directory}: replacement source {source} not rendered here")
    parent, key = _field(sources[0], source["fieldPath"])
    value = parent[key]
    for target in replacement["targets"]:
        options = target.get("options", {})
        if set(target) - {"select", "fieldPaths", "options"} or set(options) - {"delimiter", "index"} \
                or set(target["select"]) != {"kind", "name"}:
            raise RenderError(f"{directory}: replacement target {target} not rendered here")
        for obj in objects:
            if (obj["kind"], obj["metadata"]["name"]) != (target["select"]["kind"], target["select"]["name"]):
                continue
            for path in target["fieldPaths"]:
                parent, key = _field(obj, path)
                if "delimiter" in options:
                    parts = parent[key].split(options["delimiter"])
                    if not 0 <= options["index"] < len(parts):
                        raise RenderError(f"{directory}: {path} has no part {options['index']}")
                    parts[options["index"]] = str(value)
                    parent[key] = options["delimiter"].join(parts)
                else:
                    parent[key] = str(value) if isinstance(parent[key], str) else value


def _index(objects: list[dict]) -> dict[tuple[str, str], dict]:
    index: dict[tuple[str, str], dict] = {}
    for obj in objects:
        key = (obj["kind"], obj["metadata"]["name"])
        assert key not in index, f"{key} defined twice"
        index[key] = obj
    return index


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A copy of deploy/kubernetes with the two secret files an operator writes (never in git)."""
    copy = tmp_path_factory.mktemp("kube") / "kubernetes"
    shutil.copytree(KUBE, copy, ignore=shutil.ignore_patterns("service-secret", "enrolment-secret"))
    for name in ("service-secret", "enrolment-secret"):
        (copy / "base" / "secrets" / name).write_text(base64.b16encode(os.urandom(32)).decode())
    # An operator's overlay with every component (docs/operating.md shows it).
    (copy / "overlays" / "all").mkdir()
    (copy / "overlays" / "all" / "kustomization.yaml").write_text(yaml.safe_dump(ALL_COMPONENTS))
    return copy


@pytest.fixture(scope="module")
def base(checkout) -> dict[tuple[str, str], dict]:
    return _index(render(checkout))


@pytest.fixture(scope="module")
def testbed(checkout) -> dict[tuple[str, str], dict]:
    return _index(render(checkout / "overlays" / "testbed"))


@pytest.fixture(scope="module")
def everything(checkout) -> dict[tuple[str, str], dict]:
    return _index(render(checkout / "overlays" / "all"))


@pytest.fixture(scope="module")
def external(checkout) -> dict[tuple[str, str], dict]:
    return _index(render(checkout / "overlays" / "external-devices"))


def _workloads(objects: dict) -> list[dict]:
    return [o for (kind, _), o in objects.items() if kind in WORKLOADS]


def _container(objects: dict, kind: str, name: str) -> dict:
    containers = objects[(kind, name)]["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _flags(container: dict) -> dict[str, str]:
    """``--flag value`` pairs of a container's args (every flag used here takes a value)."""
    args = container["args"]
    return {a: args[i + 1] for i, a in enumerate(args) if a.startswith("--")}


def _data(objects: dict, kind: str, name: str) -> dict:
    """The keys of a ConfigMap or Secret of the manifests, or of the Secret that cert-manager writes
    for one of their Certificates (``spec.secretName``)."""
    if (kind, name) in objects:
        return objects[(kind, name)]["data"]
    issued = [o for (k, _), o in objects.items() if k == "Certificate" and o["spec"]["secretName"] == name]
    assert kind == "Secret" and len(issued) == 1, f"no {kind} {name}"
    return dict.fromkeys(ISSUED_KEYS, "")


def _env(container: dict) -> dict[str, str | None]:
    """A container's environment: each variable's value, None for one taken from elsewhere (valueFrom)."""
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_render_refuses_missing_secrets():
    """Without the operator's secret files there is nothing to apply (kustomize stops the same way)."""
    present = [p for p in (KUBE / "base" / "secrets").iterdir() if p.name in ("service-secret", "enrolment-secret")]
    if present:
        pytest.skip("this checkout holds real secret files")
    with pytest.raises(RenderError, match="no such file"):
        render(KUBE)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed (its kustomize renders offline)")
@pytest.mark.parametrize("where", ENTRY_POINTS)
def test_renderer_matches_kubectl_kustomize(checkout, where):
    """The renderer gives exactly what kubectl's built-in kustomize gives, object for object."""
    result = subprocess.run(["kubectl", "kustomize", str(checkout / where)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr

    def decoded(objects: list[dict]) -> dict:
        # kustomize wraps long base64 lines; compare the Secrets' values, not their encoding.
        index = _index(objects)
        for (kind, _), obj in index.items():
            if kind == "Secret":
                obj["data"] = {k: base64.b64decode(v) for k, v in obj["data"].items()}
        return index

    assert decoded(render(checkout / where)) == decoded(list(yaml.safe_load_all(result.stdout)))


def _generated(objects: dict, kind: str, name: str) -> dict:
    """The ConfigMap or Secret a generator called ``name`` made: under its hash-suffixed name, or
    under ``name`` where the suffix is turned off."""
    matches = [o for (k, n), o in objects.items() if k == kind and n in (name, f"{name}-{name_hash(o)}")]
    assert len(matches) == 1, f"{len(matches)} {kind}s generated as {name}"
    return matches[0]


def _unsuffixed(objects: dict) -> set[tuple[str, str]]:
    """The objects' kinds and names, generated ones by their generator's name."""
    return {(k, n.removesuffix(f"-{name_hash(o)}") if k in ("ConfigMap", "Secret") else n)
            for (k, n), o in objects.items()}


def test_name_hash_is_kustomizes():
    """Suffixes kubectl's kustomize (v5.5) gave a ConfigMap ``x`` with a=b and a Secret ``sec`` with
    a=b (literals): the hash ignores the name, and a Secret's data enters as base64 with its type."""
    assert name_hash({"kind": "ConfigMap", "metadata": {"name": "x"}, "data": {"a": "b"}}) == "4h2mbtbbt6"
    assert name_hash({"kind": "Secret", "metadata": {"name": "sec"}, "type": "Opaque", "data": {"a": "Yg=="}}) \
        == "k695gkmbtk"


def test_changed_config_or_secret_rolls_the_pods_that_mount_it(checkout, tmp_path, testbed):
    """A changed run.yaml gives the Fed Server's pod template another ConfigMap name (so the
    StatefulSet rolls it) and leaves the other workloads alone; a changed secret rolls all three.
    The dashboard and scrape config keep their names: no pod here mounts them, others find them."""
    def templates(objects: dict) -> dict[str, dict]:
        return {w["metadata"]["name"]: w["spec"]["template"] for w in _workloads(objects)}

    before = templates(testbed)
    for changed, rolled in (("run.yaml", {"fed-server"}),
                            ("secrets/enrolment-secret", {"fed-server", "main-server", "device-agents"})):
        copy = tmp_path / changed.replace("/", "-") / "kubernetes"
        shutil.copytree(checkout, copy)
        with open(copy / "base" / changed, "a") as file:
            file.write("\n# changed\n")
        after = templates(_index(render(copy / "overlays" / "testbed")))
        assert {name for name in before if before[name] != after[name]} == rolled, changed
    everything = _index(render(checkout / "overlays" / "all"))
    for kind, name in (("ConfigMap", "s2fl-prometheus-scrape"), ("ConfigMap", "s2fl-grafana-dashboard")):
        assert (kind, name) in everything
    assert ("ConfigMap", "s2fl-run-config") not in everything and ("Secret", "s2fl-secrets") not in everything


def test_render_refuses_a_generated_name_where_it_rewrites_no_reference(checkout, tmp_path):
    """kustomize may rewrite a reference the renderer does not know; the render stops instead of
    leaving the old name there."""
    copy = tmp_path / "kubernetes"
    shutil.copytree(checkout, copy)
    manifest = copy / "base" / "main-server.yaml"
    manifest.write_text(manifest.read_text().replace("  serviceName: main-server", "  serviceName: s2fl-run-config", 1))
    with pytest.raises(RenderError, match="does not rewrite references"):
        render(copy)


def _checkov(folder: Path) -> dict:
    """checkov's Kubernetes results for every manifest file in ``folder``: passed, failed and
    skipped checks. Offline: nothing is fetched from its platform."""
    result = subprocess.run([str(CHECKOV), "--framework", "kubernetes", "--directory", str(folder), "--output", "json",
                             "--skip-download"], capture_output=True, text=True, timeout=300)
    assert result.returncode in (0, 1), result.stderr
    report = json.loads(result.stdout)
    assert report["summary"]["parsing_errors"] == 0, report["results"]["parsing_errors"]
    return report["results"]


@pytest.mark.skipif(not CHECKOV.exists(), reason="checkov not installed: make scan-setup (.ci/run does it)")
def test_manifests_pass_the_policy_scan(checkout, tmp_path):
    """checkov's Kubernetes checks on what each entry point renders: no failure, and a check is
    skipped only by a ``checkov.io/skipN`` annotation that gives its reason. Scanned alongside, a
    copy of the testbed with the Fed Server's image at ``:latest`` and its service account token
    mounted fails exactly those two checks, so the scan can fail."""
    for where in ENTRY_POINTS:
        (tmp_path / f"{where.replace('/', '-').strip('.') or 'default'}.yaml").write_text(
            yaml.safe_dump_all(render(checkout / where)))
    broken = _index(render(checkout / "overlays" / "testbed"))
    pod = broken[("StatefulSet", "fed-server")]["spec"]["template"]["spec"]
    pod["containers"][0]["image"] = pod["containers"][0]["image"].split(":")[0] + ":latest"
    pod["automountServiceAccountToken"] = True
    (tmp_path / "canary.yaml").write_text(yaml.safe_dump_all(broken.values()))

    results = _checkov(tmp_path)
    failed = {(c["file_path"].lstrip("/"), c["resource"], c["check_id"]) for c in results["failed_checks"]}
    assert failed == {("canary.yaml", "StatefulSet.default.fed-server", "CKV_K8S_14"),
                      ("canary.yaml", "StatefulSet.default.fed-server", "CKV_K8S_38")}, failed
    skipped = results["skipped_checks"]
    assert {c["check_id"] for c in skipped} == SKIPPED_CHECKS
    assert all(c["check_result"]["suppress_comment"].strip() for c in skipped), "every exception gives its reason"
    assert results["passed_checks"]


def test_base_and_testbed_contents(base, testbed):
    assert _unsuffixed(base) == {("Service", "fed-server"), ("StatefulSet", "fed-server"), ("Service", "main-server"),
                         ("StatefulSet", "main-server"), ("ConfigMap", "s2fl-run-config"),
                         ("ConfigMap", "s2fl-prometheus-scrape"), ("Secret", "s2fl-secrets"),
                         ("NetworkPolicy", "fed-server"), ("NetworkPolicy", "main-server"),
                         ("PodDisruptionBudget", "main-server"), ("Issuer", "s2fl-selfsigned"),
                         ("Certificate", "s2fl-ca"), ("Issuer", "s2fl-ca"), ("Certificate", "fed-server-tls"),
                         ("Certificate", "main-server-tls")}
    assert set(testbed) - set(base) == {("Service", "device-agents"), AGENTS, ("NetworkPolicy", "device-agents")}
    assert base.keys() <= testbed.keys()


@pytest.mark.parametrize("overlay", ["base", "testbed", "external", "everything"])
def test_objects_validate_against_kubernetes_schemas(overlay, request):
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (dev extra)")
    errors = []
    for key, obj in request.getfixturevalue(overlay).items():
        if obj["apiVersion"].startswith(CUSTOM_GROUPS):
            continue   # cert-manager's and the Prometheus Operator's: the tests below check them
        try:
            kv.validate(obj, kv.latest_version(), strict=True)
        except kv.ValidationError as exc:
            errors.append(f"{key}: {exc.message} at {'/'.join(map(str, exc.path))}")
    assert not errors, "\n".join(errors)


def test_schema_validation_can_fail(base):
    """The validator rejects what a typo would produce, so the test above can fail."""
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (dev extra)")
    import copy

    broken = copy.deepcopy(base[("StatefulSet", "main-server")])
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/healthz"
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, kv.latest_version(), strict=True)


def test_services_select_workloads_and_their_ports(testbed):
    for (kind, name), service in testbed.items():
        if kind != "Service":
            continue
        selector = service["spec"]["selector"]
        matched = [w for w in _workloads(testbed)
                   if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matched) == 1, f"Service {name} selects {len(matched)} workloads"
        ports = {p["name"]: p["containerPort"] for c in matched[0]["spec"]["template"]["spec"]["containers"]
                 for p in c["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, f"Service {name}: no container port {port['targetPort']}"
            assert port["port"] == ports[port["targetPort"]], f"Service {name}: port differs from the container's"
    for workload in _workloads(testbed):
        spec = workload["spec"]
        if workload["kind"] != "Job":   # a Job's selector is generated
            assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
        if workload["kind"] == "StatefulSet":
            assert ("Service", spec["serviceName"]) in testbed


def test_devices_outside_reach_the_fed_server_and_each_replica_at_its_own_address(base, external):
    """overlays/external-devices: a Service of its own for the Fed Server and for every Main Server
    pod (selected by the pod-name label its StatefulSet sets), and the Fed Server told, per replica
    in the order of SFL_MAIN_SERVER_URL, the address devices use; the base tells them nothing else."""
    fed = _container(external, "StatefulSet", "fed-server")
    ref = next(e for e in fed["env"] if e["name"] == "SFL_MAIN_SERVER_PUBLIC_URL")["valueFrom"]["configMapKeyRef"]
    assert ref["optional"] is True and ("ConfigMap", ref["name"]) not in base, "the base has no public addresses"
    public = external[("ConfigMap", ref["name"])]["data"][ref["key"]].strip().split(",")
    main = external[("StatefulSet", "main-server")]
    main_port = int(_flags(_container(external, "StatefulSet", "main-server"))["--port"])
    replicas = main["spec"]["replicas"]
    assert len(public) == replicas == len(_env(fed)["SFL_MAIN_SERVER_URL"].split(","))
    pod_label = "statefulset.kubernetes.io/pod-name"
    services = [s for (kind, _), s in external.items() if kind == "Service" and s["spec"].get("type") == "LoadBalancer"]
    per_pod = {s["spec"]["selector"][pod_label]: s for s in services if pod_label in s["spec"]["selector"]}
    assert sorted(per_pod) == [f"main-server-{i}" for i in range(replicas)], "one Service per replica"
    for i, url in enumerate(public):
        service = per_pod[f"main-server-{i}"]
        rest = {k: v for k, v in service["spec"]["selector"].items() if k != pod_label}
        assert rest.items() <= main["spec"]["template"]["metadata"]["labels"].items()
        assert [p["port"] for p in service["spec"]["ports"]] == [main_port] == [urlsplit(url).port]
    fed_public = [s for s in services if pod_label not in s["spec"]["selector"]]
    assert len(fed_public) == 1
    assert fed_public[0]["spec"]["selector"].items() <= \
        external[("StatefulSet", "fed-server")]["spec"]["template"]["metadata"]["labels"].items()
    assert fed_public[0]["spec"]["ports"][0]["port"] == int(_flags(fed)["--port"])


def test_main_server_replicas_are_spread_over_nodes_and_evicted_one_at_a_time(base):
    main = base[("StatefulSet", "main-server")]["spec"]
    labels = main["template"]["metadata"]["labels"]
    budget = base[("PodDisruptionBudget", "main-server")]["spec"]
    assert budget["selector"]["matchLabels"].items() <= labels.items()
    assert budget["maxUnavailable"] == 1 < main["replicas"], "a drain leaves a replica serving"
    terms = main["template"]["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    term = terms[0]["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname" and term["labelSelector"]["matchLabels"].items() <= labels.items()


def test_main_server_replicas_behind_a_headless_service_are_each_in_the_fed_servers_list(base):
    assert base[("Service", "main-server")]["spec"]["clusterIP"] == "None"
    main = base[("StatefulSet", "main-server")]["spec"]
    assert main["serviceName"] == "main-server"
    assert main["replicas"] >= 1
    # The Fed Server spreads each round's groups over every replica it is given
    # (docs/deployment.md, "Main Server replicas"): exactly the pods the StatefulSet runs, in order.
    urls = _env(_container(base, "StatefulSet", "fed-server"))["SFL_MAIN_SERVER_URL"].split(",")
    assert [urlsplit(u).hostname for u in urls] == [f"main-server-{i}.main-server" for i in range(main["replicas"])]
    assert base[("StatefulSet", "fed-server")]["spec"]["replicas"] == 1


def test_volumes_refer_to_existing_configmaps_secrets_and_keys(testbed):
    for workload in _workloads(testbed):
        pod = workload["spec"]["template"]["spec"]
        claims = {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
        volumes = {v["name"]: v for v in pod["volumes"]}
        for volume in volumes.values():
            source = volume.get("configMap") or volume.get("secret")
            if source is None:
                continue
            kind, name = ("ConfigMap", source["name"]) if "configMap" in volume else ("Secret", source["secretName"])
            for item in source.get("items", []):
                assert item["key"] in _data(testbed, kind, name), f"{workload['metadata']['name']}: {kind} {name}"
        for container in pod["containers"]:
            for mount in container["volumeMounts"]:
                assert mount["name"] in volumes or mount["name"] in claims, mount
                if "subPath" in mount:
                    source = volumes[mount["name"]]["configMap"]
                    assert mount["subPath"] in testbed[("ConfigMap", source["name"])]["data"]


def _mounted_key(objects: dict, workload: dict, container: dict, path: str) -> str:
    """The ConfigMap/Secret key that a file path inside a container comes from (or fail)."""
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    for mount in container["volumeMounts"]:
        volume = volumes.get(mount["name"], {})
        source = volume.get("configMap") or volume.get("secret")
        if source is None:
            continue
        kind, name = ("ConfigMap", source["name"]) if "configMap" in volume else ("Secret", source["secretName"])
        if "subPath" in mount:
            if path == mount["mountPath"]:
                return mount["subPath"]
        elif path.startswith(mount["mountPath"] + "/"):
            rel = path[len(mount["mountPath"]) + 1:]
            items = {i["path"]: i["key"] for i in source.get("items", [])} or {k: k for k in _data(objects, kind, name)}
            assert rel in items, f"{path}: not among the files of {kind} {name}"
            return items[rel]
    pytest.fail(f"{path} is not mounted from a ConfigMap or Secret")


def test_file_flags_point_into_the_mounted_configmaps_and_secrets(testbed):
    expected = {"--config": "run.yaml", "--service-secret-file": "service-secret",
                "--enrolment-secret-file": "enrolment-secret", "--tls-cert": "tls.crt", "--tls-key": "tls.key",
                "--ca-file": "ca.crt"}
    seen = set()
    for workload in _workloads(testbed):
        container = workload["spec"]["template"]["spec"]["containers"][0]
        for flag, value in _flags(container).items():
            if flag in expected:
                assert _mounted_key(testbed, workload, container, value) == expected[flag], (flag, value)
                seen.add((workload["metadata"]["name"], flag))
        assert not {k for k in _env(container) if k.endswith("SECRET")}, "secrets only as files"
    tls = {(server, flag) for server in ("fed-server", "main-server") for flag in ("--tls-cert", "--tls-key", "--ca-file")}
    assert seen == {("fed-server", "--config"), ("fed-server", "--service-secret-file"),
                    ("fed-server", "--enrolment-secret-file"), ("main-server", "--service-secret-file"),
                    ("device-agents", "--enrolment-secret-file"), ("device-agents", "--ca-file"), *tls}


def _help(module: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, env=env,
                          timeout=300, check=True).stdout


@pytest.mark.parametrize("kind,name,module", [("StatefulSet", "fed-server", "fed_server"),
                                              ("StatefulSet", "main-server", "main_server"),
                                              (*AGENTS, "device_agent")])
def test_flags_and_environment_exist_in_the_service(testbed, kind, name, module):
    container = _container(testbed, kind, name)
    args = container["args"]
    if module != "device_agent":   # the server image's command; the device image's entrypoint runs the agent
        assert args[:3] == ["python", "-m", module]
    text = " ".join(_help(module).split())   # argparse wraps a help line anywhere
    for flag in _flags(container):
        assert re.search(rf"\[{re.escape(flag)}[ \]]", text), f"{module} has no flag {flag}"
    for variable in _env(container):
        assert f"env {variable}" in text, f"{module} reads no {variable}"


def _resolve(objects: dict, url: str) -> int:
    """The container port a URL of the manifests reaches: a Service, or a StatefulSet pod behind its
    headless Service (``<set>-<ordinal>.<service>``)."""
    parts = urlsplit(url)
    labels = parts.hostname.split(".")
    if len(labels) == 2:
        pod, service = labels
        workload = next(w for w in _workloads(objects) if w["spec"].get("serviceName") == service)
        assert objects[("Service", service)]["spec"]["clusterIP"] == "None", "pod names need a headless Service"
        set_name, _, ordinal = pod.rpartition("-")
        assert set_name == workload["metadata"]["name"] and int(ordinal) < workload["spec"]["replicas"], url
    else:
        service = labels[0]
    ports = [p for p in objects[("Service", service)]["spec"]["ports"] if p["port"] == parts.port]
    assert len(ports) == 1, f"{url}: Service {service} has no port {parts.port}"
    return ports[0]["port"]


def test_urls_between_services_reach_the_right_ports(testbed):
    fed = _container(testbed, "StatefulSet", "fed-server")
    main = _container(testbed, "StatefulSet", "main-server")
    agents = _container(testbed, *AGENTS)
    fed_port, main_port = int(_flags(fed)["--port"]), int(_flags(main)["--port"])
    for url in _env(fed)["SFL_MAIN_SERVER_URL"].split(","):
        assert _resolve(testbed, url) == main_port
    assert _resolve(testbed, _env(main)["SFL_FED_SERVER_URL"]) == fed_port
    assert _resolve(testbed, _flags(agents)["--fed-server-url"]) == fed_port
    assert {urlsplit(u).hostname.split(".")[1] for u in _env(fed)["SFL_MAIN_SERVER_URL"].split(",")} == {"main-server"}
    assert int(_flags(agents)["--metrics-port"]) == agents["ports"][0]["containerPort"]


def test_network_policies_let_in_only_the_pods_ports_and_out_only_the_calls_they_make(testbed):
    """Every pod is under one NetworkPolicy for both directions: in, its own container ports only;
    out, DNS and the Service ports of the URLs it calls, to the pods behind them, nothing else."""
    policies = [o for (kind, _), o in testbed.items() if kind == "NetworkPolicy"]
    fed = _container(testbed, "StatefulSet", "fed-server")
    main = _container(testbed, "StatefulSet", "main-server")
    agents = _container(testbed, *AGENTS)
    calls = {"fed-server": _env(fed)["SFL_MAIN_SERVER_URL"].split(","),
             "main-server": [_env(main)["SFL_FED_SERVER_URL"]],
             AGENTS[1]: [_flags(agents)["--fed-server-url"], *_env(fed)["SFL_MAIN_SERVER_URL"].split(",")]}
    for workload in _workloads(testbed):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        mine = [p for p in policies if p["spec"]["podSelector"]["matchLabels"].items() <= labels.items()]
        assert len(mine) == 1, f"{workload['metadata']['name']}: {len(mine)} NetworkPolicies"
        spec = mine[0]["spec"]
        assert sorted(spec["policyTypes"]) == ["Egress", "Ingress"]
        names = {p["name"] for c in workload["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        assert {port["port"] for rule in spec["ingress"] for port in rule["ports"]} == names
        allowed = {(tuple(sorted(rule["to"][0]["podSelector"]["matchLabels"].items())) if "to" in rule else None,
                    port["port"]) for rule in spec["egress"] for port in rule["ports"]}
        needed = {(None, 53)}
        for url in calls[workload["metadata"]["name"]]:
            service = testbed[("Service", urlsplit(url).hostname.split(".")[-1])]
            needed.add((tuple(sorted(service["spec"]["selector"].items())), _resolve(testbed, url)))
        assert allowed == needed, workload["metadata"]["name"]


def _pods_shards(objects: dict) -> list[list[int]]:
    """The shards each agent pod hosts, in index order: its slice (SFL_SLICE, INDEX from the
    Indexed Job's ``JOB_COMPLETION_INDEX``) of the shared ``--shards``, as the agent computes it."""
    container = _container(objects, *AGENTS)
    shards = parse_shards(_flags(container)["--shards"])
    return [agent_shards(shards, _env(container)["SFL_SLICE"], environ={JOB_INDEX_ENV: str(index)})
            for index in range(objects[AGENTS]["spec"]["completions"])]


def test_run_config_is_valid_and_the_agent_pods_hold_every_shard_once(testbed, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(_generated(testbed, "ConfigMap", "s2fl-run-config")["data"]["run.yaml"])
    # The file alone, as the pod reads it: no SFL_RUN__* variables of this process mixed in.
    config = resolve_run_config(path, env_prefix="SFL_KUBE_TEST_UNSET__")

    job = testbed[AGENTS]["spec"]
    replicas = job["completions"]
    assert _env(_container(testbed, *AGENTS))["SFL_SLICE"] == f"auto/{replicas}", "COUNT must be the completions"
    assert job["completionMode"] == "Indexed" and job["parallelism"] == replicas, "every agent at once"
    # An agent whose run is over exits 0 and is done; a failing one is retried a bounded number of times.
    assert job["template"]["spec"]["restartPolicy"] in ("Never", "OnFailure") and job["backoffLimit"] <= 10
    pods = _pods_shards(testbed)
    assert replicas > 1 and all(pods), "every pod hosts devices"
    hosted = [shard for pod in pods for shard in pod]
    assert sorted(hosted) == list(range(config.data.num_devices)), f"not every shard exactly once: {pods}"


@pytest.mark.parametrize("count", [1, 9])
def test_the_shard_check_sees_a_count_other_than_the_completions(testbed, count):
    """With COUNT below the completions the last pods' indexes are no INDEX (those agents refuse to
    start). Above, with one device per pod, the first pods still hold every shard: the test above
    catches that case by comparing COUNT with the completions."""
    import copy

    objects = copy.deepcopy(testbed)
    env = _container(objects, *AGENTS)["env"]
    next(e for e in env if e["name"] == "SFL_SLICE")["value"] = f"auto/{count}"
    assert count < objects[AGENTS]["spec"]["completions"]
    with pytest.raises(ValueError, match="is not below COUNT"):
        _pods_shards(objects)


@pytest.mark.parametrize("replicas", [1, 3, 10])
def test_the_number_of_agents_is_one_setting(checkout, tmp_path, replicas):
    """Only the Job's completions change; the replacement gives every pod the matching COUNT and
    runs them all at once."""
    copy = tmp_path / "kubernetes"
    shutil.copytree(checkout, copy)
    manifest = copy / "components" / "testbed-devices" / "device-agents.yaml"
    text, changes = re.subn(r"(?m)^  completions: \d+$", f"  completions: {replicas}", manifest.read_text())
    assert changes == 1
    manifest.write_text(text)
    objects = _index(render(copy / "overlays" / "testbed"))
    assert _env(_container(objects, *AGENTS))["SFL_SLICE"] == f"auto/{replicas}"
    assert objects[AGENTS]["spec"]["parallelism"] == replicas
    assert sorted(s for pod in _pods_shards(objects) for s in pod) == list(range(10))


def test_fed_server_keeps_its_runs_on_its_volume(base):
    """A directory per run on the volume: a restarted pod resumes an unfinished run and begins a
    new one after a finished run, and a refused start waits instead of restarting."""
    fed = base[("StatefulSet", "fed-server")]
    container = fed["spec"]["template"]["spec"]["containers"][0]
    claims = {t["metadata"]["name"]: t for t in fed["spec"]["volumeClaimTemplates"]}
    flags = _flags(container)
    assert "--run-dir" not in flags, "a fixed run directory resumes a finished run on every start"
    mounts = [m for m in container["volumeMounts"] if m["name"] in claims]
    assert any(flags["--runs-root"] == m["mountPath"] for m in mounts), "the runs must be on the volume"


def test_security_probes_and_resources(testbed):
    server_image = yaml.safe_load(COMPOSE.read_text())["x-server"]["image"]
    device_image = yaml.safe_load(COMPOSE.read_text())["x-agent"]["image"]
    for workload in _workloads(testbed):
        pod = workload["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False, "no service account token in the pods"
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == UID and pod["securityContext"]["runAsGroup"] == UID
        # Mounted secret files belong to root: the user reads them through the pod's fsGroup.
        for volume in pod["volumes"]:
            if "secret" in volume:
                assert pod["securityContext"]["fsGroup"] == UID and volume["secret"]["defaultMode"] & 0o040
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True and context["allowPrivilegeEscalation"] is False
            assert context["capabilities"]["drop"] == ["ALL"]
            assert {m["mountPath"] for m in container["volumeMounts"]} >= {"/tmp"}
            assert set(container["resources"]) == {"requests", "limits"}
            assert _env(container)["SFL_TORCH_DEVICE"] == "cpu"
            is_agent = (workload["kind"], workload["metadata"]["name"]) == AGENTS
            assert container["image"] == (device_image if is_agent else server_image)
            if is_agent:
                paths = {"startupProbe": "/metrics", "readinessProbe": "/metrics", "livenessProbe": "/metrics"}
            else:   # alive while serving, ready once working: a refused start is not restarted
                paths = {"startupProbe": "/livez", "readinessProbe": "/healthz", "livenessProbe": "/livez"}
                assert _env(container)["SFL_WAIT_ON_REFUSAL"] == "1"
            assert "initialDelaySeconds" not in container["livenessProbe"], "the startup probe covers the start"
            # Each probe has its own job: the startup probe waits long, liveness restarts a hung
            # process, readiness takes the pod out of its Service.
            probes = [container[probe] for probe in ("startupProbe", "livenessProbe", "readinessProbe")]
            assert all(a != b for i, a in enumerate(probes) for b in probes[i + 1:]), "the three probes differ"
            assert container["startupProbe"]["failureThreshold"] * container["startupProbe"]["periodSeconds"] \
                > container["livenessProbe"]["failureThreshold"] * container["livenessProbe"]["periodSeconds"]
            for probe, path in paths.items():
                get = container[probe]["httpGet"]
                assert get["path"] == path
                assert get["port"] in {p["name"] for p in container["ports"]}


def test_pods_carry_scrape_annotations(testbed):
    for workload in _workloads(testbed):
        template = workload["spec"]["template"]
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
        ports = {p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
        assert int(annotations["prometheus.io/port"]) in ports


def test_scrape_config_targets_the_services(testbed):
    config = yaml.safe_load(testbed[("ConfigMap", "s2fl-prometheus-scrape")]["data"]["prometheus.yml"])
    compose = yaml.safe_load((ROOT / "docker" / "prometheus" / "prometheus.yml").read_text())
    assert [j["job_name"] for j in config["scrape_configs"]] == [j["job_name"] for j in compose["scrape_configs"]]
    for job, compose_job in zip(config["scrape_configs"], compose["scrape_configs"]):
        assert job["relabel_configs"] == [{"target_label": "service",
                                           "replacement": compose_job["static_configs"][0]["labels"]["service"]}]
        for sd in job["dns_sd_configs"]:
            for name in sd["names"]:
                assert ("Service", name) in testbed, f"{job['job_name']}: no Service {name}"
                assert sd["port"] in {p["port"] for p in testbed[("Service", name)]["spec"]["ports"]}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)")
def test_scrape_config_passes_promtool():
    path = KUBE / "base" / "prometheus.yml"
    result = subprocess.run(["promtool", "check", "config", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def _issuer_chain(objects: dict, certificate: dict) -> list[str]:
    """The Issuers a Certificate goes back through to a self-signed root: each Issuer's name."""
    chain = []
    while True:
        issuer = objects[("Issuer", certificate["spec"]["issuerRef"]["name"])]
        chain.append(issuer["metadata"]["name"])
        if "selfSigned" in issuer["spec"]:
            return chain
        roots = [o for (k, _), o in objects.items()
                 if k == "Certificate" and o["spec"]["secretName"] == issuer["spec"]["ca"]["secretName"]]
        assert len(roots) == 1 and roots[0]["spec"]["isCA"] is True, issuer
        certificate = roots[0]


def _tls_secret(objects: dict, workload: dict, container: dict) -> str:
    """The Secret a server's --tls-cert comes from."""
    cert = _flags(container)["--tls-cert"]
    mount = next(m for m in container["volumeMounts"] if cert.startswith(m["mountPath"] + "/"))
    volume = next(v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    return volume["secret"]["secretName"]


@pytest.mark.parametrize("overlay", ["testbed", "external", "everything"])
def test_every_hop_is_tls_with_certificates_naming_the_addresses_used(overlay, request):
    """Device to Fed Server, device to Main Server and server to server: every URL is HTTPS, each
    server serves a certificate cert-manager issues into the Secret it mounts, naming every host
    name the others reach it by, and every client verifies against the one CA that issued both.
    The probes and the scrape config speak HTTPS to the servers too."""
    objects = request.getfixturevalue(overlay)
    fed_set, main_set = objects[("StatefulSet", "fed-server")], objects[("StatefulSet", "main-server")]
    fed, main = _container(objects, "StatefulSet", "fed-server"), _container(objects, "StatefulSet", "main-server")
    callers = {"fed-server": [_env(main)["SFL_FED_SERVER_URL"]],
               "main-server": _env(fed)["SFL_MAIN_SERVER_URL"].split(",")}
    if AGENTS in objects:
        agents = _container(objects, *AGENTS)
        callers["fed-server"].append(_flags(agents)["--fed-server-url"])
        assert _mounted_key(objects, objects[AGENTS], agents, _flags(agents)["--ca-file"]) == "ca.crt"
    chains = set()
    for name, workload, container in (("fed-server", fed_set, fed), ("main-server", main_set, main)):
        secret = _tls_secret(objects, workload, container)
        certificate = next(o for (k, _), o in objects.items() if k == "Certificate" and o["spec"]["secretName"] == secret)
        chains.add(tuple(_issuer_chain(objects, certificate)))
        assert "server auth" in certificate["spec"]["usages"]
        for url in callers[name]:
            assert urlsplit(url).scheme == "https", url
            assert urlsplit(url).hostname in certificate["spec"]["dnsNames"], f"{secret} does not name {url}"
        flags = _flags(container)
        assert {_mounted_key(objects, workload, container, flags[f]) for f in ("--tls-cert", "--tls-key", "--ca-file")} \
            == set(ISSUED_KEYS)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"]["scheme"] == "HTTPS", (name, probe)
    assert len(chains) == 1, "one CA issues both servers' certificates, so each verifies the other"
    scrape = yaml.safe_load(objects[("ConfigMap", "s2fl-prometheus-scrape")]["data"]["prometheus.yml"])
    for job in scrape["scrape_configs"]:
        service = job["dns_sd_configs"][0]["names"][0]
        if service in callers:
            certificate = objects[("Certificate", f"{service}-tls")]
            assert job["scheme"] == "https" and job["tls_config"]["server_name"] in certificate["spec"]["dnsNames"]


def test_no_secret_value_is_in_the_manifests():
    """Secrets are referenced: the Secret s2fl-secrets is generated from files the operator writes
    (test_render_refuses_missing_secrets) and the TLS ones are issued by cert-manager; no manifest
    holds a Secret, and no container an inline secret value."""
    for path in KUBE.rglob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is None:
                continue
            assert doc.get("kind") != "Secret", f"{path} inlines a Secret"
    spec = yaml.safe_load((KUBE / "base" / "kustomization.yaml").read_text())
    assert [list(g) for g in spec["secretGenerator"]] == [["name", "files"]], "from files only, no literals"


def _memory_mib(quantity: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "M": 1e6 / 2**20, "G": 1e9 / 2**20}
    number, unit = re.fullmatch(r"(\d+(?:\.\d+)?)([A-Za-z]*)", quantity).groups()
    return float(number) * units[unit] if unit else float(number) / 2**20


#: What a 1 GB board leaves the agent pod: its memory less the OS, the kubelet and the container runtime.
BOARD_MIB = 800


def test_agent_pods_fit_a_1gb_board(testbed):
    """Each agent pod hosts one device, and its memory request and limit fit a 1 GB board, so the
    scheduler can place it on a Raspberry Pi or Jetson node."""
    assert all(len(pod) == 1 for pod in _pods_shards(testbed)), "one device per pod"
    resources = _container(testbed, *AGENTS)["resources"]
    request, limit = _memory_mib(resources["requests"]["memory"]), _memory_mib(resources["limits"]["memory"])
    assert request <= limit <= BOARD_MIB, resources


def test_arm64_boards_component_keeps_the_agents_on_arm64_nodes(testbed, everything):
    assert "nodeSelector" not in testbed[AGENTS]["spec"]["template"]["spec"], "only with the component"
    assert everything[AGENTS]["spec"]["template"]["spec"]["nodeSelector"] == {"kubernetes.io/arch": "arm64"}


def test_service_monitors_scrape_each_in_cluster_service_once(everything, external):
    """One ServiceMonitor per Service of the servers and agents: its selector matches that Service
    and none of the public ones, its port is the Service's, and the servers are scraped over HTTPS
    verified against their own Secret's CA, under a name their certificate holds."""
    monitors = {name: o for (kind, name), o in everything.items() if kind == "ServiceMonitor"}
    services = {name: o for (kind, name), o in everything.items() if kind == "Service"}
    assert set(monitors) == set(services) == {"fed-server", "main-server", "device-agents"}
    public = [o for (kind, _), o in external.items() if kind == "Service" and o["spec"].get("type") == "LoadBalancer"]
    assert public

    def selects(selector: dict, service: dict) -> bool:
        labels = service["metadata"].get("labels", {})
        absent = [e["key"] for e in selector.get("matchExpressions", []) if e["operator"] == "DoesNotExist"]
        assert len(absent) == len(selector.get("matchExpressions", []))
        return selector["matchLabels"].items() <= labels.items() and not any(k in labels for k in absent)

    for name, monitor in monitors.items():
        spec = monitor["spec"]
        assert [s for s in services if selects(spec["selector"], services[s])] == [name]
        assert not any(selects(spec["selector"], s) for s in public), f"{name} would scrape a public Service"
        (endpoint,) = spec["endpoints"]
        assert endpoint["port"] in {p["name"] for p in services[name]["spec"]["ports"]}
        assert endpoint["path"] == "/metrics"
        if name == "device-agents":
            assert endpoint["scheme"] == "http"
            continue
        certificate = everything[("Certificate", f"{name}-tls")]
        assert endpoint["scheme"] == "https"
        assert endpoint["tlsConfig"]["ca"]["secret"] == {"name": certificate["spec"]["secretName"], "key": "ca.crt"}
        assert endpoint["tlsConfig"]["serverName"] in certificate["spec"]["dnsNames"]


def test_grafana_dashboard_is_a_configmap_for_the_sidecar(everything):
    """The compose testbed's dashboard, the same file, as a ConfigMap Grafana's sidecar loads."""
    configmap = everything[("ConfigMap", "s2fl-grafana-dashboard")]
    assert configmap["metadata"]["labels"] == {"grafana_dashboard": "1"}
    compose = yaml.safe_load(COMPOSE.read_text())["services"]["grafana"]["volumes"]
    folder = next(v.split(":")[0] for v in compose if ":/var/lib/grafana/dashboards" in v)
    shipped = {p.name: p.read_text() for p in (ROOT / folder).glob("*.json")}
    assert configmap["data"] == shipped
    assert json.loads(configmap["data"]["s2fl.json"])["title"] == "S2FL testbed"
