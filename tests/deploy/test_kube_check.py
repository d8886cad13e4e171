"""The pieces of `make kube-check` (docker/podman/kube_check.py) that need no containers: the
short-run copy of the manifests, the pods the workloads make, the host names their Services give,
the files of ConfigMap/Secret volumes, the environment, the ``podman run`` arguments that run a pod
as a kubelet would (and the refusals of what they cannot run), and the verdict on a container's
confinement. The check itself runs with `make kube-check`, not in the suite."""
from __future__ import annotations

import copy
import shutil
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docker" / "podman"))
import kube_check  # noqa: E402

UID = "10001:10001"


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> list[dict]:
    """The testbed overlay shortened as the check runs it, with the TLS Secrets it makes from
    docker/local-ca.sh's files (placeholders here)."""
    work = tmp_path_factory.mktemp("kube-check")
    objects = kube_check.render(kube_check.short_run_copy(ROOT / "deploy" / "kubernetes", work / "kubernetes"))
    pki = work / "pki"
    (pki / "server").mkdir(parents=True)
    (pki / "ca").mkdir()
    for server in ("fed-server", "main-server"):
        (pki / "server" / f"{server}.pem").write_text(f"{server} certificate")
        (pki / "server" / f"{server}-key.pem").write_text(f"{server} key")
    (pki / "ca" / "ca.pem").write_text("CA certificate")
    return objects + kube_check.issued_secrets(objects, pki)


@pytest.fixture(scope="module")
def index(rendered) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in rendered}


@pytest.fixture(scope="module")
def pods(rendered) -> dict[str, kube_check.Pod]:
    return {p.name: p for p in kube_check.pods(rendered)}


def _args(pod: kube_check.Pod, index, hosts=None, published=None) -> list[str]:
    dirs = {v["name"]: Path("/vol") / pod.name / v["name"] for v in pod.spec.get("volumes", [])
            if "secret" in v or "configMap" in v}
    return kube_check.run_args(pod, index, dirs, "10.0.0.9", hosts or {}, published or {})


def _pairs(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]


def test_short_run_copy_shortens_the_run_and_the_agents(index):
    run = yaml.safe_load(next(o for (k, n), o in index.items() if k == "ConfigMap" and n.startswith("s2fl-run-config-"))
                         ["data"]["run.yaml"])
    assert run == {"algorithm": "s2fl", "rounds": kube_check.ROUNDS,
                   "data": {"num_devices": kube_check.NUM_DEVICES, "max_samples": kube_check.MAX_SAMPLES}}
    job = index[("Job", "device-agents")]["spec"]
    assert job["completions"] == job["parallelism"] == kube_check.AGENT_PODS
    args = job["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--shards") + 1] == f"0-{kube_check.NUM_DEVICES - 1}"


def test_short_run_copy_refuses_manifests_it_cannot_shorten(tmp_path):
    source = tmp_path / "source"
    shutil.copytree(ROOT / "deploy" / "kubernetes", source)
    agents = source / "components" / "testbed-devices" / "device-agents.yaml"
    agents.write_text(agents.read_text().replace("- 0-9", "- 0-19"))
    with pytest.raises(kube_check.ConversionError, match="--shards 0-9"):
        kube_check.short_run_copy(source, tmp_path / "copy")


def test_workloads_make_one_pod_per_replica_and_completion_index(pods):
    assert sorted(pods) == ["device-agents-0", "device-agents-1", "fed-server-0", "main-server-0", "main-server-1"]
    assert pods["fed-server-0"].claims == {"runs": "runs-fed-server-0"}
    assert pods["fed-server-0"].subdomain == "fed-server"
    assert [pods[f"device-agents-{i}"].extra_env for i in range(2)] == [{"JOB_COMPLETION_INDEX": "0"},
                                                                         {"JOB_COMPLETION_INDEX": "1"}]
    assert not pods["device-agents-0"].claims and pods["device-agents-0"].subdomain is None


def test_pods_refuses_what_it_does_not_run(index):
    deployment = {"kind": "Deployment", "metadata": {"name": "x"}, "spec": {"template": {"spec": {}}}}
    with pytest.raises(kube_check.ConversionError, match="Deployment x"):
        kube_check.pods([deployment])
    with pytest.raises(kube_check.ConversionError, match="Ingress y"):
        kube_check.pods([{"kind": "Ingress", "metadata": {"name": "y"}, "spec": {}}])
    job = copy.deepcopy(index[("Job", "device-agents")])
    job["spec"]["parallelism"] = 1
    with pytest.raises(kube_check.ConversionError, match="parallelism"):
        kube_check.pods([job])


def test_every_url_the_services_call_resolves_to_the_pod_behind_it(rendered, pods):
    pod_list = list(pods.values())
    ips = kube_check.addresses(pod_list)
    hosts = kube_check.host_names(rendered, pod_list, ips)
    assert len(set(ips.values())) == len(ips)
    assert hosts["fed-server"] == ips["fed-server-0"]
    assert hosts["main-server-0.main-server"] == ips["main-server-0"]
    assert hosts["main-server-1.main-server"] == ips["main-server-1"]
    index = {(o["kind"], o["metadata"]["name"]): o for o in rendered}
    called = set()
    for pod in pod_list:
        env = kube_check.container_env(pod.spec["containers"][0], index, pod.extra_env)
        words = list(env.values()) + pod.spec["containers"][0]["args"]
        called |= {urlsplit(u).hostname for w in words for u in w.split(",") if u.startswith("https://")}
    assert called == {"fed-server", "main-server-0.main-server", "main-server-1.main-server"}
    assert called <= set(hosts)


