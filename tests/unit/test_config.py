"""monitor_config parsing: the seed block, aliases, bridge keys, and every error message."""
from __future__ import annotations

import os
import textwrap

import pytest

from mfotel.config import ConfigError, check_writable, describe, load_config, parse_config
from mfotel.config.source import MAX_BYTES, MAX_NODES

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
    ({"enable": True, "monitor_on": True}, "monitor_config.monitor_on",
     ["twice", "keep only enable"]),
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
            output: {console: True, file: True,
                     file_path: "./monitor_logs/train_monitor_{rank}.log"}
            log_rank: 0
        """, "tiny_llama.yaml")
    cfg = load_config(path)
    assert cfg.step_interval == 10 and len(cfg.metrics) == 5 and cfg.job_name == "tiny_llama"


def test_file_path_placeholders_and_absolute(tmp_path):
    cfg = parse_config({"output": {"file": True,
                                   "file_path": str(tmp_path / "{job_name}/m_{rank}.log")}})
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


# ---------------------------------------------------------------- every problem at once
def test_every_problem_of_a_block_is_reported_at_once(tmp_path):
    path = write(tmp_path, """\
        monitor_config:
          step_interval: 0
          metrics: [loss, lr, gradnorm]
          output: {consol: true, format: csv}
          prometheus: {port: 70000}
        """)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    lines = str(info.value).splitlines()
    assert [line.split(": ")[1] for line in lines] == [
        "monitor_config.step_interval", "monitor_config.metrics[1]", "monitor_config.metrics[2]",
        "monitor_config.output.consol", "monitor_config.output.format",
        "monitor_config.prometheus.port"]
    assert all(line.startswith(f"{path}: ") and ". Fix: " in line for line in lines)
    assert len(info.value.errors) == 6 and info.value.key == "monitor_config.step_interval"


def test_indentation_hint_comes_with_the_block_problems(tmp_path):
    path = write(tmp_path, "monitor_config:\n  step_interval: 0\nmetrics: [loss]\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    first, second = str(info.value).splitlines()
    assert "'metrics' is at the top level" in first and "indent metrics under" in first
    assert "monitor_config.step_interval" in second


def test_a_framework_can_rebuild_the_error_from_its_message():
    """mindformers' registry re-raises `type(e)(str(e))`."""
    with pytest.raises(ConfigError) as info:
        parse_config({"step_interval": 0, "metrics": ["x"]}, source="t.yaml")
    again = type(info.value)(str(info.value))
    assert str(again) == str(info.value)


# ---------------------------------------------------------------- config bombs
def _assert_refused(path, *words):
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and "Fix:" in message
    for word in words:
        assert word in message
    return message


def test_billion_laughs_is_refused_without_expanding(tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 10)]
    path = tmp_path / "laughs.yaml"
    path.write_text("\n".join(lines) + "\nmonitor_config: {job_name: *a9}\n")
    _assert_refused(path, f"expands to more than {MAX_NODES} values")


def test_recursive_alias_is_refused(tmp_path):
    path = tmp_path / "loop.yaml"
    path.write_text("monitor_config: &m {run: {id: *m}}\n")
    _assert_refused(path, "recursive")


def test_a_huge_file_is_refused_before_it_is_read_whole(tmp_path):
    path = tmp_path / "huge.yaml"
    with open(path, "w") as handle:
        handle.write("monitor_config:\n  job_name: \"")
        handle.write("x" * (50 * 2**20))
        handle.write("\"\n")
    _assert_refused(path, f"larger than {MAX_BYTES // 2**20} MiB")


def test_a_long_value_is_refused_and_not_echoed_whole(tmp_path):
    path = write(tmp_path, "monitor_config:\n  job_name: \"" + "x" * (MAX_BYTES - 100) + "\"\n")
    message = _assert_refused(path, "monitor_config.job_name")
    assert len(message) < 1000


@pytest.mark.parametrize("depth", [100, 5000])
def test_deep_nesting_is_refused(tmp_path, depth):
    path = write(tmp_path, "monitor_config: {run: " + "[" * depth + "]" * depth + "}\n")
    _assert_refused(path)


