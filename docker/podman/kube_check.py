"""`make kube-check`: run the Kubernetes testbed (deploy/kubernetes/overlays/testbed) for real, with podman.

No cluster can be had here, so each pod the manifests make is run as podman would run it for a
kubelet: the same image, args, environment, mounts, user, groups and read-only root, the
ConfigMaps and Secrets written out as the files a kubelet mounts (mode and group included), the
StatefulSet's volume claim as a named volume that outlives its container, and the Services as the
host names their pods answer to. Steps, each timed:

1. podman set up and the server and device images, as ``make compose-check`` does;
2. the TLS certificates and secrets an operator makes without cert-manager (docker/local-ca.sh,
   every name the overlay's Certificates ask for), in a temporary folder;
3. a copy of deploy/kubernetes with those secrets and a short run (docs/deployment.md: 4 rounds,
   4 devices in 2 agent pods, 1200 samples), rendered with docker/podman/kustomize_render.py;
4. one podman container per pod (:func:`pods`, :func:`run_args`) on a network of its own;
5. once the run has recorded and checkpointed a round, the Fed Server's container is killed
   (SIGKILL) and started again, as the kubelet restarts a StatefulSet's pod: the run must resume
   from its volume (the Fed Server logs it) and finish, with every round recorded exactly once;
6. always removes the containers, the volume and the network, and prints PASS/FAIL with the
   timings; on failure, the logs of every container.

What this does not prove (no scheduler, no probes, no NetworkPolicy, no resource limits) is listed
in docs/deployment.md. Run from the repository root with the project's venv.
"""
from __future__ import annotations

import base64
import ipaddress
import json
import os
import re
import secrets
import shutil
import sys
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compose_check as cc  # noqa: E402

cc.LOG_PREFIX = "kube-check"
from kustomize_render import render  # noqa: E402

ROOT = cc.ROOT
sys.path.insert(0, str(ROOT))
from testbed.processes import free_port  # noqa: E402
PREFIX = "sfl-kube"
NETWORK = PREFIX
# A subnet of its own, so that each pod gets a fixed address its Service names resolve to.
SUBNET = ipaddress.ip_network("10.89.213.0/24")
# The short run: the operator's own run.yaml (as small as compose-check's: data.max_samples), and
# the Job's `completions` (each agent pod hosts a contiguous block of the shards). Fewer devices
# than the overlay's 10 also means --shards changes.
ROUNDS = 4
NUM_DEVICES = 4
MAX_SAMPLES = 1200
AGENT_PODS = 2
# What a kubelet sets in each pod of an Indexed Job.
JOB_INDEX_ENV = "JOB_COMPLETION_INDEX"
# Kinds that make no container here: the Services become host names (:func:`host_names`), the
# cert-manager objects are replaced by the Secrets they would issue (:func:`issued_secrets`);
# NetworkPolicies are not enforced and nothing evicts a pod here (docs/deployment.md).
NOT_PODS = {"Service", "ConfigMap", "Secret", "NetworkPolicy", "PodDisruptionBudget", "Issuer", "Certificate"}
# Pod and container fields the conversion reads; those it knowingly leaves to a cluster (a
# scheduler's affinity, probes, resource limits, ports other than the Fed Server's); any other
# field fails the check, so that a manifest change the conversion would drop shows up.
POD_FIELDS = {"containers", "volumes", "securityContext", "restartPolicy", "automountServiceAccountToken",
              "affinity", "nodeSelector", "tolerations"}
CONTAINER_FIELDS = {"name", "image", "imagePullPolicy", "args", "env", "volumeMounts", "securityContext",
                    "ports", "readinessProbe", "startupProbe", "livenessProbe", "resources"}


class ConversionError(cc.CheckFailed):
    """The manifests use something this conversion does not run."""


log = cc.log


@dataclass
class Pod:
    """One pod a workload makes: its name (StatefulSet ``name-N``, Indexed Job ``name-N``), labels,
    pod spec, the StatefulSet's Service (its pods' subdomain), environment a kubelet adds, and the
    volume claims of a StatefulSet (volume name -> claim)."""
    name: str
    labels: dict[str, str]
    spec: dict
    subdomain: str | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    claims: dict[str, str] = field(default_factory=dict)


