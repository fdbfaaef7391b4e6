"""What each engine role asks of vLLM (no vLLM started here)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from ascendserve.config import ConfigError, load
from ascendserve.engine.vllm_server import build_argv


@pytest.fixture()
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


def argv_for(role, model_dir, **flags):
    return build_argv(load(role, None, {"model__path": model_dir, **flags}, env={}))


def option(argv, name):
    return argv[argv.index(name) + 1] if name in argv else None


def test_encoder_is_encoder_only_ec_producer(model_dir):
    argv = argv_for("encoder", model_dir, ec__path="/shared/ec")
    assert "--mm-encoder-only" in argv and "--no-enable-prefix-caching" in argv
    ec = json.loads(option(argv, "--ec-transfer-config"))
    assert ec == {"ec_connector": "ECExampleConnector", "ec_role": "ec_producer",
                  "ec_connector_extra_config": {"shared_storage_path": "/shared/ec"}}
    assert "--kv-transfer-config" not in argv


@pytest.mark.parametrize("role,kv_role", [("prefill", "kv_producer"), ("decode", "kv_consumer")])
def test_prefill_and_decode_kv_sides(model_dir, role, kv_role):
    argv = argv_for(role, model_dir, kv__path="/shared/kv")
    kv = json.loads(option(argv, "--kv-transfer-config"))
    assert kv["kv_role"] == kv_role and kv["kv_connector"] == "ExampleConnector"
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == "/shared/kv"
    assert "--ec-transfer-config" not in argv and "--mm-encoder-only" not in argv


@pytest.mark.parametrize("role", ["pd", "prefill"])
def test_ec_consumer_only_behind_an_encoder(model_dir, role):
    assert "--ec-transfer-config" not in argv_for(role, model_dir)
    argv = argv_for(role, model_dir, ec__enabled=True)
    assert json.loads(option(argv, "--ec-transfer-config"))["ec_role"] == "ec_consumer"
    assert option(argv, "--mm-processor-cache-gb") == "0"


def test_common_arguments_and_passthrough(tmp_path, model_dir):
    conf = tmp_path / "c.toml"
    conf.write_text('[engine.vllm]\nmax-num-batched-tokens = 512\nenable-prefix-caching = false\n'
                    'limit-mm-per-prompt = {image = 2}\n')
    c = load("pd", str(conf), {"model__path": model_dir, "server__port": "8123", "engine__enforce_eager": True,
                               "engine__max_model_len": "2048", "engine__vllm_args": ["--seed=7"]}, env={})
    argv = build_argv(c)
    assert option(argv, "--model") == model_dir and option(argv, "--port") == "8123"
    assert option(argv, "--host") == "127.0.0.1" and "--enforce-eager" in argv
    assert option(argv, "--max-model-len") == "2048"
    assert option(argv, "--max-num-batched-tokens") == "512"
    assert "--no-enable-prefix-caching" in argv
    assert json.loads(option(argv, "--limit-mm-per-prompt")) == {"image": 2}
    assert argv[-1] == "--seed=7"
    assert option(argv, "--middleware") == "ascendserve.engine.middleware.EngineMiddleware"


@pytest.mark.parametrize("arg", ["--port=1", "--model", "--no-mm-encoder-only", "--tensor_parallel_size=2"])
def test_owned_arguments_refused(model_dir, arg):
    with pytest.raises(ConfigError, match="is set by ascendserve"):
        argv_for("pd", model_dir, engine__vllm_args=[arg])


def test_our_ec_connectors_and_their_settings(model_dir):
    argv = argv_for("pd", model_dir, ec__enabled=True, ec__connector="store", ec__store_url="10.0.0.5:11211",
                    ec__chunk_kb="256", ec__recv_buffer_tokens="4096")
    ec = json.loads(option(argv, "--ec-transfer-config"))
    assert ec["ec_connector"] == "AscendECStoreConnector"
    assert ec["ec_connector_module_path"] == "ascendserve.connectors.ec.connector"
    extra = ec["ec_connector_extra_config"]
    assert extra["backend"] == "memcached" and extra["store_url"] == "10.0.0.5:11211"
    assert extra["chunk_bytes"] == 256 << 10 and extra["recv_buffer_tokens"] == 4096
    assert extra["recv_prefix"].startswith("asf-ec-recv-")
    shm = json.loads(option(argv_for("encoder", model_dir, ec__connector="shm"), "--ec-transfer-config"))
    assert shm["ec_connector"] == "AscendECShmConnector" and shm["ec_role"] == "ec_producer"
    assert shm["ec_connector_extra_config"]["backend"] == "shm"


def test_ec_settings_are_checked(model_dir):
    with pytest.raises(ConfigError, match="store_url"):
        argv_for("encoder", model_dir, ec__connector="store")
    with pytest.raises(ConfigError, match="mooncake_master"):
        argv_for("encoder", model_dir, ec__connector="store", ec__store_backend="mooncake")
    with pytest.raises(ConfigError, match="recv_buffer_tokens"):
        argv_for("pd", model_dir, ec__enabled=True, ec__recv_buffer_tokens="1000")  # below 2048


@pytest.mark.parametrize("how", [{"engine__vllm_args": ["--mm-processor-cache-gb=4"]},
                                 {"engine__vllm_args": ["--mm-processor-cache-gb", "1"]}])
def test_consumer_refuses_a_processor_cache(model_dir, how):
    with pytest.raises(ConfigError, match="mm_processor_cache_gb = .* must be off"):
        argv_for("pd", model_dir, ec__enabled=True, **how)
    argv = argv_for("pd", model_dir, ec__enabled=True, engine__vllm_args=["--mm-processor-cache-gb=0"])
    assert option(argv, "--mm-processor-cache-gb") == "0"


def _config(model_dir, runtime_dir, role="pd", port=8123):
    return load(role, None, {"model__path": model_dir, "runtime_dir": str(runtime_dir), "server__port": port},
                env={})


def test_vllm_binds_its_ipc_sockets_in_a_directory_of_the_instance(model_dir, tmp_path, monkeypatch):
    """vLLM leaves the sockets of workers it force-kills (and all of a killed instance) in the
    temp dir: each instance gets a directory of its own, emptied at start, removed at stop."""
    from ascendserve.engine.vllm_server import ipc_dir, prepare_environment

    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    run = tmp_path / "run"
    if len(str(run)) > 40:  # pytest's tmp_path is long; the short runtime dirs users have
        run = Path(tempfile.mkdtemp(prefix="asf-t", dir="/tmp"))
    config = _config(model_dir, run)
    where = ipc_dir(config)
    assert where == (run / f"ipc-{config.instance_id}").absolute()
    where.mkdir(parents=True)
    (where / "0b7c9a8e-left-by-a-killed-predecessor").write_text("")
    env = prepare_environment(config)
    assert env["VLLM_RPC_BASE_PATH"] == str(where)
    assert where.is_dir() and not any(where.iterdir())
    other = _config(model_dir, run, port=8124)
    assert ipc_dir(other) != where  # instances on one host never share (nor empty) each other's
    if run != tmp_path / "run":
        shutil.rmtree(run)


def test_ipc_sockets_stay_where_the_user_says_or_go_to_a_short_path(model_dir, tmp_path, monkeypatch):
    from ascendserve.engine.vllm_server import ipc_dir, prepare_environment

    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(tmp_path / "mine"))
    assert ipc_dir(_config(model_dir, tmp_path)) is None
    assert "VLLM_RPC_BASE_PATH" not in prepare_environment(_config(model_dir, tmp_path))
    monkeypatch.delenv("VLLM_RPC_BASE_PATH")
    deep = tmp_path / ("d" * 60)  # + /ipc-<instance id>/<uuid4> passes a socket name's 107 bytes
    short_tmp = Path(tempfile.mkdtemp(prefix="asf-t", dir="/tmp"))
    monkeypatch.setenv("TMPDIR", str(short_tmp))
    where = ipc_dir(_config(model_dir, deep))
    short_tmp.rmdir()
    assert where.parent == short_tmp and where.name.startswith("asf-ipc-")
    assert where == ipc_dir(_config(model_dir, deep))  # a restart finds its predecessor's
    assert where != ipc_dir(_config(model_dir, deep, port=8124))
    assert len(str(where / ("0" * 36))) <= 107
