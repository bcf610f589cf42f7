"""Rank identity from launcher variables, ports per local rank, run identity across restarts."""
from __future__ import annotations

import json

import pytest

from mfotel.config import ConfigError, RunConfig, parse_config
from mfotel.identity import (
    RankIdentity,
    finish_run,
    identity_from_env,
    rank_port,
    run_state_path,
    start_run,
)


@pytest.mark.parametrize("env, rank, local, world, local_world, node_rank, source", [
    ({}, 0, 0, 1, 0, 0, "default"),
    # msrun worker before init(): RANK_ID, RANK_SIZE, DEVICE_ID (the local device index)
    ({"RANK_ID": "3", "RANK_SIZE": "4", "DEVICE_ID": "1", "MS_NODE_ID": "3"},
     3, 1, 4, 0, 0, "env:DEVICE_ID"),
    # torchrun-style names
    ({"RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8"},
     9, 1, 16, 8, 1, "env:LOCAL_RANK"),
    # Open MPI
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
      "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"},
     5, 1, 8, 4, 1, "env:OMPI_COMM_WORLD_LOCAL_RANK"),
    # only the local world size: local rank derived from the rank
    ({"RANK_ID": "6", "RANK_SIZE": "8", "LOCAL_WORLD_SIZE": "4"},
     6, 2, 8, 4, 1, "env:rank%local_world_size"),
    ({"RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "NODE_RANK": "7"},
     6, 2, 8, 0, 7, "env:LOCAL_RANK"),
])
def test_identity_from_launcher_variables(env, rank, local, world, local_world, node_rank, source):
    ident = identity_from_env(env)
    assert (ident.rank, ident.local_rank, ident.world_size, ident.local_world_size,
            ident.node_rank, ident.local_rank_source) == \
        (rank, local, world, local_world, node_rank, source)


def test_after_init_the_communication_layer_wins():
    ident = identity_from_env({"RANK_ID": "3", "RANK_SIZE": "4", "DEVICE_ID": "0"})
    after = ident.with_communication(rank=3, local_rank=1, world_size=4, local_world_size=2)
    assert (after.rank, after.local_rank, after.local_world_size, after.node_rank,
            after.local_rank_source) == (3, 1, 2, 1, "init")
    pinned = identity_from_env({"RANK": "3", "NODE_RANK": "5"}).with_communication(3, 1, 4, 2)
    assert pinned.node_rank == 5  # a launcher's NODE_RANK is kept


def test_kubernetes_pod_labels_join_npu_exporter():
    ident = identity_from_env({"RANK_ID": "0", "DEVICE_ID": "3", "POD_NAME": "llama-worker-0",
                               "POD_NAMESPACE": "train"})
    labels = ident.labels()
    assert labels["pod_name"] == "llama-worker-0" and labels["namespace"] == "train"
    assert labels["device_id"] == "3"
    assert "pod_name" not in identity_from_env({}).labels()  # absent outside Kubernetes
    assert ident.resource_attributes()["k8s.pod.name"] == "llama-worker-0"


@pytest.mark.parametrize("base, local, local_world, port", [
    (9464, 0, 8, 9464), (9464, 7, 8, 9471), (0, 3, 8, 0), (65528, 7, 8, 65535), (9464, 2, 0, 9466)])
def test_port_is_base_plus_local_rank(base, local, local_world, port):
    ident = RankIdentity(rank=local, local_rank=local, local_world_size=local_world)
    assert rank_port(base, ident) == port


@pytest.mark.parametrize("base, local, local_world, message", [
    (9464, 8, 8, "outside the node's ranks, so two ranks on this node would serve the same port"),
    (65530, 1, 8, r"65530..65537 \(port \+ local rank\) run past 65535"),
    (65535, 1, 0, "run past 65535"),
])
def test_ports_that_would_collide_are_config_errors(base, local, local_world, message):
    ident = RankIdentity(rank=9, local_rank=local, local_world_size=local_world)
    with pytest.raises(ConfigError, match=message) as error:
        rank_port(base, ident, source="train.yaml")
    assert str(error.value).startswith("train.yaml: monitor_config.prometheus.port: rank 9")
    assert "Fix:" in str(error.value)