def short_run_copy(source: Path, target: Path) -> Path:
    """A copy of deploy/kubernetes with what an operator writes (the two secret files, random as
    base/secrets/README.md makes them), a short run.yaml and fewer devices in fewer agent pods;
    returns the testbed overlay's folder."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("service-secret", "enrolment-secret"))
    for name in ("service-secret", "enrolment-secret"):
        (target / "base" / "secrets" / name).write_text(secrets.token_hex(32) + "\n")
    (target / "base" / "run.yaml").write_text(yaml.safe_dump(
        {"algorithm": "s2fl", "rounds": ROUNDS, "data": {"num_devices": NUM_DEVICES, "max_samples": MAX_SAMPLES}}))
    agents = target / "components" / "testbed-devices" / "device-agents.yaml"
    text, completions = re.subn(r"(?m)^  completions: \d+$", f"  completions: {AGENT_PODS}", agents.read_text())
    text, shards = re.subn(r"(?m)^(\s+- --shards\n\s+- )0-9$", rf"\g<1>0-{NUM_DEVICES - 1}", text)
    if (completions, shards) != (1, 1):
        raise ConversionError(f"{agents}: expected one `completions: N` and one `--shards 0-9` to shorten the run")
    agents.write_text(text)
    return target / "overlays" / "testbed"


def tls_names(objects: Iterable[dict]) -> list[str]:
    """Every DNS name and IP address the Certificates of the render ask for (the certificates
    docker/local-ca.sh issues must carry them all, via SFL_TLS_NAMES)."""
    names: list[str] = []
    for obj in objects:
        if obj["kind"] == "Certificate":
            for name in obj["spec"].get("dnsNames", []) + obj["spec"].get("ipAddresses", []):
                if name not in names:
                    names.append(name)
    return names


def issued_secrets(objects: Iterable[dict], pki: Path) -> list[dict]:
    """The Secrets cert-manager would write for the render's server Certificates, from
    docker/local-ca.sh's files instead (docs/operating.md, "TLS on Kubernetes"): ``tls.crt``,
    ``tls.key`` and ``ca.crt`` of ``<server>-tls`` for each server certificate (not the CA's)."""
    secrets = []
    for obj in objects:
        if obj["kind"] != "Certificate" or obj["spec"].get("isCA"):
            continue
        name = obj["spec"]["secretName"]
        server = name.removesuffix("-tls")
        files = {"tls.crt": pki / "server" / f"{server}.pem", "tls.key": pki / "server" / f"{server}-key.pem",
                 "ca.crt": pki / "ca" / "ca.pem"}
        secrets.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "type": "kubernetes.io/tls",
                        "data": {k: base64.b64encode(p.read_bytes()).decode() for k, p in files.items()}})
    return secrets


def pods(objects: Iterable[dict]) -> list[Pod]:
    """The pods the workloads of the render make: a StatefulSet's ``replicas`` (``name-0`` ...,
    with their claims), an Indexed Job's ``completions`` (with its completion index); other kinds
    with a pod template are refused, as are unknown kinds."""
    out = []
    for obj in objects:
        kind, name, spec = obj["kind"], obj["metadata"]["name"], obj.get("spec", {})
        if kind in NOT_PODS:
            continue
        if "template" not in spec:
            raise ConversionError(f"{kind} {name}: not run by this check")
        template = spec["template"]
        labels = template.get("metadata", {}).get("labels", {})
        if kind == "StatefulSet":
            claims = {c["metadata"]["name"]: c["metadata"]["name"] for c in spec.get("volumeClaimTemplates", [])}
            for i in range(spec.get("replicas", 1)):
                out.append(Pod(f"{name}-{i}", labels, template["spec"], subdomain=spec["serviceName"],
                               claims={v: f"{c}-{name}-{i}" for v, c in claims.items()}))
        elif kind == "Job" and spec.get("completionMode") == "Indexed":
            if spec.get("parallelism", 1) != spec["completions"]:
                raise ConversionError(f"Job {name}: parallelism differs from completions; here every pod runs at once")
            for i in range(spec["completions"]):
                out.append(Pod(f"{name}-{i}", labels, template["spec"], extra_env={JOB_INDEX_ENV: str(i)}))
        else:
            raise ConversionError(f"{kind} {name}: not run by this check")
    return out


