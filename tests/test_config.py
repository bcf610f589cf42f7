"""monitor_config parsing: the seed block, aliases, bridge keys, and every error message."""
from __future__ import annotations

import textwrap

import pytest

from mfotel.config import ConfigError, check_writable, describe, load_config, parse_config

SEED_YAML = """\
monitor_config:
  enable: True
  step_interval: 50
  metrics: [loss, learning_rate, grad_norm]
  output:
    console: True
    file: True
    file_path: "./monitor_logs/train_monitor.log"
  log_rank: 0
"""


def write(tmp_path, text: str, name: str = "train.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_seed_block_loads_exactly_as_written(tmp_path):
    cfg = load_config(write(tmp_path, SEED_YAML, "llama7b-sft.yaml"))
    assert cfg.enable is True
    assert cfg.step_interval == 50
    assert cfg.metrics == ("loss", "learning_rate", "grad_norm")
    assert cfg.output.console and cfg.output.file
    assert cfg.output.file_path == "./monitor_logs/train_monitor.log"
    assert cfg.log_rank == (0,)
    assert cfg.job_name == "llama7b-sft"  # the YAML file's stem
    assert cfg.prometheus.port == 9464 and cfg.prometheus.host == "0.0.0.0"
    assert cfg.on_nonfinite == "warn"


def test_defaults_match_design():
    cfg = parse_config({})
    assert (cfg.enable, cfg.step_interval, cfg.metrics) == (True, 1, ("loss", "learning_rate"))
    assert (cfg.output.console, cfg.output.file) == (True, False)
    assert cfg.log_rank == (0,)


def test_aliases_monitor_on_and_interval():
    cfg = parse_config({"monitor_on": False, "interval": 7})
    assert cfg.enable is False and cfg.step_interval == 7


def test_bridge_keys():
    cfg = parse_config({"job_name": "llama", "prometheus": {"host": "127.0.0.1", "port": 9500,
                                                            "linger_seconds": 15},
                        "on_nonfinite": "stop", "resource_attributes": {"team": "nlp"},
                        "otlp": {"endpoint": "http://c:4318/v1/metrics", "interval_seconds": 5},
                        "early_steps": 100, "early_step_interval": 1, "batch_size": 8,
                        "seq_length": 2048})
    assert cfg.job_name == "llama" and cfg.prometheus.port == 9500
    assert cfg.prometheus.linger_seconds == 15.0 and cfg.on_nonfinite == "stop"
    assert cfg.resource_attributes == {"team": "nlp"}
    assert cfg.otlp.endpoint == "http://c:4318/v1/metrics" and cfg.otlp.interval_seconds == 5.0
    assert (cfg.batch_size, cfg.seq_length) == (8, 2048)


@pytest.mark.parametrize("log_rank, expected", [
    (0, (0,)), ([0, 8], (0, 8)), (-1, None), ("all", None), ([3, 3, 1], (1, 3))])
def test_log_rank_forms(log_rank, expected):
    assert parse_config({"log_rank": log_rank}).log_rank == expected


def test_log_rank_gating():
    cfg = parse_config({"log_rank": [0, 2]})
    assert [r for r in range(4) if cfg.logs_on(r)] == [0, 2]
    assert all(parse_config({"log_rank": -1}).logs_on(r) for r in range(4))


def test_record_steps_with_dense_start():
    cfg = parse_config({"step_interval": 10, "early_steps": 5, "early_step_interval": 1})
    assert [s for s in range(1, 31) if cfg.is_record_step(s)] == [1, 2, 3, 4, 5, 10, 20, 30]


@pytest.mark.parametrize("data, key, words", [
    ({"step_interval": 0}, "monitor_config.step_interval", ["0", "whole number >= 1"]),
    ({"step_interval": "fast"}, "monitor_config.step_interval", ["'fast'", "step_interval: 50"]),
    ({"step_intervall": 5}, "monitor_config.step_intervall", ["did you mean 'step_interval'"]),
    ({"metrics": ["loss", "lr"]}, "monitor_config.metrics[1]", ["'lr'", "learning_rate"]),
    ({"metrics": ["los"]}, "monitor_config.metrics[0]", ["did you mean 'loss'"]),
    ({"metrics": []}, "monitor_config.metrics", ["non-empty list"]),
    ({"enable": "maybe"}, "monitor_config.enable", ["not a boolean", "true or false"]),
    ({"log_rank": "first"}, "monitor_config.log_rank", ["-1 for every rank"]),
    ({"output": {"consol": True}}, "monitor_config.output.consol", ["did you mean 'console'"]),
    ({"output": {"format": "csv"}}, "monitor_config.output.format", ["text, json"]),
    ({"output": "console"}, "monitor_config.output", ["not a mapping", "indent"]),
    ({"prometheus": {"port": 70000}}, "monitor_config.prometheus.port", ["between 0 and 65535"]),
    ({"prometheus": {"certfile": "c.pem"}}, "monitor_config.prometheus.keyfile", ["keyfile"]),
    ({"on_nonfinite": "explode"}, "monitor_config.on_nonfinite", ["warn, stop"]),
    ({"enable": True, "monitor_on": True}, "monitor_config.monitor_on", ["twice", "keep only enable"]),
])
def test_errors_name_key_value_and_fix(data, key, words):
    with pytest.raises(ConfigError) as info:
        parse_config(data, source="train.yaml")
    message = str(info.value)
    assert message.startswith(f"train.yaml: {key}: ")
    assert "Fix:" in message
    for word in words:
        assert word in message


def test_top_level_keys_beside_monitor_config_get_an_indentation_hint(tmp_path):
    path = write(tmp_path, """\
        monitor_config:
          enable: True
        step_interval: 50
        metrics: [loss]
        """)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert str(path) in message and "metrics" in message and "step_interval" in message
    assert "indent" in message and "under monitor_config" in message


def test_monitor_keys_without_a_block_are_an_error_not_a_silent_default(tmp_path):
    path = write(tmp_path, "step_interval: 50\nlog_rank: 0\n")
    with pytest.raises(ConfigError, match="no monitor_config block.*Fix: put them under"):
        load_config(path)


def test_missing_block_and_bad_yaml_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="no monitor_config block"):
        load_config(write(tmp_path, "model: {}\n"))
    with pytest.raises(ConfigError, match=r"bad\.yaml.*not valid YAML"):
        load_config(write(tmp_path, "monitor_config: [unclosed\n", "bad.yaml"))
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "absent.yaml")


