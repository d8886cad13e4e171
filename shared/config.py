"""Run configuration: one pydantic model, loaded from a YAML/JSON file, environment and flags.

The Fed Server owns the run configuration; devices and the Main Server receive the parts they
need in messages, so every process works from the same resolved values.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shared.data.spec import DataSpec
from shared.losses import DEFAULT_LOSS, Task, resolve_task


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DpSgdConfig(_Strict):
    """Sample-level differential privacy on the devices: DP-SGD (Abadi et al. 2016) through Opacus.
    Every step of a device's local training clips each sample's gradient of the blocks the device
    trains to ``max_grad_norm`` and adds Gaussian noise of ``noise_multiplier`` x that bound to
    their sum; the Fed Server accounts each device's epsilon at ``delta`` with Opacus's Renyi-DP
    accountant (docs/privacy.md, "Sample-level DP-SGD"). Device side only: the Main Server trains
    as before."""

    noise_multiplier: float = Field(gt=0, allow_inf_nan=False)
    max_grad_norm: float = Field(1.0, gt=0, allow_inf_nan=False)
    delta: float = Field(1e-5, gt=0, lt=1)


class TrainConfig(_Strict):
    """Local training hyperparameters, the same on devices and on the Main Server, and the loss
    that all of them compute (docs/models.md, "Loss and task")."""

    lr: float = Field(0.05, gt=0)
    momentum: float = Field(0.0, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    batch_size: int = Field(32, ge=1, le=4096)
    local_epochs: int = Field(1, ge=1, le=100)
    # A built-in loss (shared/losses.py LOSSES) or an import path package.module:function.
    loss: str = Field(DEFAULT_LOSS, min_length=1)
    # classification (integer class labels, accuracy) or regression (float targets, MSE and MAE).
    # None: the built-in loss's own; required for an import-path loss. Always set once validated.
    task: Task | None = None
    # Sample-level DP-SGD on the devices' trained blocks (null: none); checked against the model,
    # the algorithm and the split mode by shared/run_config.py.
    dp_sgd: DpSgdConfig | None = None

    @model_validator(mode="after")
    def _resolve_task(self) -> "TrainConfig":
        self.task = resolve_task(self.loss, self.task)
        return self

    @property
    def resolved_task(self) -> Task:
        """The run's task (set by validation: the loss's own or the explicit one)."""
        assert self.task is not None
        return self.task


class SplitConfig(_Strict):
    """How the Fed Server picks each device's split point.

    ``sliding`` None means "the algorithm's default" (on for S2FL, off for SFL); FedAvg-family
    algorithms always train the whole model on the device (split depth zero).
    """

    sliding: bool | None = None
    smoothing: float = Field(0.5, gt=0, le=1)
    server_flops: float = Field(5e10, gt=0)  # Comp_s in Eq. 1 (paper: 5e10)
    # The cut points the planner chooses among (shared.models.profile.candidate_split_points): None,
    # every one of the model's; a number N, N of them spread over the model at its smallest
    # activations; a list, those. A deep traced model has one per layer boundary, and S2FL's
    # warm-up takes a round per candidate. Checked against the model by shared/run_config.py.
    candidates: int | list[int] | None = None
    # How the sliding split learns each device's time at every candidate before its median rule
    # decides (fed_server/time_table.py): ``every_split``, the paper's: one round at each candidate;
    # ``estimated`` (the default, a deviation from the paper: docs/s2fl.md), one round at the first
    # candidate, then the rule on the measured cells and Eq. 1 estimates of the others (a device
    # tries a candidate only when the rule picks it).
    warm_up: Literal["every_split", "estimated"] = "estimated"
    # The median rule never gives a device a split that makes the round longer than its bottleneck
    # (the largest of the selected devices' cheapest times, within the table's noise), its own
    # time or its portion's transfers, which hold up its group's steps: it balances the devices
    # below the slowest one instead of lengthening the round (fed_server/time_table.py). False:
    # the paper's rule as written.
    bottleneck_cap: bool = True
    # The median rule never gives a device a split that a deeper split of its own matches in time
    # (within the table's noise): that split would put more layers' work on the Main Server, which
    # the group's other members wait for at every step, for no shorter round
    # (fed_server/time_table.py). False, with bottleneck_cap false: the paper's rule as written.
    undominated: bool = True
    # Device id -> the split point it always gets (one of the candidates; checked by
    # shared/run_config.py), whatever the sliding split would choose: a board that cannot hold
    # more layers, or a run with a fixed split per device to compare with.
    pinned: dict[str, int] = Field(default_factory=dict)

    @field_validator("candidates", mode="before")
    @classmethod
    def _candidates(cls, value: Any) -> Any:
        # One line for any wrong shape, not pydantic's line per member of the union.
        def whole(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)
        if value is None or (whole(value) and value >= 1) or (isinstance(value, list) and value and all(map(whole, value))):
            return value
        raise ValueError(f"a number of cut points (at least 1) or a list of the model's split points, e.g. 4 or "
                         f"[2, 5, 9]; got {value!r}")

    # U-shaped split learning (docs/split-privacy.md): the device keeps the model's last ``head_blocks``
    # blocks and the loss besides its first ones, and the Main Server trains only the middle, so no
    # label leaves the device. Off: the paper's split, where the Main Server computes the loss.
    u_shaped: bool = False
    head_blocks: int = Field(1, ge=1)

    def head_start(self, num_blocks: int) -> int:
        """The first block of the device's head in a model of ``num_blocks`` blocks: where the
        Main Server's portion ends (``num_blocks`` unless U-shaped: the server computes the loss)."""
        return num_blocks - self.head_blocks if self.u_shaped else num_blocks


