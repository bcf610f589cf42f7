"""mindformers integration: registration, the CPU train cell, the native-metric bridge.

The only mfotel module that imports mindformers at module level. Importing it registers
nothing; `register()` registers, in mindformers' registry (idempotent, as mindformers' own
decorators do):

- `OTelMonitor` (callback type): `MindFormersOTelMonitor`, the core callback plus what only a
  mindformers run has (loss fixed for pipeline / micro-batch setups the way MFLossMonitor fixes
  it, the sequence length of the model, the native metrics below). A YAML says
  `callbacks: [{type: MFLossMonitor}, {type: OTelMonitor, step_interval: 10, ...}]`;
- `CPUTrainOneStepCell` (wrapper type): MFTrainOneStepCell with an overflow check that runs on CPU.

    from mfotel.integrations import mindformers
    mindformers.register()        # or, with no code: mfotel-instrument python train.py ...

The native-metric seam (pinned by tests/unit/test_mindformers_seam.py). At train begin the callback
finds its sibling callbacks in `cb_params.list_callback` and taps, on those instances only:

- `TrainingStateMonitor._output(tag, data, global_step, formats)`: every metric the native monitor
  writes to `log`/`tensorboard` passes here, already filtered by `monitor_config.target`/`invert`.
  Tags map to series by `NATIVE_TAGS`. A tag is bridged only when the native config asks for it
  (non-empty `formats`), so the native config stays the switch.
- `MFLossMonitor.print_output_info(cb_params, ..., throughput, ..., per_step_seconds, ...,
  time_remain, ..., main_loss, extra_loss, mtp_loss, indexer_loss)`: what MFLossMonitor computes
  and prints each `per_print_times` steps (arguments read by name).
- `MFLossMonitor._fix_loss_for_parallel(loss, print_warning)`: applied to the step loss.
- `MFLossMonitor.on_train_step_begin` / `on_train_step_end`: the step-time histogram measures the
  interval MFLossMonitor times (README, Time figures), marked after its begin hook returns and
  before its end hook runs.
- `EvalCallBack.eval_func`: timed, and its result's loss becomes `mindformers_train_eval_loss`.

Checkpoints need no seam of their own: `CheckpointMonitor` is a MindSpore `ModelCheckpoint`,
which the core callback watches (mfotel.checkpoints).

Plus, from the train cell's 7-tuple (`runner_wrapper.local_norm: True`), per-parameter gradient
norms named by the optimizer's parameter order, when the native monitor asks for local norms
and has no dump path (the CPU case: TensorDump is Ascend-only).
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import re
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

from mindformers.core.callback.callback import EvalCallBack, MFLossMonitor, TrainingStateMonitor
from mindformers.tools.register import MindFormerModuleType, MindFormerRegister
from mindformers.wrapper.wrapper import MFTrainOneStepCell, get_real_models
from mindspore.nn.wrap.loss_scale import _ascend_grad_overflow

from ..callback import OTelMonitor
from ..config import ConfigError
from ..config.source import safe_job_name
from ..extract import StepOutputs, cb_param, eval_loss, parse_net_outputs, to_float
from ..flops import TransformerShape, llama_ffn_hidden_size

log = logging.getLogger("mfotel")

#: Per-metric cap on native series (OTel folds series beyond 2000 per instrument into one).
MAX_NATIVE_SERIES = 1000


class CPUTrainOneStepCell(MFTrainOneStepCell):
    """MFTrainOneStepCell whose overflow check runs on CPU.

    The inherited check takes the Ascend saturation-mode path on any non-GPU target and fails on
    CPU (`NPUGetFloatStatusV2` has no CPU kernel). This one takes the IsFinite path (the one
    Ascend uses in INFNAN mode), which every backend has. Outputs are unchanged:
    `(loss, overflow, loss_scale, learning_rate, global_norm[, local_norm, norm_size])`.
    """

    def get_overflow_status(self, status, compute_output):
        return self._get_distributed_overflow_status_on_infnan_mode(
            _ascend_grad_overflow, compute_output)


# ---------------------------------------------------------------------------- tag mapping
class NativeSample(NamedTuple):
    name: str                 # series `mindformers_train_<name>`
    value: float
    labels: dict[str, str]


class _Tag(NamedTuple):
    pattern: re.Pattern[str]
    name: str
    labels: Callable[[re.Match[str]], dict[str, str]]
    filter: str | None = None  # "param" (target/invert) or "sr" (stable-rank target)


def _tag(pattern: str, name: str, labels: Callable[[re.Match[str]], dict[str, str]] | None = None,
         filter: str | None = None) -> _Tag:
    return _Tag(re.compile(pattern), name, labels or (lambda m: {}), filter)


def _param(m: re.Match[str]) -> dict[str, str]:
    labels = {"param": m["param"]}
    if m.groupdict().get("expert"):
        labels["expert"] = m["expert"]
    return labels


#: TrainingStateMonitor tag -> series (first full match wins). Tags not listed are not bridged
#: (per-head attention logits, which are unbounded).
NATIVE_TAGS: tuple[_Tag, ...] = (
    _tag(r"weight_norm", "weight_norm"),
    _tag(r"adam_(?P<state>[mv])_norm/(?P<param>.+)", "optimizer_state_norm",
         lambda m: {"param": m["param"], "state": f"adam_{m['state']}"}, "param"),
    _tag(r"local_norm/(?P<param>.+)", "local_norm", _param, "param"),
    _tag(r"device_local_norm", "device_local_norm"),
    _tag(r"device_accum_local_(?P<loss>.+)_loss", "device_local_loss",
         lambda m: {"loss": m["loss"]}),
    _tag(r"local_(?P<loss>.+)_loss", "local_loss", lambda m: {"loss": m["loss"]}),
    _tag(r"throughput_linearity", "throughput_linearity"),
    _tag(r"weight_stable_rank/(?P<param>.+?)(?:/expert_(?P<expert>\d+|max|min|mean))?",
         "weight_stable_rank", _param, "sr"),
    _tag(r"weight_eigenvalue/(?P<param>.+?)(?:/expert_(?P<expert>\d+|max|min|mean))?",
         "weight_max_eigenvalue", _param, "sr"),
    _tag(r"max_attention_logit/(?P<stat>mean|max)", "max_attention_logit",
         lambda m: {"stat": m["stat"]}),
)

_MICRO_LOCAL_LOSS = re.compile(r"micro_local_(?P<loss>.+)_loss")


def map_native_tag(tag: str, data: Any,
                   keep_param: Callable[[str, str], bool] = lambda param, kind: True
                   ) -> NativeSample | None:
    """The series for one TrainingStateMonitor `(tag, data)`, or None (not bridged / filtered).

    `keep_param(param, kind)` applies the native parameter filters (`kind` is "param" for
    `target`/`invert`, "sr" for `stable_rank_config.target`).
    """
    for entry in NATIVE_TAGS:
        match = entry.pattern.fullmatch(tag)
        if match is None:
            continue
        labels = entry.labels(match)
        if entry.filter and not keep_param(labels["param"], entry.filter):
            return None
        value = _number(data)
        return None if value is None else NativeSample(entry.name, value, labels)
    return None


def _number(data: Any) -> float | None:
    if isinstance(data, dict):
        return None
    if isinstance(data, (list, tuple)):
        data = [v for v in data if isinstance(v, (int, float))]
        return float(max(data)) if data else None
    try:
        return to_float(data)
    except (TypeError, ValueError):
        return None


#: MFLossMonitor.print_output_info argument -> (series, scale); per_step_seconds holds ms.
LOSS_MONITOR_ARGS: dict[str, tuple[str, float]] = {
    "throughput": ("device_throughput_samples_per_second", 1.0),
    "per_step_seconds": ("iteration_time_seconds", 1e-3),
    "time_remain": ("time_remaining_seconds", 1.0),
}
#: Separate losses (print_separate_loss) -> `separate_loss{loss=...}`.
SEPARATE_LOSSES: dict[str, str] = {"main_loss": "lm", "extra_loss": "load_balancing",
                                   "mtp_loss": "mtp", "indexer_loss": "indexer"}


def map_loss_monitor_args(args: dict[str, Any], model_flops: float | None = None,
                          flops_per_device_divisor: int = 1) -> list[NativeSample]:
    """Series from MFLossMonitor.print_output_info's arguments (by name)."""
    samples = []
    for arg, (name, scale) in LOSS_MONITOR_ARGS.items():
        value = _number(args.get(arg))
        if value is not None:
            samples.append(NativeSample(name, value * scale, {}))
    for arg, loss in SEPARATE_LOSSES.items():
        value = _number(args.get(arg))
        if value is not None and (arg == "main_loss" or value > 0):
            samples.append(NativeSample("separate_loss", value, {"loss": loss}))
    step_ms = _number(args.get("per_step_seconds"))
    if model_flops and step_ms:
        samples.append(NativeSample("device_model_flops_per_second",
                                    model_flops / (step_ms / 1e3) / flops_per_device_divisor, {}))
    return samples