def test_unquoted_placeholder_in_flow_mapping_gets_a_quoting_hint(tmp_path):
    path = write(tmp_path, "monitor_config:\n  output: {file: True, file_path: ./m_{rank}.log}\n")
    with pytest.raises(ConfigError, match=r"quote.*file_path: \"./logs/m_\{rank\}.log\""):
        load_config(path)


def test_yaml_is_loaded_safely(tmp_path):
    path = write(tmp_path, "monitor_config: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)


def test_mindformers_callback_entry_is_read(tmp_path):
    path = write(tmp_path, """\
        monitor_config: {monitor_on: True, dump_path: ''}
        callbacks:
          - type: MFLossMonitor
          - type: OTelMonitor
            step_interval: 10
            metrics: [loss, learning_rate, grad_norm, throughput, step_time]
            output: {console: True, file: True, file_path: "./monitor_logs/train_monitor_{rank}.log"}
            log_rank: 0
        """, "tiny_llama.yaml")
    cfg = load_config(path)
    assert cfg.step_interval == 10 and len(cfg.metrics) == 5 and cfg.job_name == "tiny_llama"


def test_file_path_placeholders_and_absolute(tmp_path):
    cfg = parse_config({"output": {"file": True, "file_path": str(tmp_path / "{job_name}/m_{rank}.log")}})
    assert cfg.output.resolved_file_path(3, "llama") == tmp_path / "llama" / "m_3.log"


def test_unwritable_output_directory_is_an_error_at_start(tmp_path):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file, not a directory")
    cfg = parse_config({"output": {"file": True, "file_path": str(blocked / "m.log")}},
                       source="train.yaml")
    with pytest.raises(ConfigError) as info:
        check_writable(cfg, 0, "job")
    assert "monitor_config.output.file_path" in str(info.value) and "Fix:" in str(info.value)


def test_describe_round_trips_through_parse():
    cfg = parse_config({"step_interval": 5, "log_rank": -1, "metrics": ["loss"]})
    data = describe(cfg)
    source = data.pop("source")
    assert parse_config(data, source=source) == cfg
    assert data["log_rank"] == -1 and data["metrics"] == ["loss"]
