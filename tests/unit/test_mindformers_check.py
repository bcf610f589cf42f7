"""`check_mindformers_yaml`: a full mindformers YAML, its native monitor_config and OTelMonitor
entry."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from mfotel.integrations.mindformers_check import check_mindformers_yaml
from tests.support.paths import ROOT

EXAMPLE = ROOT / "examples" / "mindformers" / "tiny_llama_cpu.yaml"

CPU_BASE = """\
context: {device_target: CPU, mode: 0}
model:
  model_config: {type: LlamaConfig, use_rope_slice: True}
runner_wrapper: {type: CPUTrainOneStepCell, use_clip_grad: True}
"""
ENTRY = "callbacks: [{type: MFLossMonitor}, {type: OTelMonitor, step_interval: 10}]\n"


def check(tmp_path: Path, text: str, **kwargs) -> list[str]:
    path = tmp_path / "run.yaml"
    path.write_text(textwrap.dedent(text))
    return check_mindformers_yaml(path, **kwargs)


def test_the_example_is_clean():
    assert check_mindformers_yaml(EXAMPLE, use_mindformers=False) == []


@pytest.mark.parametrize("text, expected", [
    # CPU pitfalls
    (CPU_BASE + "monitor_config: {monitor_on: True}\n",
     "monitor_config.dump_path: './dump' (mindformers' default when unset)"),
    (CPU_BASE + "monitor_config: {monitor_on: True, dump_path: ./d}\n",
     "TensorDump, which is Ascend-only"),
    (CPU_BASE + "monitor_config: {monitor_on: True, dump_path: '', local_loss_format: log}\n",
     "monitor_config.local_loss_format: produced only through TensorDump"),
    (CPU_BASE + "monitor_config: {monitor_on: True, dump_path: '', local_norm_format: log}\n",
     "Fix: set runner_wrapper.local_norm: True"),
    (CPU_BASE.replace("CPUTrainOneStepCell", "MFTrainOneStepCell"),
     "Fix: type: CPUTrainOneStepCell"),
    (CPU_BASE.replace("use_rope_slice: True", "use_rope_slice: False"),
     "Fix: use_rope_slice: True"),
    (CPU_BASE.replace(", use_clip_grad: True", "")
     + "callbacks: [{type: OTelMonitor, metrics: [loss, grad_norm]}]\n",
     "Fix: set runner_wrapper.use_clip_grad: True"),
    # native monitor_config keys
    ("monitor_config: {monitor_on: True, metrics: [loss]}\n",
     "monitor_config.metrics: mindformers rejects this mfotel key here"),
    ("monitor_config: {monitor_on: True, dump_pth: x}\n", "(did you mean 'dump_path'?)"),
    # the OTelMonitor entry
    ("callbacks: [{type: MFLossMonitor}, {type: OTelMonitor, step_interval: 0}]\n",
     "callbacks[1].step_interval: 0 is not a whole number >= 1"),
    ("callbacks:\n  - type: OTelMonitor\n    output: {consol: true}\n",
     "(did you mean 'console'?)"),
    ("callbacks: [{type: OTelMonitor}, {type: OTelMonitor}]\n", "a second OTelMonitor entry"),
    ("callbacks: [{step_interval: 3}]\n", "callbacks[0]: {'step_interval': 3} has no `type`"),
])
def test_problem_is_reported(tmp_path, text, expected):
    problems = check(tmp_path, text, use_mindformers=False)
    assert any(expected in p for p in problems), problems


def test_not_cpu_means_no_cpu_pitfalls(tmp_path):
    text = CPU_BASE.replace("CPU", "Ascend") + "monitor_config: {monitor_on: True}\n" + ENTRY
    assert check(tmp_path, text, use_mindformers=False) == []


def test_missing_entry_is_diagnosed_not_the_native_keys(tmp_path):
    """Without an OTelMonitor entry mfotel is off; native keys like dump_path are fine."""
    text = CPU_BASE + "monitor_config: {monitor_on: False, dump_path: ''}\n"
    problem, = check(tmp_path, text, use_mindformers=False)
    assert "run.yaml: callbacks: this mindformers YAML has no `type: OTelMonitor`" in problem
    assert "Fix: add `- type: OTelMonitor` to `callbacks:`" in problem
    assert "dump_path" not in problem


def test_misspelt_entry_type_gets_did_you_mean(tmp_path):
    text = CPU_BASE + "callbacks: [{type: MFLossMonitor}, {type: OtelMonitor, step_interval: 5}]\n"
    problem, = check(tmp_path, text, use_mindformers=False)
    assert "callbacks[1].type: 'OtelMonitor' is not a callback mfotel registers" in problem
    assert "(did you mean 'OTelMonitor'?)" in problem


def test_every_problem_of_the_entry_is_reported(tmp_path):
    text = ("callbacks:\n  - type: OTelMonitor\n    step_interval: 0\n    metrics: [loss, lr]\n"
            "    output: {consol: true}\n")
    problems = check(tmp_path, text, use_mindformers=False)
    assert [p.split(": ")[1] for p in problems] == [
        "callbacks[0].step_interval", "callbacks[0].metrics[1]", "callbacks[0].output.consol"]


def test_auto_register_key_is_mindformers_not_ours(tmp_path):
    text = "callbacks: [{type: OTelMonitor, auto_register: mfotel_register.OTelMonitor}]\n"
    assert check(tmp_path, text, use_mindformers=False) == []


def test_unquoted_rank_in_a_flow_mapping_is_reported_with_a_fix(tmp_path):
    text = "callbacks:\n  - type: OTelMonitor\n    output: {file_path: ./m_{rank}.log}\n"
    problem, = check(tmp_path, text, use_mindformers=False)
    assert "not valid YAML" in problem and "quote" in problem


def test_problems_name_the_file(tmp_path):
    problem, = check(tmp_path, "monitor_config: {monitor_on: True, dump_pth: x}\n" + ENTRY,
                     use_mindformers=False)
    assert problem.startswith(str(tmp_path / "run.yaml"))