class GroupingConfig(_Strict):
    """How the Main Server groups devices (S2FL's data-balance mechanism, Eq. 2) and combines a
    group's losses. ``method`` and ``group_loss`` name plug-ins registered in
    ``shared/algorithms/registry.py`` (``GROUPINGS``, ``GROUP_LOSSES``, ``MEMBER_DEFENCES``;
    docs/s2fl.md, docs/security.md); the names
    are checked by ``shared/run_config.py``, so this schema does not import the algorithms.

    ``label_balance`` is the ablation switch: true = ``balanced``, false = ``singleton``, None =
    the algorithm's default. ``method`` names any grouping instead; set at most one of the two.
    """

    label_balance: bool | None = None
    method: str | None = None
    # 4, not 5: with two groups of five the default run's sliding split collapsed to split 1 in
    # most runs on a fast host (docs/s2fl.md, "Data-balance grouping").
    group_size: int = Field(4, ge=1)
    # data_weighted, not per_member: with members of different data sizes, per_member's surplus
    # steps (only the larger members left) move the whole group's copy at full rate, which made
    # S2FL unstable on non-IID shards (docs/s2fl.md, "Members with more steps than others").
    group_loss: str = "data_weighted"
    # The largest |activation| the Main Server accepts in a member's step; a member whose step
    # exceeds it is dropped from its group. The built-in models' activations on MNIST stay below
    # 20 (docs/configuration.md), so 1e4 refuses only what would swamp the group's shared copy.
    max_activation: float = Field(1e4, gt=0, allow_inf_nan=False)
    # What each group step does against a harmful member, in order (MEMBER_DEFENCES; none: the
    # paper's step), and their parameters by name (shared/algorithms/member_defence.py).
    member_defences: list[str] = Field(default_factory=list)
    member_defence_params: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_switch(self) -> "GroupingConfig":
        if self.method is not None and self.label_balance is not None:
            raise ValueError("set grouping.method or grouping.label_balance, not both")
        return self


class SplitPrivacyConfig(_Strict):
    """What a device does so that what it sends gives less of its data away (docs/split-privacy.md).

    ``defences`` name plug-ins registered in ``PRIVACY_DEFENCES`` (``shared/algorithms/registry.py``),
    applied in order, with their parameters by name in ``defence_params``; checked by
    ``shared/run_config.py`` (this schema imports no algorithm). ``label_counts``: what a device
    tells the servers of its samples per class, which the data-balance grouping needs: ``exact``
    (the paper), ``local_dp`` (each count with two-sided geometric noise for
    ``label_counts_epsilon``-local differential privacy, drawn once per device) or ``withheld``
    (none: the run must group without counts, e.g. ``grouping.method: random``).
    """

    defences: list[str] = Field(default_factory=list)
    defence_params: dict[str, dict[str, Any]] = Field(default_factory=dict)
    label_counts: Literal["exact", "local_dp", "withheld"] = "exact"
    label_counts_epsilon: float = Field(1.0, gt=0, allow_inf_nan=False)