# ---------------------------------------------------------------------------- the bridge
class NativeBridge:
    """Taps sibling TrainingStateMonitor / MFLossMonitor instances for one run.

        bridge = NativeBridge(instruments.set_native)
        bridge.attach(cb_params.list_callback)
        ...
        bridge.detach()
    """

    def __init__(self, set_native: Callable[[str, float, dict[str, str]], None],
                 max_series: int = MAX_NATIVE_SERIES) -> None:
        self._set = set_native
        self._max_series = max_series
        self._series: dict[str, set[frozenset]] = {}
        self._warned: set[str] = set()
        self._micro: dict[str, list[float]] = {}
        self._micro_step: int | None = None
        self._tapped: list[tuple[Any, str]] = []
        self.state_monitor: TrainingStateMonitor | None = None
        self.loss_monitor: MFLossMonitor | None = None

    # -- attach / detach
    def attach(self, callbacks: Iterable[Any]) -> None:
        for callback in callbacks or ():
            if isinstance(callback, TrainingStateMonitor) and self.state_monitor is None:
                self.state_monitor = callback
                self._tap(callback, "_output", self._on_output)
            elif isinstance(callback, MFLossMonitor) and self.loss_monitor is None:
                self.loss_monitor = callback
                self._tap(callback, "print_output_info", self._on_print_output_info)

    def _tap(self, instance: Any, method: str, hook: Callable[..., None]) -> None:
        original = getattr(instance, method)
        signature = inspect.signature(original)

        def tapped(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            try:
                hook(signature.bind(*args, **kwargs).arguments)
            except Exception as exc:  # noqa: BLE001 - never raise into training
                self._warn_once(f"tap:{method}", f"mfotel: native metrics from {method} "
                                f"skipped ({type(exc).__name__}: {exc})")
            return result

        setattr(instance, method, tapped)
        self._tapped.append((instance, method))

    def detach(self) -> None:
        for instance, method in self._tapped:
            instance.__dict__.pop(method, None)
        self._tapped.clear()

    # -- hooks
    def _on_output(self, args: dict[str, Any]) -> None:
        tag, data, step, formats = args["tag"], args["data"], args["global_step"], args["formats"]
        if not formats:
            return
        micro = _MICRO_LOCAL_LOSS.fullmatch(tag)
        if micro:  # one value per micro batch: expose the step's mean, like tensorboard does
            if step != self._micro_step:
                self._micro, self._micro_step = {}, step
            values = self._micro.setdefault(micro["loss"], [])
            value = _number(data)
            if value is not None:
                values.append(value)
                self.set("local_loss", sum(values) / len(values), {"loss": micro["loss"]})
            return
        sample = map_native_tag(tag, data, self._keep_param)
        if sample is not None:
            self.set(*sample)

    def _on_print_output_info(self, args: dict[str, Any]) -> None:
        monitor, flops, divisor = self.loss_monitor, None, 1
        if monitor is not None and getattr(monitor, "mf_calculated", False):
            flops = float(getattr(monitor, "full_model_flops", 0.0)) or None
            if not _is_legacy():
                divisor = int(getattr(monitor, "device_num", 1) or 1)
        for sample in map_loss_monitor_args(args, flops, divisor):
            self.set(*sample)

    def _keep_param(self, param: str, kind: str) -> bool:
        monitor = self.state_monitor
        if monitor is None:
            return True
        if kind == "sr":
            # stand-alone runs skip the stable-rank target natively; apply it here
            return bool(getattr(monitor, "sr_format", None)) and monitor._check_sr_target(param)
        return monitor._check_param_name(param)

    # -- per step (from the callback, after the native monitors ran)
    def on_step(self, step: int, net_outputs: Any, param_names: list[str] | None) -> None:
        self._global_norm_check()
        self._local_norms(step, net_outputs, param_names)

    def _global_norm_check(self) -> None:
        monitor = self.state_monitor
        if monitor is None:
            return
        if getattr(monitor, "check_for_global_norm", False) or \
                getattr(monitor, "use_skip_data_by_global_norm", False):
            threshold = _number(getattr(monitor, "global_norm_spike_threshold", None))
            if threshold is not None:
                self.set("global_norm_spike_threshold", threshold, {})
            self.set("global_norm_spike_consecutive",
                     float(getattr(monitor, "global_norm_spike_count", 0)), {})

    def _local_norms(self, step: int, net_outputs: Any, param_names: list[str] | None) -> None:
        monitor = self.state_monitor
        if (monitor is None or not getattr(monitor, "local_norm_format", None)
                or getattr(monitor, "dump_path", None) or not param_names
                or not isinstance(net_outputs, (tuple, list)) or len(net_outputs) != 7
                or step % max(int(getattr(monitor, "step_interval", 1)), 1)):
            return
        squares = net_outputs[5]
        squares = squares.asnumpy() if hasattr(squares, "asnumpy") else squares
        squares = [float(v) for v in squares.reshape(-1)]
        if len(squares) != len(param_names):
            self._warn_once("local_norm", f"mfotel: {len(squares)} local norms for "
                            f"{len(param_names)} optimizer parameters; local_norm not exported")
            return
        for name, square in zip(param_names, squares, strict=True):
            if monitor._check_param_name(name):
                self.set("local_norm", math.sqrt(square) if square >= 0 else math.nan,
                         {"param": name})

    # -- output
    def set(self, name: str, value: float, labels: dict[str, str]) -> None:
        series = self._series.setdefault(name, set())
        key = frozenset(labels.items())
        if key not in series:
            if len(series) >= self._max_series:
                self._warn_once(f"cap:{name}", f"mfotel: more than {self._max_series} "
                                f"mindformers_train_{name} series; narrow monitor_config.target")
                return
            series.add(key)
        self._set(name, value, labels)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)


