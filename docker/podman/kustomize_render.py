"""A renderer of the kustomize features deploy/kubernetes uses: what ``kubectl apply -k`` would
apply, without kubectl. tests/deploy/test_kubernetes.py checks that it renders exactly what
``kubectl kustomize`` does and how it fails; docker/podman/kube_check.py renders the testbed with it.

Implemented: resources, components, ConfigMap/Secret generators with labels, annotations and
kustomize's name hash suffix (or without it), the references in pod templates rewritten to the
suffixed names, replacements of one field or of one part of a delimited string, JSON 6902 patches
that add or replace a field. Any other kustomization key, generator or replacement option is an
error (RenderError), and so is a generated name in a field this does not rewrite, so a manifest change
that needs real kustomize shows up instead of being rendered wrongly.
"""
from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import yaml

WORKLOADS = ("Deployment", "StatefulSet", "Job")
# The kustomization keys the renderer implements; anything else fails the render.
KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "components", "generatorOptions",
                      "configMapGenerator", "secretGenerator", "replacements", "patches"}


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