class DeadlineConfig(_Strict):
    """Seconds after which a missing party is dropped so nobody waits forever, and the quorum."""

    round_s: float = Field(300.0, gt=0)
    join_s: float = Field(30.0, gt=0)
    step_s: float = Field(30.0, gt=0)
    # Two-phase algorithms (FNR-FL): reports are awaited this long after the round opens, then the
    # devices that reported get their follow-ups and the round waits for their uploads until
    # round_s. None: half of round_s. Without it, one silent device held the report phase to the
    # round deadline and the reporters never got a follow-up in time.
    report_s: float | None = Field(None, gt=0)
    # A round aggregated from fewer devices is recorded as failed and retried (never applied).
    min_participants: int = Field(1, ge=1)
    # Rounds start when every shard is registered, or after this long with at least
    # min_participants registered (a resumed run whose devices did not all come back).
    registration_s: float = Field(120.0, gt=0)
    # The run stops (summary says why) after this many failed attempts in a row.
    max_failed_attempts: int = Field(10, ge=1)
    # Federated evaluation: after aggregating, the Fed Server waits this long for the devices'
    # evaluation reports; the round's accuracy is the mean over those that arrived.
    evaluate_s: float = Field(30.0, gt=0)
    # A selected device that let a deadline pass (never joined its group, reported or uploaded)
    # is not selected for the next 1, 2, 4, ... attempts (doubling with each miss in a row), at
    # most this many; an upload in time clears it (registering again does not). 0: always selectable
    # (fed_server/missed_deadlines.py).
    max_skip_rounds: int = Field(16, ge=0)
    # Each selected device is also waited for only until patience x its expected round time
    # (its own usual time at its split point, or its peers' once half of them uploaded) plus
    # patience_grace_s, counted from its task; then it is taken out as if it had missed the round
    # deadline. null: only round_s applies (fed_server/device_pace.py).
    patience: float | None = Field(2.0, ge=1.0)
    patience_grace_s: float = Field(1.0, ge=0)
    # A device's peers' time (and the cap on its learnt usual time) leaves out this many of the
    # slowest arrivals, while those counted are at least half of the attempt, so that up to
    # ignore_slowest + 1 devices slow on purpose together cannot stretch each other's deadlines
    # (shared/own_deadline.py). 0: the slowest arrival counts.
    ignore_slowest: int = Field(1, ge=0)
    # A registered device that registers again sooner than this after its last registration is
    # refused with 429 and a Retry-After (fed_server/reregistrations.py): a device re-registering
    # in a loop costs the Fed Server one cheap refusal per request. 0: no limit.
    reregistration_s: float = Field(10.0, ge=0)


#: The paper's High:Mid:Low = 5:3:2 composition, interleaved so any 10 consecutive shards hold it.
MIX_532 = ["high", "mid", "high", "low", "high", "mid", "high", "low", "mid", "high"]


class UpdateCheckConfig(_Strict):
    """What the Fed Server does with an upload whose update (weights - global) is too large.

    A device with corrupted data or a bug (or a malicious one) can send an update that swamps the
    average; ``max_norm`` bounds it. None = no check.
    """

    max_norm: float | None = Field(None, gt=0)
    action: Literal["reject", "clip"] = "reject"


class AggregationConfig(_Strict):
    """How the Fed Server combines a round's uploads: ``rule`` names a rule registered in
    ``AGGREGATION_RULES`` (``shared/algorithms/registry.py``) and ``params`` are its parameters,
    both checked by ``shared/run_config.py`` (this schema imports no algorithm). The default bounds
    each device's weight and each update relative to the round (docs/configuration.md, ``aggregation.*``)."""

    rule: str = "bounded_mean"
    params: dict[str, Any] = Field(default_factory=dict)