def _is_legacy() -> bool:
    from mindformers.core.context.build_context import is_legacy_model
    return is_legacy_model()


# ---------------------------------------------------------------------------- the callback
def _real_model(network: Any) -> Any:
    """The model inside mindformers' wrappers, or `network` itself."""
    try:
        return get_real_models(network)
    except Exception:  # noqa: BLE001 - not a mindformers network: read it as it is
        return network


def _first(getters: Iterable[Callable[[], Any]], usable: Callable[[Any], bool]) -> Any:
    """The first usable value a getter returns (models of different versions and kinds
    expose their settings differently), else None."""
    for get in getters:
        try:
            value = get()
        except Exception:  # noqa: BLE001 - this model does not have it: try the next way
            continue
        if usable(value):
            return value
    return None


def _seq_length(network: Any) -> int | None:
    """The model's sequence length (tokens a sample trains on), if the network tells."""
    model = _real_model(network)
    found: int | None = _first((lambda: model.config.seq_length,
                                lambda: model.get_gpt_transformer_config().seq_length),
                               lambda value: isinstance(value, int) and value > 0)
    return found


def _model_config(network: Any) -> Any:
    """The model's config (legacy `model.config`, or mcore's transformer config), if any."""
    model = _real_model(network)
    return _first((lambda: model.get_gpt_transformer_config(), lambda: model.config),
                  lambda config: config is not None)