def test_run_args_run_the_container_as_its_pod_asks(index, pods):
    pod = pods["fed-server-0"]
    container = pod.spec["containers"][0]
    args = _args(pod, index, {"fed-server": "10.0.0.9"}, {8080: 18080})
    image = args.index(container["image"])
    assert args[image + 1:] == container["args"]
    assert _pairs(args, "--user") == [UID] and _pairs(args, "--group-add") == ["10001"]
    assert {"--read-only", "--read-only-tmpfs=false", "--cap-drop=all"} <= set(args)
    assert _pairs(args, "--security-opt") == ["no-new-privileges"]
    assert _pairs(args, "--add-host") == ["fed-server:10.0.0.9"]
    assert _pairs(args, "--publish") == ["127.0.0.1:18080:8080"]
    assert _pairs(args, "--ip") == ["10.0.0.9"] and _pairs(args, "--network") == [kube_check.NETWORK]
    assert sorted(_pairs(args, "--volume")) == [
        "/vol/fed-server-0/run-config/run.yaml:/etc/s2fl/run.yaml:ro",  # subPath: the one file
        "/vol/fed-server-0/secrets:/etc/s2fl/secrets:ro",
        "/vol/fed-server-0/tls:/etc/s2fl/tls:ro",
        f"{kube_check.PREFIX}-runs-fed-server-0:/runs",
    ]
    assert _pairs(args, "--mount") == ["type=tmpfs,destination=/tmp,tmpfs-mode=1777"]
    env = _pairs(args, "--env")
    assert "SFL_WAIT_ON_REFUSAL=1" in env
    # Optional and absent without overlays/external-devices: unset, as a kubelet leaves it.
    assert not any(e.startswith("SFL_MAIN_SERVER_PUBLIC_URL=") for e in env)


def test_run_args_refuse_what_a_pod_asks_and_podman_would_not_do(index, pods):
    for change, message in ((lambda s: s.__setitem__("hostNetwork", True), "fields"),
                            (lambda s: s["containers"][0].__setitem__("command", ["sh"]), "container fields"),
                            (lambda s: s["securityContext"].pop("runAsNonRoot"), "non-root"),
                            (lambda s: s["securityContext"].__setitem__("runAsUser", 0), "non-root"),
                            (lambda s: s["volumes"].append({"name": "host", "hostPath": {"path": "/"}}) or
                             s["containers"][0]["volumeMounts"].append({"name": "host", "mountPath": "/h"}),
                             "volume mount host")):
        pod = copy.deepcopy(pods["main-server-0"])
        change(pod.spec)
        with pytest.raises(kube_check.ConversionError, match=message):
            _args(pod, index)


def test_volume_files_are_the_items_with_their_mode(index, pods):
    volumes = {v["name"]: v for v in pods["device-agents-0"].spec["volumes"]}
    files, mode = kube_check.volume_files(volumes["ca"], index)
    assert files == {"ca.crt": b"CA certificate"} and mode == 0o440  # never the key
    files, mode = kube_check.volume_files(volumes["secrets"], index)
    assert set(files) == {"enrolment-secret"} and mode == 0o440
    fed = {v["name"]: v for v in pods["fed-server-0"].spec["volumes"]}
    files, mode = kube_check.volume_files(fed["run-config"], index)
    assert set(files) == {"run.yaml"} and mode == 0o644
    missing = copy.deepcopy(volumes["ca"])
    missing["secret"]["items"][0]["key"] = "nope"
    with pytest.raises(kube_check.ConversionError, match="no key"):
        kube_check.volume_files(missing, index)
    with pytest.raises(kube_check.ConversionError, match="no Secret"):
        kube_check.volume_files({"name": "x", "secret": {"secretName": "absent"}}, index)


def test_container_env_resolves_references_and_leaves_optional_missing_ones_unset():
    objects = {("ConfigMap", "cm"): {"data": {"a": "from-cm"}}, ("Secret", "s"): {"data": {"b": "ZnJvbS1z"}}}
    container = {"name": "c", "env": [
        {"name": "PLAIN", "value": "1"},
        {"name": "A", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "a"}}},
        {"name": "B", "valueFrom": {"secretKeyRef": {"name": "s", "key": "b"}}},
        {"name": "GONE", "valueFrom": {"configMapKeyRef": {"name": "other", "key": "k", "optional": True}}}]}
    assert kube_check.container_env(container, objects, {"X": "y"}) == \
        {"X": "y", "PLAIN": "1", "A": "from-cm", "B": "from-s"}
    container["env"][3]["valueFrom"]["configMapKeyRef"].pop("optional")
    with pytest.raises(kube_check.ConversionError, match="GONE"):
        kube_check.container_env(container, objects, {})


def test_certificates_carry_every_name_the_manifests_ask_for(rendered):
    names = kube_check.tls_names(rendered)
    assert {"fed-server", "main-server-0.main-server", "main-server-1.main-server", "127.0.0.1"} <= set(names)
    issued = {o["metadata"]["name"]: set(o["data"]) for o in rendered if o.get("type") == "kubernetes.io/tls"}
    assert issued == {"fed-server-tls": {"tls.crt", "tls.key", "ca.crt"}, "main-server-tls": {"tls.crt", "tls.key", "ca.crt"}}


def test_confinement_verdict(pods):
    pod = pods["fed-server-0"]
    good = {"Config": {"User": UID}, "HostConfig": {"ReadonlyRootfs": True, "SecurityOpt": ["no-new-privileges"]}}
    assert kube_check.confinement_problems(pod, good) == []
    bad = {"Config": {"User": "0:0"}, "HostConfig": {"ReadonlyRootfs": False, "SecurityOpt": None}}
    assert kube_check.confinement_problems(pod, bad) == [
        f"pod fed-server-0: user '0:0', asked for {UID}", "pod fed-server-0: a writable root file system",
        "pod fed-server-0: privilege escalation allowed"]