class PrivacyConfig(_Strict):
    """Client-level differential privacy in the style of DP-FedAvg (McMahan et al. 2018;
    docs/privacy.md): every device clips the change of its portion (``clipping``), Gaussian noise of
    ``noise_multiplier`` x the clip bound is added to the sum of the clipped changes, by the Fed
    Server (``noise: central``) or in shares by the devices under secure aggregation (``noise:
    distributed``), and an accountant (Opacus's) turns the history into an epsilon at ``delta``.

    The checks that need the algorithm registry (which algorithms and rules can run privately)
    are in ``shared/run_config.py``; this schema imports no algorithm and no accountant.
    """

    # null: no clipping (and no differential privacy); fixed: every round clips to clip_norm;
    # adaptive: clip_norm is the first round's bound, then it follows the target_quantile of the
    # devices' update norms (Andrew et al. 2021, "Differentially private learning with adaptive
    # clipping").
    clipping: Literal["fixed", "adaptive"] | None = None
    clip_norm: float = Field(1.0, gt=0, allow_inf_nan=False)
    target_quantile: float = Field(0.5, gt=0, lt=1)
    clip_learning_rate: float = Field(0.2, gt=0, allow_inf_nan=False)
    # The standard deviation of the noise on the count of unclipped devices (adaptive clipping);
    # null: devices per round / 20, the paper's choice.
    clipped_count_stddev: float | None = Field(None, gt=0, allow_inf_nan=False)
    # Where the Gaussian noise is added: null (none: clipping only, no epsilon), central (the Fed
    # Server, to the sum of the clipped updates it aggregates) or distributed (each device adds its
    # share to its update before masking it, under secure_aggregation with a threshold t: a share's
    # variance is 1/t of the sum's, so any t or more survivors' sum carries at least the whole noise).
    noise: Literal["central", "distributed"] | None = None
    # z: the noise's standard deviation over the clip bound. null with target_epsilon: the z that
    # spends target_epsilon in exactly `rounds` rounds (Opacus's get_noise_multiplier).
    noise_multiplier: float | None = Field(None, gt=0, allow_inf_nan=False)
    # The budget: the run stops, with a message, before a round would raise epsilon past it.
    target_epsilon: float | None = Field(None, gt=0, allow_inf_nan=False)
    delta: float = Field(1e-5, gt=0, lt=1)
    # Opacus's Renyi-DP accountant (rdp) or its privacy-random-variable accountant (prv).
    accountant: Literal["rdp", "prv"] = "rdp"

    @model_validator(mode="after")
    def _consistent(self) -> "PrivacyConfig":
        if self.noise is not None and self.clipping is None:
            raise ValueError("privacy.noise needs privacy.clipping (fixed or adaptive): the noise is a multiple of the "
                             "clip bound")
        if self.noise is None and (self.noise_multiplier is not None or self.target_epsilon is not None):
            raise ValueError("privacy.noise_multiplier and privacy.target_epsilon need privacy.noise (central or "
                             "distributed)")
        if self.noise == "distributed" and self.clipping != "fixed":
            raise ValueError("privacy.noise: distributed needs privacy.clipping: fixed (adaptive clipping's count of "
                             "unclipped updates is noised by the Fed Server, which secure aggregation keeps from "
                             "seeing the updates)")
        if self.noise is not None and self.noise_multiplier is None and self.target_epsilon is None:
            raise ValueError("privacy.noise needs privacy.noise_multiplier or privacy.target_epsilon (or both)")
        return self

    @property
    def enabled(self) -> bool:
        """Whether devices clip their updates (and the Fed Server aggregates them as private ones)."""
        return self.clipping is not None