# ------------------------------------------------------------------ run identity
def test_restarts_keep_the_run_id_and_count_attempts(tmp_path):
    run = RunConfig(state_file=str(tmp_path / "{job_name}_{rank}.json"))
    first = start_run(run, 0, "llama", env={})
    assert (first.attempt, first.restarts, first.configured) == (1, 0, True)
    # the process dies (no finish_run): the next start is attempt 2 of the same run
    second = start_run(run, 0, "llama", env={})
    assert (second.run_id, second.attempt) == (first.run_id, 2)
    finish_run(run, 0, "llama", second, step=40, completed=False)
    third = start_run(run, 0, "llama", env={})
    assert (third.run_id, third.attempt, third.restarts) == (first.run_id, 3, 2)
    finish_run(run, 0, "llama", third, step=100, completed=True)
    state = json.loads(run_state_path(run, 0, "llama").read_text())
    assert state["status"] == "completed" and state["step"] == 100 and state["attempt"] == 3
    fresh = start_run(run, 0, "llama", env={})  # after a completed run: a new run
    assert fresh.run_id != first.run_id and fresh.attempt == 1
    assert third.labels() == {"run_id": first.run_id, "attempt": "3"}
    assert third.resource_attributes() == {"mfotel.run_id": first.run_id, "mfotel.attempt": "3"}


def test_explicit_run_id_from_config_or_environment(tmp_path):
    run = RunConfig(state_file=str(tmp_path / "s.json"))
    assert start_run(run, 0, "j", env={"MFOTEL_RUN_ID": "exp-7"}).run_id == "exp-7"
    again = start_run(run, 0, "j", env={"MFOTEL_RUN_ID": "exp-7"})
    assert (again.run_id, again.attempt) == ("exp-7", 2)
    other = start_run(run, 0, "j", env={"MFOTEL_RUN_ID": "exp-8"})  # another run: attempt 1
    assert (other.run_id, other.attempt) == ("exp-8", 1)
    assert start_run(RunConfig(id="cfg-1"), 0, "j", env={"MFOTEL_RUN_ID": "x"}).run_id == "cfg-1"


def test_without_run_config_the_identity_stays_off_rank_info():
    run = start_run(RunConfig(), 0, "j", env={})
    assert run.attempt == 1 and not run.configured and run.labels() == {}
    assert set(run.resource_attributes()) == {"mfotel.run_id", "mfotel.attempt"}


def test_unwritable_state_file_is_an_error_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="run.state_file: cannot write"):
        start_run(RunConfig(state_file=str(blocker / "s.json")), 0, "j", env={})


# ------------------------------------------------------------------ config keys
def test_multirank_config_keys():
    cfg = parse_config({"file_sd": {"path": "/sd/{job_name}.json", "hosts": "n1, n2",
                                    "labels": {"cluster": "a"}},
                        "cardinality": "health", "metric_ranks": [8, 0],
                        "run": {"id": "r1", "state_file": "./s_{rank}.json"}})
    assert cfg.file_sd.hosts == ("n1", "n2") and cfg.metric_ranks == (0, 8)
    assert [cfg.exports_seed_metrics(r) for r in (0, 1, 8)] == [True, False, True]
    assert parse_config({"cardinality": "health", "log_rank": 3}).exports_seed_metrics(3)
    assert parse_config({}).exports_seed_metrics(5)  # full: every rank


@pytest.mark.parametrize("data, key, message", [
    ({"file_sd": {"path": "x.json", "mode": "rank"}}, "file_sd.path", "needs {rank}"),
    ({"file_sd": {"mode": "rank", "hosts": ["a"]}}, "file_sd.hosts", "only used by mode: job"),
    ({"file_sd": {"labels": {"instance": "x"}}}, "file_sd.labels.instance", "Prometheus sets"),
    ({"file_sd": {"path": "{host}.json"}}, "file_sd.path", "placeholder"),
    ({"file_sd": {"mdoe": "job"}}, "file_sd.mdoe", "did you mean 'mode'"),
    ({"cardinality": "low"}, "cardinality", "not one of full, health"),
    ({"metric_ranks": [-1]}, "metric_ranks", "not a rank"),
])
def test_multirank_config_errors(data, key, message):
    with pytest.raises(ConfigError, match=message) as error:
        parse_config(data)
    assert error.value.key == f"monitor_config.{key}"


