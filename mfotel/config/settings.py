"""The validated settings of `monitor_config`: frozen dataclasses, defaults as documented."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

SECTION = "monitor_config"
DEFAULT_JOB_NAME = "mindformers"
FILE_SD_MODES: tuple[str, ...] = ("job", "rank")
CARDINALITY_LEVELS: tuple[str, ...] = ("full", "health")
ACTIONS: tuple[str, ...] = ("stop", "scale_lr", "warn")
#: mindformers 1.9 `MonitorConfig` keys (tools/register/template.py): mindformers owns a
#: `monitor_config` holding these, and raises KeyError on any other key.
NATIVE_MONITOR_KEYS: tuple[str, ...] = (
    "monitor_on", "dump_path", "target", "invert", "step_interval", "local_loss_format",
    "local_norm_format", "device_local_norm_format", "device_local_loss_format",
    "optimizer_state_format", "weight_state_format", "max_attention_logit_format",
    "throughput_baseline", "print_struct", "check_for_global_norm", "global_norm_spike_threshold",
    "global_norm_spike_count_threshold", "stable_rank_config", "health_checkpoint")


def fill(template: str, rank: int, job_name: str) -> Path:
    """`template` with `{rank}` / `{job_name}` filled in, as an absolute path.

    Templates are validated at load time: only these two placeholders, no format specs.
    """
    return Path(template.format(rank=rank, job_name=job_name)).expanduser().absolute()


@dataclass(frozen=True)
class OutputConfig:
    console: bool = True
    file: bool = False
    file_path: str = "./monitor_logs/train_monitor.log"
    format: str = "text"  # text | json

    def resolved_file_path(self, rank: int, job_name: str) -> Path:
        """Absolute path with `{rank}` / `{job_name}` filled in."""
        return fill(self.file_path, rank, job_name)


@dataclass(frozen=True)
class PrometheusConfig:
    host: str = "0.0.0.0"  # every rank must be reachable by a cluster Prometheus
    port: int = 9464       # this rank serves port + local rank; 0 turns the endpoint off
    # mfotel-instrument's node endpoint (the ranks' processes as the node sees them);
    # None: port - 1 (9463), 0: off (mfotel.node.agent)
    node_port: int | None = None
    # after training ends, keep /metrics up until the final values (status 2/3) have been
    # scraped once, at most this long: else a finished rank looks like a dead one
    linger_seconds: float = 30.0
    linger_until_scraped: bool = True  # False: always wait the full linger (HA Prometheus pairs)
    certfile: str | None = None
    keyfile: str | None = None
    web_config_file: str | None = None  # Prometheus web-config format: TLS + basic auth
    # limits of the endpoint (README, Security): no client can hold the trainer's threads/fds
    max_connections: int = 100             # open connections; the oldest idle one makes room
    request_timeout_seconds: float = 10.0  # TLS handshake + request head, and the response
    auth_failures_per_second: float = 1.0  # failed basic-auth attempts per client (then 429)
    # the live page (mfotel.ui) on the same port, behind the same TLS and basic auth
    ui: bool = True
    ui_history_points: int = 10_000   # 48 bytes each; beyond, the run is thinned evenly
    ui_overview_rank: int | None = 0  # the rank whose page shows every rank; None: none


@dataclass(frozen=True)
class OtlpConfig:
    # the URL pushed to (`/v1/metrics` added to a base URL); None = no push
    endpoint: str | None = None
    interval_seconds: float = 10.0
    timeout_seconds: float = 5.0
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class FileSdConfig:
    """`file_sd`: a Prometheus file_sd target file for the job's ranks
    (mfotel.cluster.discovery)."""
    path: str | None = None          # {job_name}, {rank} allowed; None = write no file
    mode: str = "job"                # job: rank 0 lists every rank | rank: each rank lists itself
    hosts: tuple[str, ...] = ()      # node addresses in node-rank order (default: this host)
    labels: Mapping[str, str] = field(default_factory=dict)  # extra target labels

    def resolved_path(self, rank: int, job_name: str) -> Path | None:
        return fill(self.path, rank, job_name) if self.path else None


@dataclass(frozen=True)
class RunConfig:
    """`run`: identity of the training run across restarts and resumes."""
    id: str | None = None            # default: $MFOTEL_RUN_ID, else the state file's, else new
    state_file: str | None = None    # keeps id and attempt across restarts; {job_name}, {rank}


@dataclass(frozen=True)
class NonfiniteRule:
    """`actions.nonfinite`: what to do when the loss first goes NaN/Inf."""
    action: str = "stop"   # stop | scale_lr | warn
    factor: float = 0.5    # learning-rate multiplier, for action: scale_lr


@dataclass(frozen=True)
class PlateauRule(NonfiniteRule):
    """`actions.plateau`: no loss improvement of `min_delta` over `patience` records."""
    patience: int = 10
    min_delta: float = 0.0


@dataclass(frozen=True)
class ActionsConfig:
    """`actions` (mfotel.actions.engine): local rules and the control directory."""
    plateau: PlateauRule | None = None
    nonfinite: NonfiniteRule | None = None
    control_dir: str | None = None  # the job's control directory; {job_name} is filled in
    lead_steps: int = 3             # multi-rank: steps between a decision and its application

    @property
    def enabled(self) -> bool:
        return bool(self.plateau or self.nonfinite or self.control_dir)

    @property
    def may_scale_lr(self) -> bool:
        """Whether a scale_lr can be requested (a rule uses it, or the control file may)."""
        rules = (self.plateau, self.nonfinite)
        return bool(self.control_dir) or any(r and r.action == "scale_lr" for r in rules)

    def resolved_control_dir(self, job_name: str) -> Path | None:
        return fill(self.control_dir, 0, job_name) if self.control_dir else None


@dataclass(frozen=True)
class MonitorConfig:
    enable: bool = True
    step_interval: int = 1
    metrics: tuple[str, ...] = ("loss", "learning_rate")
    output: OutputConfig = field(default_factory=OutputConfig)
    log_rank: tuple[int, ...] | None = (0,)  # None = every rank
    job_name: str | None = None
    prometheus: PrometheusConfig = field(default_factory=PrometheusConfig)
    on_nonfinite: str = "warn"  # warn | stop
    resource_attributes: Mapping[str, str] = field(default_factory=dict)
    otlp: OtlpConfig = field(default_factory=OtlpConfig)
    early_steps: int = 0           # use early_step_interval for the first N steps
    alertmanager_url: str | None = None  # fast path: post a NaN loss alert straight there
    early_step_interval: int = 1
    batch_size: int | None = None  # samples per step on this rank, when the run can't tell
    seq_length: int | None = None  # tokens per sample, enables mindformers_train_tokens_total
    flops_per_token: float | None = None  # model FLOPs per training token (mindformers: estimated)
    peak_flops: float | None = None  # peak FLOP/s of one device: enables the MFU gauge
    native_series_limit: int = 2000  # series per native metric (OTel's default cardinality cap)
    actions: ActionsConfig = field(default_factory=ActionsConfig)  # mfotel.actions.engine
    file_sd: FileSdConfig = field(default_factory=FileSdConfig)    # mfotel.cluster.discovery
    cardinality: str = "full"      # full | health (seed metrics only from metric_ranks)
    metric_ranks: tuple[int, ...] | None = None  # at cardinality health; None = log_rank's
    run: RunConfig = field(default_factory=RunConfig)
    source: str = "<kwargs>"       # where this config came from, for messages
    prefix: str = field(default=SECTION, compare=False)  # its key path: callbacks[3], ...
    #: key paths written in the document ("job_name", "otlp.endpoint", ...): an explicit key
    #: wins over its OTEL_* environment variable, a default does not
    given: frozenset[str] = field(default=frozenset(), compare=False)

    def logs_on(self, rank: int) -> bool:
        """Whether console/file lines are written on `rank` (log_rank gating)."""
        return self.log_rank is None or rank in self.log_rank

    def exports_seed_metrics(self, rank: int) -> bool:
        """Whether `rank` exposes loss, lr, grad norm and the throughput gauge (cardinality)."""
        if self.cardinality == "full":
            return True
        ranks = self.metric_ranks if self.metric_ranks is not None else self.log_rank
        return ranks is None or rank in ranks

    def is_record_step(self, step: int) -> bool:
        """Whether seed metrics are recorded at global `step` (1-based)."""
        if step <= self.early_steps:
            return step % self.early_step_interval == 0
        return step % self.step_interval == 0

    def with_job_name(self, job_name: str) -> MonitorConfig:
        """The config with a default job name (an explicit `job_name` key stays explicit)."""
        return replace(self, job_name=job_name)
