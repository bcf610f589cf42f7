"""The seam between mfotel and mindformers: what mfotel.integrations.mindformers relies on
still exists.

These tests fail loudly when a mindformers (or MindSpore) version renames or reshapes something
the bridge taps (docs/mindformers.md, "The seam"). They import mindformers (~5 s) but train nothing.
"""
from __future__ import annotations

import inspect
import math
import os
from types import SimpleNamespace

import pytest


@pytest.fixture(scope="module")
def mf(tmp_path_factory):
    """mindformers + mfotel.integrations.mindformers (registered), logging to a temporary
    directory, not ./output."""
    saved = os.environ.get("LOG_MF_PATH")
    os.environ["LOG_MF_PATH"] = str(tmp_path_factory.mktemp("mindformers-log"))
    import mindformers  # noqa: F401 - a test dependency: fail, never skip
    from mindformers.core.callback import callback as mf_callback
    from mindformers.core.callback.build_callback import build_callback
    from mindformers.tools.register import MindFormerModuleType, MindFormerRegister
    from mindformers.wrapper.wrapper import MFTrainOneStepCell

    import mfotel.integrations.mindformers as bridge
    bridge.register()
    yield SimpleNamespace(cb=mf_callback, build_callback=build_callback,
                          Register=MindFormerRegister, Type=MindFormerModuleType,
                          MFTrainOneStepCell=MFTrainOneStepCell, bridge=bridge)
    if saved is None:
        os.environ.pop("LOG_MF_PATH", None)
    else:
        os.environ["LOG_MF_PATH"] = saved


def params(function) -> list[str]:
    return list(inspect.signature(function).parameters)


# ---------------------------------------------------------------------------- signatures
def test_state_monitor_output_is_the_one_funnel_with_its_signature(mf):
    assert params(mf.cb.TrainingStateMonitor._output) == ["self", "tag", "data", "global_step",
                                                          "formats"]


def test_state_monitor_param_filters_exist(mf):
    assert params(mf.cb.TrainingStateMonitor._check_param_name) == ["self", "param_name"]
    assert params(mf.cb.TrainingStateMonitor._check_sr_target) == ["self", "param_name"]


def test_state_monitor_still_emits_the_tags_mfotel_maps(mf):
    source = inspect.getsource(mf.cb.TrainingStateMonitor)
    for fragment in ("'weight_norm'", "f'adam_m_norm/", "f'adam_v_norm/", "f'local_norm/",
                     "'device_local_norm'", "f'device_accum_local_", "f'micro_local_",
                     "f'local_{loss_tag}_loss'", "'throughput_linearity'",
                     "f'weight_stable_rank/", "f'weight_eigenvalue/",
                     "'max_attention_logit/mean'", "'max_attention_logit/max'"):
        assert fragment in source, f"TrainingStateMonitor no longer emits {fragment}"


def test_loss_monitor_print_output_info_arguments(mf):
    assert params(mf.cb.MFLossMonitor.print_output_info) == [
        "self", "cb_params", "cur_epoch_num", "origin_epochs", "throughput", "cur_step_num",
        "steps_per_epoch", "loss", "per_step_seconds", "overflow", "scaling_sens",
        "time_remain", "percent", "global_norm", "main_loss", "extra_loss", "mtp_loss",
        "indexer_loss"]
    # per_step_seconds holds milliseconds (mfotel scales it by 1e-3)
    assert "step_seconds = (time.time() - self.step_time) * 1000" in inspect.getsource(
        mf.cb.MFLossMonitor.on_train_step_end)


def test_loss_monitor_loss_fix_signature(mf):
    assert params(mf.cb.MFLossMonitor._fix_loss_for_parallel) == ["self", "loss", "print_warning"]


def test_mindspore_still_passes_the_callback_list_in_cb_params(mf):
    from mindspore.train.model import Model
    assert "cb_params.list_callback = " in inspect.getsource(Model._train)


def test_cpu_cell_overrides_the_overflow_check_through_the_infnan_path(mf):
    from mindspore.nn.wrap import loss_scale
    assert params(mf.MFTrainOneStepCell.get_overflow_status) == ["self", "status", "compute_output"]
    assert params(mf.MFTrainOneStepCell._get_distributed_overflow_status_on_infnan_mode) == [
        "self", "grad_overflow_check_func", "compute_output"]
    assert isinstance(loss_scale._ascend_grad_overflow, type(loss_scale._grad_overflow))
    assert mf.bridge.CPUTrainOneStepCell.get_overflow_status is not \
        mf.MFTrainOneStepCell.get_overflow_status