@pytest.mark.parametrize("env, device", [
    ({"DEVICE_ID": "1"}, "1"),
    ({"DEVICE_ID": "1", "ASCEND_RT_VISIBLE_DEVICES": "4,5,6,7"}, "5"),
    ({"DEVICE_ID": "0", "CUDA_VISIBLE_DEVICES": "3"}, "3"),
    ({"DEVICE_ID": "2", "ASCEND_VISIBLE_DEVICES": "0,1"}, "2"),   # not in the list: as given
    ({"DEVICE_ID": "0", "CUDA_VISIBLE_DEVICES": "GPU-uuid"}, "0"),  # UUIDs: not an index
])
def test_device_id_is_the_physical_index_device_exporters_use(env, device):
    assert identity_from_env(env).device_id == device
    assert identity_from_env(env).local_rank == int(env["DEVICE_ID"])  # local rank unchanged


# ------------------------------------------------------------------ bad launcher variables
@pytest.mark.parametrize("env, variable, problem", [
    ({"RANK_ID": "-1"}, "RANK_ID", "RANK_ID='-1' is not a valid rank (ASCII digits, 0 to 999999)"),
    ({"RANK_ID": "1" * 23}, "RANK_ID", f"RANK_ID='{'1' * 23}' is not a valid rank"),
    ({"RANK_ID": "9" * 5000}, "RANK_ID", f"RANK_ID='{'9' * 24}'... is not a valid rank"),
    ({"RANK_ID": "٣"}, "RANK_ID", "RANK_ID='٣' is not a valid rank"),   # int() reads it as 3
    ({"RANK": "3.0"}, "RANK", "RANK='3.0' is not a valid rank"),
    ({"RANK_ID": "x", "RANK": "2"}, "RANK_ID", "RANK_ID='x'"),   # the variable read is checked
    ({"RANK_SIZE": "0"}, "RANK_SIZE", "RANK_SIZE='0' is not a valid world size (ASCII digits, "
                                      "1 to 1000000)"),
    ({"WORLD_SIZE": "１０"}, "WORLD_SIZE", "is not a valid world size"),   # fullwidth digits
    ({"LOCAL_RANK": "70000"}, "LOCAL_RANK", "LOCAL_RANK='70000' is not a valid local rank "
                                            "(ASCII digits, 0 to 65534)"),
    ({"LOCAL_WORLD_SIZE": "-8"}, "LOCAL_WORLD_SIZE", "is not a valid number of ranks on this node"),
    ({"DEVICE_ID": "²"}, "DEVICE_ID", "DEVICE_ID='²' is not a valid device index"),
    ({"NODE_RANK": "-1"}, "NODE_RANK", "is not a valid node rank"),
    ({"RANK_ID": "3", "RANK_SIZE": "2"}, "RANK_ID",
     "RANK_ID=3 is not below RANK_SIZE=2 (ranks count from 0 to the world size - 1)"),
    ({"LOCAL_RANK": "8", "LOCAL_WORLD_SIZE": "8"}, "LOCAL_RANK",
     "LOCAL_RANK=8 is not below LOCAL_WORLD_SIZE=8"),
    ({"RANK": "0", "WORLD_SIZE": "2", "NODE_RANK": "2"}, "NODE_RANK",
     "NODE_RANK=2 is not below WORLD_SIZE=2"),
])
def test_bad_launcher_variables_are_config_errors_naming_the_variable(env, variable, problem):
    with pytest.raises(ConfigError) as error:
        identity_from_env(env)
    assert error.value.source == "the launcher's environment" and error.value.key == variable
    message = str(error.value)
    assert problem in message
    assert f"Fix: set {variable}" in message or f"Fix: correct {variable}" in message


def test_the_last_rank_and_the_largest_job_are_accepted():
    ident = identity_from_env({"RANK": "999999", "WORLD_SIZE": "1000000", "LOCAL_RANK": "65534"})
    assert (ident.rank, ident.world_size, ident.local_rank) == (999_999, 1_000_000, 65_534)


def test_a_node_plan_that_cannot_fit_names_the_local_rank_and_its_variable():
    ident = identity_from_env({"LOCAL_RANK": "65000"})
    with pytest.raises(ConfigError) as error:
        rank_port(9464, ident, source="train.yaml")
    message = str(error.value)
    assert "the node's ports 9464..74464 (port + local rank) run past 65535" in message
    assert "Fix: 65001 ranks on one node cannot each serve a port: check the local rank 65000 " \
           "(from LOCAL_RANK)" in message and "-" not in message.split("Fix:")[1].split()[0]
    ident = identity_from_env({"LOCAL_RANK": "7"})   # a base port that fits is still suggested
    with pytest.raises(ConfigError, match="use a base port of at most 65528"):
        rank_port(65530, ident)