def addresses(pod_list: list[Pod]) -> dict[str, str]:
    """A fixed address in :data:`SUBNET` for each pod, by name."""
    hosts = SUBNET.hosts()
    next(hosts)  # the gateway
    return {pod.name: str(next(hosts)) for pod in pod_list}


def selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    """Whether a Service's selector matches a pod's labels."""
    return all(labels.get(k) == v for k, v in selector.items())


def host_names(objects: Iterable[dict], pod_list: list[Pod], ips: Mapping[str, str]) -> dict[str, str]:
    """The names cluster DNS gives, with the address each resolves to here: a Service's name (its
    first selected pod, where a cluster balances over them, or for a headless Service lists them
    all: the services call a Service name only where one pod is behind it) and ``<pod>.<service>``
    for each pod of a StatefulSet under its Service."""
    names: dict[str, str] = {}
    for svc in (o for o in objects if o["kind"] == "Service"):
        name = svc["metadata"]["name"]
        selected = [p for p in pod_list if selects(svc["spec"]["selector"], p.labels)]
        if selected:
            names[name] = ips[selected[0].name]
        for pod in selected:
            if pod.subdomain == name:
                names[f"{pod.name}.{name}"] = ips[pod.name]
    return names


def _source_data(objects: Mapping[tuple[str, str], dict], kind: str, name: str) -> dict[str, bytes] | None:
    """The keys of ConfigMap or Secret ``name`` as bytes (a Secret's decoded), None if there is none."""
    obj = objects.get((kind, name))
    if obj is None:
        return None
    data = obj.get("data", {})
    if kind == "Secret":
        return {k: base64.b64decode(v) for k, v in data.items()}
    return {k: v.encode() for k, v in data.items()}


def volume_files(volume: dict, objects: Mapping[tuple[str, str], dict]) -> tuple[dict[str, bytes], int]:
    """The files a kubelet writes for a ConfigMap or Secret volume (its ``items``, or every key) and
    their mode (``defaultMode``, 0644 unless set)."""
    if "secret" in volume:
        kind, source, name = "Secret", volume["secret"], volume["secret"]["secretName"]
    else:
        kind, source, name = "ConfigMap", volume["configMap"], volume["configMap"]["name"]
    data = _source_data(objects, kind, name)
    if data is None:
        raise ConversionError(f"volume {volume['name']}: no {kind} {name}")
    items = source.get("items") or [{"key": k, "path": k} for k in data]
    missing = [i["key"] for i in items if i["key"] not in data]
    if missing:
        raise ConversionError(f"volume {volume['name']}: {kind} {name} has no key {missing}")
    return {i["path"]: data[i["key"]] for i in items}, source.get("defaultMode", 0o644)


def container_env(container: dict, objects: Mapping[tuple[str, str], dict], extra: Mapping[str, str]) -> dict[str, str]:
    """A container's environment as a kubelet sets it: ``value``s, ``configMapKeyRef``/
    ``secretKeyRef`` looked up (an ``optional`` one that is missing is left unset), and what the
    kubelet adds for the pod (``extra``)."""
    env = dict(extra)
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
            continue
        refs = [(k, r) for k, r in (("ConfigMap", var["valueFrom"].get("configMapKeyRef")),
                                    ("Secret", var["valueFrom"].get("secretKeyRef"))) if r]
        if not refs:
            raise ConversionError(f"{container['name']}: env {var['name']}: only values and ConfigMap/Secret keys are run here")
        ref_kind, ref = refs[0]
        data = _source_data(objects, ref_kind, ref["name"]) or {}
        if ref["key"] in data:
            env[var["name"]] = data[ref["key"]].decode()
        elif not ref.get("optional"):
            raise ConversionError(f"{container['name']}: env {var['name']}: no key {ref['key']} in {ref_kind} {ref['name']}")
    return env