def test_seven_tuple_local_norms_are_squared_sums_in_optimizer_order(mf):
    from mindformers.wrapper import wrapper
    source = inspect.getsource(wrapper)
    assert "F.square(" in inspect.getsource(wrapper._get_square_sum)
    assert "return loss, overflow, scaling_sens, learning_rate, global_norm, local_norm, size" \
        in source


# ---------------------------------------------------------------------------- registration
def test_otel_monitor_and_cpu_cell_are_registered(mf):
    assert mf.Register.get_cls(mf.Type.CALLBACK, "OTelMonitor") is mf.bridge.MindFormersOTelMonitor
    assert mf.Register.get_cls(mf.Type.WRAPPER, "CPUTrainOneStepCell") is \
        mf.bridge.CPUTrainOneStepCell


def test_yaml_callback_entry_becomes_constructor_kwargs(mf):
    entry = {"type": "OTelMonitor", "step_interval": 10, "log_rank": 0,
             "metrics": ["loss", "learning_rate", "grad_norm", "throughput", "step_time"],
             "output": {"console": True, "file": False}, "prometheus": {"port": 0}}
    monitor, = mf.build_callback([entry])
    assert isinstance(monitor, mf.bridge.MindFormersOTelMonitor)
    assert monitor.config.step_interval == 10
    assert monitor.config.metrics == ("loss", "learning_rate", "grad_norm", "throughput",
                                      "step_time")


def test_yaml_callback_entry_with_a_bad_key_fails_at_build(mf):
    with pytest.raises(Exception, match="step_intervall"):
        mf.build_callback([{"type": "OTelMonitor", "step_intervall": 10}])


# ---------------------------------------------------------------------------- the bridge
class Recorder:
    def __init__(self) -> None:
        self.values: dict[tuple[str, frozenset], float] = {}

    def __call__(self, name: str, value: float, labels: dict[str, str]) -> None:
        self.values[(name, frozenset(labels.items()))] = value

    def get(self, name: str, **labels: str) -> float | None:
        return self.values.get((name, frozenset(labels.items())))


def state_monitor(mf, **config):
    return mf.cb.TrainingStateMonitor(origin_epochs=1, config=config, step_interval=1,
                                      dataset_size=20)


def test_bridge_mirrors_what_the_state_monitor_writes(mf):
    monitor = state_monitor(mf, target=["layers.0"], optimizer_state_format="log",
                            weight_state_format="log", device_local_loss_format="log")
    record = Recorder()
    bridge = mf.bridge.NativeBridge(record)
    bridge.attach([monitor])
    monitor._output("weight_norm", 19.6, 3, monitor.weight_state_format)
    monitor._output("adam_m_norm/model.layers.0.attention.wq.weight", 0.5, 3,
                    monitor.optimizer_state_format)
    monitor._output("adam_v_norm/model.layers.0.attention.wq.weight", 2e-8, 3,
                    monitor.optimizer_state_format)
    monitor._output("device_accum_local_lm_loss", 4.5, 3, monitor.device_local_loss_format)
    monitor._output("throughput_linearity", 0.8, 3, ["log", "tensorboard"])
    assert record.get("weight_norm") == 19.6
    param = "model.layers.0.attention.wq.weight"
    assert record.get("optimizer_state_norm", param=param, state="adam_m") == 0.5
    assert record.get("optimizer_state_norm", param=param, state="adam_v") == 2e-8
    assert record.get("device_local_loss", loss="lm") == 4.5
    assert record.get("throughput_linearity") == 0.8


def test_bridge_honours_target_and_invert(mf):
    record = Recorder()
    kept = state_monitor(mf, target=["layers.0"], optimizer_state_format="log")
    inverted = state_monitor(mf, target=["layers.0"], invert=True, optimizer_state_format="log")
    for monitor in (kept, inverted):
        bridge = mf.bridge.NativeBridge(record)
        bridge.attach([monitor])
        for layer in (0, 1):
            monitor._output(f"adam_m_norm/model.layers.{layer}.w", float(layer + 1) + (
                10 if monitor is inverted else 0), 1, monitor.optimizer_state_format)
        bridge.detach()
    assert record.get("optimizer_state_norm", param="model.layers.0.w", state="adam_m") == 1.0
    assert record.get("optimizer_state_norm", param="model.layers.1.w", state="adam_m") == 12.0


def test_bridge_skips_what_the_native_config_does_not_ask_for(mf):
    monitor = state_monitor(mf)  # no formats set
    record = Recorder()
    mf.bridge.NativeBridge(record).attach([monitor])
    monitor._output("weight_norm", 1.0, 1, monitor.weight_state_format)
    assert record.values == {}