def test_a_fifo_is_refused_without_blocking(tmp_path):
    path = tmp_path / "fifo.yaml"
    os.mkfifo(path)
    _assert_refused(path, "not a regular file")


@pytest.mark.parametrize("text, key", [
    ('monitor_config: {step_interval: "²"}', "monitor_config.step_interval"),
    ("monitor_config: {step_interval: " + "9" * 5000 + "}", "-"),
    ("monitor_config: {step_interval: 2001-02-30}", "-"),
    ("monitor_config: {step_interval: 1e3}", "monitor_config.step_interval"),
    ("monitor_config: {prometheus: {linger_seconds: .inf}}",
     "monitor_config.prometheus.linger_seconds"),
    ("monitor_config: {prometheus: {linger_seconds: .nan}}",
     "monitor_config.prometheus.linger_seconds"),
    ("monitor_config: {? [a, b] : 1}", "-"),
])
def test_odd_values_are_config_errors_not_tracebacks(tmp_path, text, key):
    path = write(tmp_path, text + "\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert f"{path}: {key}: " in str(info.value)


def test_yaml_text_numbers_get_a_hint():
    # a whole-number key gets a whole number (1000.0 would be refused again)
    with pytest.raises(ConfigError, match=r"YAML read '1e3' as text: write step_interval: 1000 "):
        parse_config({"step_interval": "1e3"})


# ---------------------------------------------------------------- bounds
@pytest.mark.parametrize("data, key", [
    ({"prometheus": {"linger_seconds": 1e10}}, "prometheus.linger_seconds"),
    ({"prometheus": {"linger_seconds": -1}}, "prometheus.linger_seconds"),
    ({"otlp": {"interval_seconds": 1e300}}, "otlp.interval_seconds"),
    ({"otlp": {"interval_seconds": float("nan")}}, "otlp.interval_seconds"),
    ({"otlp": {"timeout_seconds": float("inf")}}, "otlp.timeout_seconds"),
    ({"otlp": {"timeout_seconds": 7200}}, "otlp.timeout_seconds"),
    ({"step_interval": 2**40}, "step_interval"),
    ({"native_series_limit": 10**7}, "native_series_limit"),
    ({"actions": {"plateau": {"min_delta": float("nan")}}}, "actions.plateau.min_delta"),
])
def test_durations_and_counts_are_bounded(data, key):
    with pytest.raises(ConfigError) as info:
        parse_config(data, source="train.yaml")
    assert info.value.key == f"monitor_config.{key}"
    assert "<=" in str(info.value) or "between" in str(info.value)  # the maximum is named


def test_a_day_of_linger_is_the_documented_maximum():
    cfg = parse_config({"prometheus": {"linger_seconds": 86400}})
    assert cfg.prometheus.linger_seconds == 86400


# ---------------------------------------------------------------- placeholders and job names
@pytest.mark.parametrize("file_path, words", [
    ("./m_{foo}.log", "has the placeholder {foo}"),
    ("./m_{0}.log", "has the placeholder {0}"),
    ("./m_{}.log", "has the placeholder {}"),
    ("./m_{rank:>300000000}.log", "formats {rank} (:>300000000)"),
    ("./m_{rank!r}.log", "formats {rank} (!r)"),
    ("./m_{rank.real}.log", "has the placeholder {rank.real}"),
    ("./m_{rank", "expected '}' before end of string"),
    ("./m_}.log", "Single '}'"),
])
def test_file_path_placeholders_are_checked_at_load(file_path, words):
    with pytest.raises(ConfigError) as info:
        parse_config({"output": {"file": True, "file_path": file_path}}, source="t.yaml")
    assert info.value.key == "monitor_config.output.file_path" and words in str(info.value)


def test_allowed_placeholders_and_literal_braces_fill_in(tmp_path):
    cfg = parse_config({"output": {"file": True,
                                   "file_path": str(tmp_path / "{job_name}/m_{{x}}_{rank}.log")}})
    assert cfg.output.resolved_file_path(3, "llama") == tmp_path / "llama" / "m_{x}_3.log"


@pytest.mark.parametrize("key, data", [
    ("file_sd.path", {"file_sd": {"path": "/sd/{rank:>9999999}.json"}}),
    ("run.state_file", {"run": {"state_file": "/s/{pid}.json"}}),
    ("actions.control_dir", {"actions": {"control_dir": "/c/{rank}"}}),
])
def test_every_path_template_is_checked(key, data):
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert info.value.key == f"monitor_config.{key}"


@pytest.mark.parametrize("job_name", ["../../esc", "a/b", "", " ", "-lead", ".hidden", "x" * 129,
                                      "tab\there", "naïve"])
def test_unsafe_job_names_are_refused(job_name):
    with pytest.raises(ConfigError) as info:
        parse_config({"job_name": job_name})
    assert info.value.key == "monitor_config.job_name"


def test_job_name_from_an_odd_file_name_is_made_safe(tmp_path):
    path = write(tmp_path, "monitor_config: {}\n", "my run (v2).yaml")
    assert load_config(path).job_name == "my_run__v2_"


def test_service_name_is_not_a_resource_attribute_key():
    with pytest.raises(ConfigError,
                       match="resource_attributes.service.name: service.name is the job name"):
        parse_config({"resource_attributes": {"service.name": "x"}})


# ---------------------------------------------------------------- URLs and secrets
@pytest.mark.parametrize("data, key", [
    ({"otlp": {"endpoint": "collector:4318"}}, "otlp.endpoint"),
    ({"otlp": {"endpoint": "http://c:4318/v1/traces"}}, "otlp.endpoint"),
    ({"otlp": {"endpoint": "http://c:99999"}}, "otlp.endpoint"),
    ({"alertmanager_url": "ftp://am:9093"}, "alertmanager_url"),
])
def test_urls_are_checked(data, key):
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert info.value.key == f"monitor_config.{key}"


def test_a_bad_url_error_does_not_echo_its_password():
    with pytest.raises(ConfigError) as info:
        parse_config({"otlp": {"endpoint": "http://u:hunter2@c:4318/v1/logs"}})
    assert "hunter2" not in str(info.value) and "u:***@c:4318" in str(info.value)


def test_errors_never_echo_header_values_or_yaml_lines(tmp_path):
    with pytest.raises(ConfigError) as info:
        parse_config({"otlp": {"headers": {"authorization": ["Bearer", "tok-1"]}}})
    assert "tok-1" not in str(info.value) and "otlp.headers.authorization" in str(info.value)
    path = write(tmp_path,
                 "monitor_config:\n  otlp: {headers: {authorization: Bearer tok-2, x: [}}\n")
    with pytest.raises(ConfigError, match=r"not valid YAML .* at line 2, column \d+") as info:
        load_config(path)
    assert "tok-2" not in str(info.value)


def test_describe_redacts_headers_and_url_passwords():
    cfg = parse_config({"otlp": {"endpoint": "http://u:s3cretpw@c:4318/v1/metrics?api_key=k&x=1",
                                 "headers": {"authorization": "Bearer s3crettok",
                                             "x-tenant": "t"}},
                        "alertmanager_url": "https://admin:s3cretpw2@am:9093"})
    text = str(describe(cfg))
    assert "s3cret" not in text and "'t'" not in text
    data = describe(cfg)
    assert data["otlp"]["endpoint"] == "http://u:***@c:4318/v1/metrics?api_key=***&x=1"
    assert data["otlp"]["headers"] == {"authorization": "***", "x-tenant": "***"}
    assert data["alertmanager_url"] == "https://admin:***@am:9093"


@pytest.mark.parametrize("key", ["flops_per_token", "peak_flops", "batch_size"])
def test_a_400_digit_integer_is_out_of_range_not_an_overflow(key):
    """float(10**400) raises OverflowError: numbers are compared before they are converted
    (found by test_config_fuzz)."""
    with pytest.raises(ConfigError, match=f"monitor_config.{key}"):
        parse_config({key: 10 ** 400})