def run_args(pod: Pod, objects: Mapping[tuple[str, str], dict], volume_dirs: Mapping[str, Path],
             ip: str, hosts: Mapping[str, str], published: Mapping[int, int]) -> list[str]:
    """``podman run`` arguments that run ``pod``'s one container as a kubelet would: args after the
    image's entrypoint, its environment, the pod's user, group and fsGroup, a read-only root with
    nothing writable but its volumes (``--read-only-tmpfs=false``), no capability, no privilege
    escalation, the ConfigMap/Secret folders in ``volume_dirs`` (by volume name; a ``subPath``
    mounts one file), emptyDirs as tmpfs, claims as named volumes, its address and the cluster's
    names (``hosts``), and the container ports in ``published`` on 127.0.0.1 (container -> host)."""
    unknown = set(pod.spec) - POD_FIELDS
    if unknown or len(pod.spec["containers"]) != 1:
        raise ConversionError(f"pod {pod.name}: fields {sorted(unknown)} or not one container")
    container = pod.spec["containers"][0]
    unknown = set(container) - CONTAINER_FIELDS
    if unknown:
        raise ConversionError(f"pod {pod.name}: container fields {sorted(unknown)} not run here")
    pod_sc, sc = pod.spec.get("securityContext", {}), container.get("securityContext", {})
    args = ["--name", container_name(pod.name), "--hostname", pod.name, "--network", NETWORK, "--ip", ip,
            "--user", pod_user(pod)]
    if "fsGroup" in pod_sc:
        args += ["--group-add", str(pod_sc["fsGroup"])]
    if sc.get("readOnlyRootFilesystem"):
        args += ["--read-only", "--read-only-tmpfs=false"]
    if sc.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    args += [f"--cap-drop={c.lower()}" for c in sc.get("capabilities", {}).get("drop", [])]
    for name, address in sorted(hosts.items()):
        args += ["--add-host", f"{name}:{address}"]
    for port in container.get("ports", []):
        if port["containerPort"] in published:
            args += ["--publish", f"127.0.0.1:{published[port['containerPort']]}:{port['containerPort']}"]
    for key, value in container_env(container, objects, pod.extra_env).items():
        args += ["--env", f"{key}={value}"]
    volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        volume = volumes.get(mount["name"])
        target, ro = mount["mountPath"], ":ro" if mount.get("readOnly") else ""
        if mount["name"] in pod.claims:
            args += ["--volume", f"{PREFIX}-{pod.claims[mount['name']]}:{target}{ro}"]
        elif volume is not None and "emptyDir" in volume:
            args += ["--mount", f"type=tmpfs,destination={target},tmpfs-mode=1777"]
        elif volume is not None and ("secret" in volume or "configMap" in volume):
            source = volume_dirs[mount["name"]] / mount.get("subPath", "")
            args += ["--volume", f"{source}:{target}{ro}"]
        else:
            raise ConversionError(f"pod {pod.name}: volume mount {mount['name']} not run here")
    return args + [container["image"], *container.get("args", [])]


def pod_user(pod: Pod) -> str:
    """``uid:gid`` of the pod's container (its securityContext over the pod's); a pod that does not
    say it runs as a non-root user is refused."""
    pod_sc, sc = pod.spec.get("securityContext", {}), pod.spec["containers"][0].get("securityContext", {})
    user = sc.get("runAsUser", pod_sc.get("runAsUser"))
    group = sc.get("runAsGroup", pod_sc.get("runAsGroup"))
    if user in (None, 0) or not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
        raise ConversionError(f"pod {pod.name}: not a non-root user")
    return f"{user}:{group if group is not None else user}"


def confinement_problems(pod: Pod, inspect: Mapping) -> list[str]:
    """Where the container podman runs (``podman inspect``) is less confined than ``pod`` asks:
    another user, a writable root, privilege escalation allowed (empty: as asked)."""
    sc = pod.spec["containers"][0].get("securityContext", {})
    problems = []
    if inspect["Config"]["User"] != pod_user(pod):
        problems.append(f"user {inspect['Config']['User']!r}, asked for {pod_user(pod)}")
    if sc.get("readOnlyRootFilesystem") and not inspect["HostConfig"]["ReadonlyRootfs"]:
        problems.append("a writable root file system")
    if sc.get("allowPrivilegeEscalation") is False and "no-new-privileges" not in (inspect["HostConfig"]["SecurityOpt"] or []):
        problems.append("privilege escalation allowed")
    return [f"pod {pod.name}: {p}" for p in problems]