def test_bridge_applies_the_stable_rank_target_the_native_monitor_skips(mf):
    monitor = state_monitor(mf, stable_rank_config={"format": ["log"], "target": ["wq"]})
    record = Recorder()
    mf.bridge.NativeBridge(record).attach([monitor])
    monitor._output("weight_stable_rank/layers.0.wq.weight", 16.0, 10, monitor.sr_format)
    monitor._output("weight_stable_rank/layers.0.wk.weight", 17.0, 10, monitor.sr_format)
    monitor._output("weight_eigenvalue/layers.0.wq.weight/expert_max", 0.1, 10, monitor.sr_format)
    assert record.get("weight_stable_rank", param="layers.0.wq.weight") == 16.0
    assert record.get("weight_stable_rank", param="layers.0.wk.weight") is None
    assert record.get("weight_max_eigenvalue", param="layers.0.wq.weight", expert="max") == 0.1


def test_bridge_reads_what_mfloss_monitor_prints(mf):
    monitor = mf.cb.MFLossMonitor(learning_rate=0.01, origin_epochs=1, dataset_size=20,
                                  global_batch_size=2)
    monitor.loss_list = [5.0]
    record = Recorder()
    bridge = mf.bridge.NativeBridge(record)
    bridge.attach([monitor])
    monitor.print_output_info(
        SimpleNamespace(dataset_sink_mode=False), 1, 1, 80.0, 3, 20, 5.0, 25.0, False, 1024.0,
        0.4, 15.0, 1.2, None, None, None, None)
    assert record.get("device_throughput_samples_per_second") == 80.0
    assert record.get("iteration_time_seconds") == pytest.approx(0.025)
    assert record.get("time_remaining_seconds") == 0.4
    bridge.detach()
    assert "print_output_info" not in vars(monitor)


def test_bridge_names_local_norms_by_optimizer_parameter(mf):
    import numpy as np
    monitor = state_monitor(mf, target=["layers.0"], local_norm_format="log")
    record = Recorder()
    bridge = mf.bridge.NativeBridge(record)
    bridge.attach([monitor])
    outputs = (5.0, False, 1024.0, 1e-3, 1.0, np.array([4.0, 9.0], np.float32), (16, 16))
    bridge.on_step(1, outputs, ["model.layers.0.w", "model.layers.1.w"])
    assert record.get("local_norm", param="model.layers.0.w") == 2.0
    assert record.get("local_norm", param="model.layers.1.w") is None


def test_bridge_caps_the_series_of_one_metric(mf):
    monitor = state_monitor(mf, optimizer_state_format="log")
    record = Recorder()
    mf.bridge.NativeBridge(record, max_series=2).attach([monitor])
    for i in range(5):
        monitor._output(f"adam_m_norm/p{i}", 1.0, 1, monitor.optimizer_state_format)
    assert len(record.values) == 2


@pytest.mark.parametrize("tag, data, expected", [
    ("weight_norm", 1.5, ("weight_norm", 1.5, {})),
    ("adam_v_norm/a.b", 2.0, ("optimizer_state_norm", 2.0, {"param": "a.b", "state": "adam_v"})),
    ("local_norm/a.b", 3.0, ("local_norm", 3.0, {"param": "a.b"})),
    ("device_local_norm", 4.0, ("device_local_norm", 4.0, {})),
    ("device_accum_local_mtp_loss", 5.0, ("device_local_loss", 5.0, {"loss": "mtp"})),
    ("local_lm_loss", 6.0, ("local_loss", 6.0, {"loss": "lm"})),
    ("weight_stable_rank/w/expert_3", 7.0,
     ("weight_stable_rank", 7.0, {"param": "w", "expert": "3"})),
    ("max_attention_logit/max", 8.0, ("max_attention_logit", 8.0, {"stat": "max"})),
    ("max_attention_logit/layers.0.attn", [1.0, 2.0], None),
    ("something_new", 1.0, None),
])
def test_native_tag_table(mf, tag, data, expected):
    sample = mf.bridge.map_native_tag(tag, data)
    assert (None if sample is None else tuple(sample)) == expected