def transformer_shape(config: Any) -> TransformerShape | None:
    """The FLOPs-relevant shape of a dense Llama-style decoder (legacy LlamaConfig names or
    mcore TransformerConfig names), or None when the config does not describe one (MoE models
    activate a part of their experts per token: set flops_per_token for them)."""
    def first(*names: str) -> Any:
        for name in names:
            value = getattr(config, name, None)
            if value is not None:
                return value
        return None
    moe = getattr(config, "moe_config", None)
    if (first("num_moe_experts") or 0) > 1 or (getattr(moe, "expert_num", 1) or 1) > 1:
        return None
    hidden, layers = first("hidden_size"), first("num_layers")
    heads = first("num_heads", "num_attention_heads")
    vocab, seq = first("vocab_size", "padded_vocab_size"), first("seq_length")
    if not all(isinstance(v, int) and v > 0 for v in (hidden, layers, heads, vocab, seq)):
        return None
    kv_heads = first("n_kv_heads", "num_query_groups") or heads
    ffn = first("intermediate_size", "ffn_hidden_size")
    if ffn is None:
        ffn = llama_ffn_hidden_size(hidden, first("multiple_of") or 256,
                                    first("ffn_dim_multiplier"))
    gated = getattr(config, "gated_linear_unit", True)
    return TransformerShape(hidden, layers, heads, int(kv_heads), int(ffn), vocab, seq,
                            bool(gated))