def write_volume(folder: Path, files: Mapping[str, bytes], mode: int, group: int | None) -> None:
    """A ConfigMap or Secret volume's files in ``folder``, with the mode and (a pod's fsGroup) the
    group a kubelet gives them, owned by root."""
    folder.mkdir(parents=True)
    folder.chmod(0o755)
    for path, content in files.items():
        target = folder / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
        if group is not None:
            os.chown(target, 0, group)
        target.chmod(mode)


def podman(env: Mapping[str, str], *args: str, check: bool = True) -> str:
    return cc.sh(["podman", *args], env=env, capture=True, check=check)


def container_name(pod: str) -> str:
    return f"{PREFIX}-{pod}"


def teardown(env: Mapping[str, str], pod_list: list[Pod]) -> None:
    """Remove the check's containers, volumes and network (what exists of them)."""
    for pod in pod_list:
        podman(env, "rm", "--force", "--time", "2", container_name(pod.name), check=False)
        for claim in pod.claims.values():
            podman(env, "volume", "rm", "--force", f"{PREFIX}-{claim}", check=False)
    podman(env, "network", "rm", "--force", NETWORK, check=False)


def start(env: Mapping[str, str], pod_list: list[Pod], index: Mapping[tuple[str, str], dict], work: Path,
          published: Mapping[str, Mapping[int, int]]) -> None:
    """The network, the claims' volumes (group-writable by the pod's fsGroup, as a kubelet makes a
    volume), every ConfigMap/Secret volume's files, and one container per pod."""
    ips = addresses(pod_list)
    hosts = host_names(index.values(), pod_list, ips)
    podman(env, "network", "create", "--subnet", str(SUBNET), NETWORK)
    for pod in pod_list:
        fs_group = pod.spec.get("securityContext", {}).get("fsGroup")
        for claim in pod.claims.values():
            podman(env, "volume", "create", f"{PREFIX}-{claim}")
            mountpoint = Path(podman(env, "volume", "inspect", "--format", "{{.Mountpoint}}", f"{PREFIX}-{claim}").strip())
            os.chown(mountpoint, 0, fs_group if fs_group is not None else 0)
            mountpoint.chmod(0o2775)
        dirs = {}
        for volume in pod.spec.get("volumes", []):
            if "secret" in volume or "configMap" in volume:
                files, mode = volume_files(volume, index)
                dirs[volume["name"]] = work / "volumes" / pod.name / volume["name"]
                write_volume(dirs[volume["name"]], files, mode, fs_group)
        args = run_args(pod, index, dirs, ips[pod.name], hosts, published.get(pod.name, {}))
        podman(env, "run", "--detach", *args)
        problems = confinement_problems(pod, json.loads(podman(env, "inspect", container_name(pod.name)))[0])
        if problems:
            raise cc.CheckFailed("; ".join(problems))


def kill_and_restart(env: Mapping[str, str], fed_pod: str, runs: Path, rounds: int, timeout: float,
                     status_url: str, ca_file: Path) -> tuple[str, int]:
    """Once the run has recorded and checkpointed a round, kill the Fed Server's container
    (SIGKILL) and start it again, as the kubelet restarts a StatefulSet's pod. Returns the run's id
    and how many rounds it had recorded when killed (fewer than ``rounds``, or the kill proves nothing)."""
    run_id = ""
    with httpx.Client(timeout=5.0, verify=str(ca_file)) as client:
        def begun() -> bool:
            nonlocal run_id
            try:
                run_id = client.get(status_url).json().get("run_id") or ""
            except (httpx.HTTPError, ValueError):
                return False
            return bool(run_id)

        cc.wait_until("the Fed Server to begin the run", timeout, begun, poll_s=1.0)
    run_dir = runs / run_id
    cc.wait_until(f"run {run_id} to record and checkpoint a round", timeout,
                  lambda: cc.recorded_rounds(cc.read_metrics(run_dir)) > 0 and (run_dir / "checkpoint.msgpack").is_file(),
                  poll_s=0.1)
    podman(env, "kill", "--signal", "KILL", container_name(fed_pod))
    recorded = cc.recorded_rounds(cc.read_metrics(run_dir))
    if recorded >= rounds:
        raise cc.CheckFailed(f"run {run_id} had recorded all {rounds} rounds before the Fed Server was killed")
    log(f"run {run_id}: Fed Server killed (SIGKILL) with {recorded} of {rounds} rounds recorded; starting it again")
    podman(env, "start", container_name(fed_pod))
    return run_id, recorded