def test_loss_monitor_args_table(mf):
    got = {(s.name, frozenset(s.labels.items())): s.value for s in mf.bridge.map_loss_monitor_args(
        {"throughput": 80.0, "per_step_seconds": 250.0, "time_remain": 3.0, "main_loss": 2.0,
         "extra_loss": 0.0, "mtp_loss": 0.5}, model_flops=1e9)}
    assert got == {("device_throughput_samples_per_second", frozenset()): 80.0,
                   ("iteration_time_seconds", frozenset()): 0.25,
                   ("time_remaining_seconds", frozenset()): 3.0,
                   ("separate_loss", frozenset({("loss", "lm")})): 2.0,
                   ("separate_loss", frozenset({("loss", "mtp")})): 0.5,
                   ("device_model_flops_per_second", frozenset()): 4e9}


def test_loss_is_fixed_the_way_mfloss_monitor_fixes_it(mf):
    monitor = mf.cb.MFLossMonitor(origin_epochs=1, dataset_size=20, gradient_accumulation_steps=4)
    otel = mf.bridge.MindFormersOTelMonitor(prometheus={"port": 0})
    otel.bridge = mf.bridge.NativeBridge(Recorder())
    otel.bridge.attach([monitor])
    out = otel.parse_outputs(SimpleNamespace(net_outputs=(8.0, False, 1.0, 0.1, 1.0)))
    assert math.isclose(out.loss, 2.0)


@pytest.mark.parametrize("argv, stem", [
    (["run_mindformer.py", "--config", "configs/llama2/finetune_llama2_7b.yaml"],
     "finetune_llama2_7b"),
    (["run.py", "--config=/a/tiny.yml", "--steps", "3"], "tiny"),
    (["run.py", "--steps", "3"], None),
])
def test_job_name_defaults_to_the_config_stem(mf, argv, stem):
    assert mf.bridge.config_stem(argv) == stem


def test_resume_reads_mfloss_monitor_initial_step(mf):
    """Seam: a resumed run's step offset comes from MFLossMonitor.initial_step (or
    cb_params.initial_step, which MFLossMonitor also reads)."""
    from mindformers.core.callback.callback import MFLossMonitor
    assert MFLossMonitor(initial_step=7, origin_epochs=1, dataset_size=10,
                         global_batch_size=2).initial_step == 7
    assert "initial_step" in inspect.getsource(MFLossMonitor.on_train_step_end)


# ---------------------------------------------------------------- time figures (README)
def test_mfloss_monitor_times_a_step_between_its_step_hooks(mf):
    """The step histogram of a mindformers run measures this interval (taps on these hooks)."""
    begin = inspect.getsource(mf.cb.MFLossMonitor.on_train_step_begin)
    end = inspect.getsource(mf.cb.MFLossMonitor.on_train_step_end)
    assert "self.step_time = time.time()" in begin
    assert "step_seconds = (time.time() - self.step_time) * 1000" in end
    # the printed figure is that one step's (the print step's), not a mean over the interval
    assert "per_step_seconds = step_seconds\n" in end


def test_eval_callback_calls_its_eval_func_attribute(mf):
    assert "self.eval_func()" in inspect.getsource(mf.cb.EvalCallBack._execute_eval)
    callback = mf.cb.EvalCallBack(lambda: {"PerplexityMetric": {"loss": 1.0}}, step_interval=2)
    assert callable(callback.eval_func)


def test_checkpoint_monitor_is_a_model_checkpoint_that_records_its_last_save(mf):
    from mindspore.train import ModelCheckpoint
    assert issubclass(mf.cb.CheckpointMonitor, ModelCheckpoint)
    for method in (mf.cb.CheckpointMonitor.save_checkpoint,
                   mf.cb.CheckpointMonitor._save_megatron_ckpt_file_format,
                   ModelCheckpoint._save_ckpt):
        assert "self._last_triggered_step = cb_params.cur_step_num" in inspect.getsource(method)


def test_llama_config_gives_the_flops_shape(mf, tmp_path):
    """The FLOPs estimate counts exactly the network's matrix-multiply weights."""
    from mindformers.models.llama import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(batch_size=2, seq_length=64, hidden_size=64, num_layers=2, num_heads=4,
                         n_kv_heads=2, vocab_size=256, multiple_of=32, use_rope_slice=True,
                         compute_dtype="float32", param_init_type="float32")
    shape = mf.bridge.transformer_shape(config)
    assert shape == mf.bridge.TransformerShape(64, 2, 4, 2, 192, 256, 64)
    network = LlamaForCausalLM(config)
    weights = {p.name: p.shape for p in network.trainable_params() if len(p.shape) == 2}
    lookup = {name: size for name, size in weights.items() if "embedding" in name}
    assert list(lookup.values()) == [(256, 64)]          # the input embedding: no multiply
    assert sum(rows * cols for name, (rows, cols) in weights.items() if name not in lookup) == \
        shape.matmul_params