def config_stem(argv: list[str]) -> str | None:
    """The stem of the `--config x.yaml` a mindformers launcher got (the default job name)."""
    for i, arg in enumerate(argv):
        path = argv[i + 1] if arg == "--config" and i + 1 < len(argv) else (
            arg.split("=", 1)[1] if arg.startswith("--config=") else None)
        if path and path.endswith((".yaml", ".yml")):
            return Path(path).stem
    return None


class MindFormersOTelMonitor(OTelMonitor):
    """OTelMonitor for mindformers runs; registered as callback type `OTelMonitor`.

    mindformers injects no arguments into custom callbacks. The job name defaults to the stem of
    the launcher's `--config` YAML (docs/mindformers.md); the rest is read at train begin: the
    sequence length from the model (unless `seq_length` is given), the loss fix and the native
    metrics from the sibling MFLossMonitor / TrainingStateMonitor.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        try:
            super().__init__(*args, **kwargs)
        except ConfigError as exc:
            # mindformers' registry re-raises `type(e)(message)`, which ConfigError's
            # constructor cannot take: the user would see a TypeError instead of the fix
            raise ValueError(str(exc)) from None
        self.bridge: NativeBridge | None = None
        self._param_names: list[str] | None = None
        #: (instance, attribute, original) replaced to time steps and evaluations
        self._timed: list[tuple[Any, str, Any]] = []

    def default_job_name(self) -> str:
        """The stem of the launcher's `--config` YAML (a default: OTEL_SERVICE_NAME wins)."""
        return safe_job_name(config_stem(sys.argv) or "") or super().default_job_name()

    def on_train_begin(self, run_context: Any) -> None:
        if not self.config.enable:
            return
        cb = run_context.original_args()
        # a resumed mindformers run skips data itself and restarts cur_step_num at 1;
        # MFLossMonitor adds initial_step to it, and so do we
        initial = cb_param(cb, "initial_step")
        if initial is None:
            initial = next((getattr(c, "initial_step", None) for c in
                            cb_param(cb, "list_callback", None) or ()
                            if isinstance(c, MFLossMonitor)), None)
        if initial:
            self.resume_step = int(initial)
        if self.config.seq_length is None:
            seq_length = _seq_length(cb_param(cb, "network", None))
            if seq_length:
                self.config = dataclasses.replace(self.config, seq_length=seq_length)
        callbacks = cb_param(cb, "list_callback", None) or ()
        self._read_parallel_layout(cb, callbacks)
        super().on_train_begin(run_context)
        if self.instruments is None:
            return
        self.bridge = NativeBridge(self.instruments.set_native)
        self.bridge.attach(callbacks)
        if self.bridge.loss_monitor is not None:
            self._time_steps_like(self.bridge.loss_monitor)
        for callback in callbacks:
            if isinstance(callback, EvalCallBack):
                self._time_evaluations(callback)
        optimizer = cb_param(cb, "optimizer", None) or \
            getattr(cb_param(cb, "train_network", None), "optimizer", None)
        if optimizer is not None:
            self._param_names = [p.name for p in optimizer.parameters]

    def _read_parallel_layout(self, cb: Any, callbacks: Iterable[Any]) -> None:
        """Samples per device and step (MFLossMonitor's global batch over the device count,
        as its samples/s/p) and the model FLOPs per token (from the model config)."""
        loss_monitor = next((c for c in callbacks if isinstance(c, MFLossMonitor)), None)
        global_batch = getattr(loss_monitor, "global_batch_size", 0) or 0
        devices = getattr(loss_monitor, "device_num", 0) or 0
        if global_batch > 0 and devices > 0 and self.config.batch_size is None:
            self.device_samples_per_step = global_batch / devices
        if self.flops_per_token is None:
            shape = transformer_shape(_model_config(cb_param(cb, "network", None)))
            if shape is not None:
                if self.config.seq_length and shape.seq_length != self.config.seq_length:
                    shape = dataclasses.replace(shape, seq_length=self.config.seq_length)
                self.flops_per_token = shape.flops_per_token

    def _time_steps_like(self, monitor: MFLossMonitor) -> None:
        """Measure each step over MFLossMonitor's interval: from its step-begin hook (after it
        ran) to its step-end hook (before it runs), so the histogram and its per_step_time
        time the same thing; other callbacks' work falls outside both."""
        begin, end = monitor.on_train_step_begin, monitor.on_train_step_end

        def timed_begin(run_context: Any) -> Any:
            result = begin(run_context)
            self.mark_step_begin()
            return result

        def timed_end(run_context: Any) -> Any:
            self.mark_step_end()
            return end(run_context)

        self._replace(monitor, "on_train_step_begin", timed_begin)
        self._replace(monitor, "on_train_step_end", timed_end)

    def _time_evaluations(self, callback: EvalCallBack) -> None:
        """Time EvalCallBack's evaluations and read their loss (e.g. PerplexityMetric's)."""
        evaluate = callback.eval_func

        def timed_eval(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            output = evaluate(*args, **kwargs)
            try:
                self.record_eval(eval_loss(output), time.perf_counter() - started)
            except Exception as exc:  # noqa: BLE001 - never raise into training
                self.count_error("callback", exc)
            return output

        self._replace(callback, "eval_func", timed_eval)

    def _replace(self, instance: Any, name: str, replacement: Any) -> None:
        self._timed.append((instance, name, instance.__dict__.get(name)))
        setattr(instance, name, replacement)

    def on_train_step_begin(self, run_context: Any) -> None:
        if not self._timed or self.bridge is None or self.bridge.loss_monitor is None:
            super().on_train_step_begin(run_context)  # else MFLossMonitor's hook marked it

    def parse_outputs(self, cb: Any) -> StepOutputs:
        """The step's outputs, with the loss fixed the way MFLossMonitor fixes it."""
        out = parse_net_outputs(cb.net_outputs)
        monitor = self.bridge.loss_monitor if self.bridge else None
        if monitor is not None and out.loss is not None:
            out = out._replace(loss=float(
                monitor._fix_loss_for_parallel(out.loss, print_warning=False)))
        return out

    def on_train_step_end(self, run_context: Any) -> None:
        super().on_train_step_end(run_context)
        if self.bridge is None:
            return
        try:
            cb = run_context.original_args()
            self.bridge.on_step(int(cb.cur_step_num), cb.net_outputs, self._param_names)
        except Exception as exc:  # noqa: BLE001 - never raise into training
            self.count_error("callback", exc)

    def close(self) -> None:
        if self.bridge is not None:
            self.bridge.detach()
        for instance, name, original in reversed(self._timed):
            if original is None:
                instance.__dict__.pop(name, None)   # the class's method again
            else:
                setattr(instance, name, original)
        self._timed.clear()
        super().close()


def register() -> None:
    """Register mfotel's classes in mindformers' registry (idempotent)."""
    MindFormerRegister.register_cls(CPUTrainOneStepCell, MindFormerModuleType.WRAPPER)
    MindFormerRegister.register_cls(MindFormersOTelMonitor, MindFormerModuleType.CALLBACK,
                                    alias="OTelMonitor")