class SecureAggregationConfig(_Strict):
    """Secure aggregation in the manner of SecAgg+ (Bell et al., CCS 2020; docs/privacy.md): each
    device masks its fixed-point update with pairwise masks agreed by key exchange and its own
    mask, and Shamir-shares its secrets with the round's other devices, so that the Fed Server
    learns only the sum of the updates. Which runs can use it is checked in
    ``shared/run_config.py``."""

    enabled: bool = False
    # How many other devices each device shares its secrets and masks with (SecAgg+'s sparse
    # graph, an even count: half on each side of it on a ring in a fresh random order every
    # attempt); null: every other device of the attempt (SecAgg's complete graph), whose share
    # and unmasking work grows with the square of the devices.
    neighbours: int | None = Field(None, ge=2)
    # How many shares of a device's neighbourhood (itself and its neighbours) rebuild its
    # secrets; null: a majority of the neighbourhood. Fewer answers from a neighbourhood in the
    # unmasking stage fail the attempt.
    threshold: int | None = Field(None, ge=2)
    # Each entry of a device's update (its change over the round) is clipped to +-value_range
    # before it is encoded: the fixed-point range, chosen so that the round's sum never wraps.
    value_range: float = Field(1.0, gt=0, allow_inf_nan=False)
    # Seconds the key and share stages each wait for the round's devices before they go on
    # with those that answered.
    stage_s: float = Field(30.0, gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _graph_fits(self) -> "SecureAggregationConfig":
        if self.neighbours is not None and self.neighbours % 2:
            raise ValueError(f"secure_aggregation.neighbours must be even (half on each side of a device on the "
                             f"ring), not {self.neighbours}")
        if self.neighbours is not None and self.threshold is not None and self.threshold > self.neighbours + 1:
            raise ValueError(f"secure_aggregation.threshold {self.threshold} exceeds a neighbourhood's "
                             f"{self.neighbours + 1} shares (the device and its {self.neighbours} neighbours)")
        return self


class DeviceMixConfig(_Strict):
    """Emulated device kinds (paper Table 1, see shared/profiles.py), assigned round-robin to shards.

    An empty list means real devices: no emulation, measured times only.
    """

    profiles: list[str] = Field(default_factory=lambda: list(MIX_532))
    # Emulated transfer times are compressed by this factor so a testbed round takes seconds;
    # "auto": by a factor derived from the agent's measured host speed (shared/profiles.py).
    time_scale: Annotated[float, Field(gt=0, allow_inf_nan=False)] | Literal["auto"] = "auto"

    @field_validator("profiles")
    @classmethod
    def _known_kinds(cls, value: list[str]) -> list[str]:
        from shared.profiles import parse_kind

        for name in value:
            parse_kind(name)
        return value


class EvaluationConfig(_Strict):
    """Where the global model is evaluated after every round.

    ``server``: on the Fed Server's test set (the built-in data sets' test split, or
    ``data.test_file``). ``federated``: every device that took part in the round evaluates the new
    global model on its held-out part (``holdout`` of its local data, drawn once, seeded) and
    reports correct predictions and summed loss; the round's accuracy and loss are the
    sample-weighted means. ``auto``: ``server`` when the server has a test set, else ``federated``.
    """

    mode: Literal["auto", "server", "federated"] = "auto"
    holdout: float = Field(0.2, gt=0, lt=1)


class TrackingConfig(_Strict):
    """Experiment tracking: the Fed Server also sends every round's figures to these backends
    (docs/tracking.md). ``backends`` name plug-ins registered in ``fed_server/tracking/registry.py``,
    checked (with their packages) when the Fed Server starts, so this schema imports none of them.
    No backend (the default): ``metrics.jsonl`` and Prometheus only."""

    backends: list[str] = Field(default_factory=list)
    # TensorBoard event files (default <run-dir>/tensorboard).
    tensorboard_dir: str | None = None
    # An MLflow tracking URI (default file:<run-dir>/mlruns; http://HOST:5000 for a server).
    mlflow_uri: str | None = None
    mlflow_experiment: str = Field("s2fl", min_length=1)
    # Each aggregated device's split point and timings too (device/<id>/...): a series per device,
    # as with the Fed Server's --per-device-metrics; off for populations of thousands.
    per_device: bool = True

    @field_validator("backends")
    @classmethod
    def _once_each(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"each tracking backend at most once, got {value}")
        return value


class RunConfig(_Strict):
    """Everything that defines a run."""

    algorithm: str = "s2fl"
    # A built-in model name (docs/models.md) or an import path ``package.module:function`` that
    # returns the model as ordered named blocks; ``model_params`` are passed to it as keywords.
    model: str = "cnn"
    model_params: dict[str, Any] = Field(default_factory=dict)
    data: DataSpec = Field(default_factory=DataSpec)
    # 20 rounds: what the default testbed run (S2FL, the emulated 5:3:2 mix) needs to meet the
    # accuracy and time goals on the embedded MNIST (benchmarks/README.md, "Goals" and "`make run`");
    # ``python -m testbed --paper-scale`` runs the paper's 100 devices, 10 per round, 30 rounds.
    rounds: int = Field(20, ge=1)
    devices_per_round: int | None = Field(None, ge=1)
    train: TrainConfig = Field(default_factory=TrainConfig)
    split: SplitConfig = Field(default_factory=SplitConfig)
    grouping: GroupingConfig = Field(default_factory=GroupingConfig)
    split_privacy: SplitPrivacyConfig = Field(default_factory=SplitPrivacyConfig)
    deadlines: DeadlineConfig = Field(default_factory=DeadlineConfig)
    updates: UpdateCheckConfig = Field(default_factory=UpdateCheckConfig)
    aggregation: AggregationConfig = Field(default_factory=AggregationConfig)
    privacy: PrivacyConfig = Field(default_factory=PrivacyConfig)
    secure_aggregation: SecureAggregationConfig = Field(default_factory=SecureAggregationConfig)
    devices: DeviceMixConfig = Field(default_factory=DeviceMixConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    half_precision: bool = False
    seed: int = 0
    # The algorithm's own hyperparameters, validated by its ``Params`` model (docs/algorithms/).
    algorithm_params: dict[str, Any] = Field(default_factory=dict)
    # Device selection policy (shared/algorithms/selection.py) and its parameters.
    selection: str = "random"
    selection_params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> "RunConfig":
        """Checks that need only the config itself. The ones that need the algorithm registry or
        the model zoo (names, algorithm_params, selection_params) are in
        ``shared.run_config.validate_run_config``, so this module imports no algorithm."""
        if self.devices_per_round is not None and self.devices_per_round > self.data.num_devices:
            raise ValueError("devices_per_round cannot exceed data.num_devices")
        return self

    @property
    def per_round(self) -> int:
        """Devices selected per round (all devices unless ``devices_per_round`` is set)."""
        return self.devices_per_round or self.data.num_devices


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON file (a run configuration, a service's settings, an experiment file)
    into a plain dict. ValueError says that the file is missing or unreadable, or where (file,
    line, column) its syntax is wrong, in one line a CLI can print."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ValueError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the file: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}, line {exc.lineno}, column {exc.colno}: not valid JSON: {exc.msg}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ValueError(f"{path}{where}: not valid YAML: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the top level of the file must be a mapping")
    return data


def set_dotted(target: dict[str, Any], dotted: str, value: Any) -> None:
    """``set_dotted(d, "train.lr", 0.1)`` sets ``d["train"]["lr"]``, creating levels as needed."""
    parts = dotted.split(".")
    for part in parts[:-1]:
        target = target.setdefault(part, {})
    target[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``"train.lr=0.1"`` -> ``("train.lr", 0.1)``; the value is parsed as YAML (numbers, bools, lists)."""
    if "=" not in text:
        raise ValueError(f"override {text!r} must look like key.path=value")
    key, raw = text.split("=", 1)
    try:
        return key.strip(), yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ValueError(f"override {text!r}: the value is not valid YAML: {getattr(exc, 'problem', None) or exc}") from None


def merge_config_sources(
    config_file: str | Path | None = None,
    overrides: list[str] | None = None,
    env_prefix: str = "SFL_RUN__",
) -> dict[str, Any]:
    """Defaults < config file < environment (``SFL_RUN__TRAIN__LR=0.1``) < ``key=value`` overrides,
    merged into the plain dict that ``shared.run_config.load_run_config`` validates."""
    data: dict[str, Any] = load_config_file(config_file) if config_file else {}
    for name, raw in sorted(os.environ.items()):
        if name.startswith(env_prefix) and len(name) > len(env_prefix):
            set_dotted(data, name[len(env_prefix):].lower().replace("__", "."), yaml.safe_load(raw))
    for item in overrides or []:
        key, value = parse_override(item)
        set_dotted(data, key, value)
    return data


def env_default(name: str, default: Any) -> Any:
    """A CLI default that an environment variable (``SFL_<NAME>``) can replace."""
    return os.environ.get(f"SFL_{name.upper()}", default)


def env_switch(name: str, default: bool | None = False) -> bool | None:
    """A yes/no CLI default that ``SFL_<NAME>`` can replace: ``0``, ``false``, ``no``, ``off`` and
    the empty string are no, anything else yes."""
    value = os.environ.get(f"SFL_{name.upper()}")
    return default if value is None else value.strip().lower() not in ("", "0", "false", "no", "off")