def running(env: Mapping[str, str], pod: str) -> bool:
    return podman(env, "inspect", "--format", "{{.State.Running}}", container_name(pod), check=False).strip() == "true"


def wait_finished(env: Mapping[str, str], agents: list[str], timeout: float, status_url: str, ca_file: Path) -> dict:
    """Poll the Fed Server's status (HTTPS, verified against the CA) until the run is finished;
    fail early when its driver failed or every agent exited before the end."""
    status: dict = {}
    with httpx.Client(timeout=5.0, verify=str(ca_file)) as client:
        def done() -> bool:
            nonlocal status
            try:
                status = client.get(status_url).json()
            except (httpx.HTTPError, ValueError):
                return False
            if status.get("driver_error"):
                raise cc.CheckFailed(f"the Fed Server's driver failed: {status['driver_error']}")
            if status.get("state") != "finished" and not any(running(env, a) for a in agents):
                raise cc.CheckFailed(f"every agent exited before the run finished (state {status.get('state')})")
            return status.get("state") == "finished"

        try:
            cc.wait_until("the run to finish", timeout, done)
        except cc.CheckFailed as e:
            raise cc.CheckFailed(f"{e}; run state {status.get('state')!r}, round {status.get('rounds_done')}") from None
    return status


def main(argv: list[str] | None = None) -> int:
    """Run the check; 0 on PASS, 1 on FAIL."""
    args = cc.parse_args((__doc__ or "").splitlines()[0], argv)
    step = cc.Steps()
    failed: str | None = None
    pod_list: list[Pod] = []
    env: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="kube-check-") as tmp:
        work = Path(tmp)
        try:
            env = step("podman setup", cc.podman_env)
            cc.build_images(env, args.wheels, args.ca_bundle, step, with_prometheus=False)
            objects = render(short_run_copy(ROOT / "deploy" / "kubernetes", work / "kubernetes"))
            # The certificates carry every name the manifests' Certificates ask for.
            pki = work / "pki"
            step("certificates", cc.sh, ["bash", str(ROOT / "docker" / "local-ca.sh"), str(pki)],
                 {"SFL_TLS_NAMES": ",".join(tls_names(objects))}, True)
            objects += issued_secrets(objects, pki)
            index = {(o["kind"], o["metadata"]["name"]): o for o in objects}
            pod_list = pods(objects)
            fed = next(p.name for p in pod_list if p.labels.get("app.kubernetes.io/component") == "fed-server")
            agents = [p.name for p in pod_list if p.labels.get("app.kubernetes.io/component") == "device-agent"]
            log("pods: " + ", ".join(p.name for p in pod_list))
            teardown(env, pod_list)  # leftovers of an interrupted check
            port = free_port()
            step("pods up", start, env, pod_list, index, work, {fed: {8080: port}})
            status_url = f"https://127.0.0.1:{port}/v1/status"
            ca_file = pki / "ca" / "ca.pem"
            claim = next(iter(next(p for p in pod_list if p.name == fed).claims.values()))
            runs = Path(podman(env, "volume", "inspect", "--format", "{{.Mountpoint}}", f"{PREFIX}-{claim}").strip())
            run_id, _ = step("run until killed", kill_and_restart, env, fed, runs, ROUNDS, args.timeout, status_url, ca_file)
            status = step("resumed run", wait_finished, env, agents, args.timeout, status_url, ca_file)
            if status["run_id"] != run_id:
                raise cc.CheckFailed(f"the restarted Fed Server finished run {status['run_id']}, not the interrupted {run_id}")
            after = cc.resumed_after(podman(env, "logs", container_name(fed)), run_id)
            if after is None:
                raise cc.CheckFailed(f"the restarted Fed Server did not log that it resumed run {run_id}")
            log(f"run {run_id}: resumed after round {after}")
            cc.check_finished_run(runs / run_id, ROUNDS)
        except cc.CheckFailed as e:
            failed = str(e)
            cc.dump_logs(env, {pod.name: container_name(pod.name) for pod in pod_list})
        finally:
            if env and pod_list:
                step("teardown", teardown, env, pod_list)
    return step.verdict(failed)


if __name__ == "__main__":
    sys.exit(main())
