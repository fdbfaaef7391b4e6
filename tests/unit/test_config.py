"""Config: precedence, and one test per class of bad input (exit 2 + message)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ascendserve.config import REDACTED, ConfigError, load, redacted


@pytest.fixture()
def model_dir(tmp_path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


def write(tmp_path: Path, text: str) -> str:
    p = tmp_path / "conf.toml"
    p.write_text(text)
    return str(p)


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-m", "ascendserve", *args],
        capture_output=True, text=True, timeout=60,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("ASCENDSERVE_")}, **(env or {})},
    )


def test_precedence_defaults_file_env_flags(tmp_path, model_dir):
    f = write(tmp_path, f'[server]\nport = 9001\nhost = "0.0.0.0"\n[model]\npath = "{model_dir}"\n[log]\nlevel = "debug"\n')
    c = load("pd", f, {}, env={})
    assert (c.server.port, c.server.host, c.log.level) == (9001, "0.0.0.0", "debug")
    c = load("pd", f, {}, env={"ASCENDSERVE_PORT": "9002"})
    assert (c.server.port, c.server.host) == (9002, "0.0.0.0")
    c = load("pd", f, {"server__port": "9003"}, env={"ASCENDSERVE_PORT": "9002"})
    assert c.server.port == 9003
    c = load("pd", None, {"model__path": str(model_dir)}, env={})
    assert (c.server.port, c.server.host, c.log.level) == (8000, "127.0.0.1", "info")
    assert c.instance_id.startswith("pd-") and c.kv.path and c.ec.path


def test_role_from_env_and_file(tmp_path, model_dir):
    f = write(tmp_path, f'role = "decode"\n[model]\npath = "{model_dir}"\n')
    assert load(None, f, {}, env={}).role == "decode"
    assert load(None, f, {}, env={"ASCENDSERVE_ROLE": "prefill"}).role == "prefill"


def test_vllm_args_from_file_and_flags_accumulate(tmp_path, model_dir):
    f = write(tmp_path, f'[model]\npath = "{model_dir}"\n[engine]\nvllm_args = ["--seed=1"]\n[engine.vllm]\nmax-num-batched-tokens = 512\n')
    c = load("pd", f, {"engine__vllm_args": ["--enable-chunked-prefill"]}, env={})
    assert c.engine.vllm_args == ["--seed=1", "--enable-chunked-prefill"]
    assert c.engine.vllm == {"max-num-batched-tokens": 512}


def test_unknown_key(tmp_path, model_dir):
    f = write(tmp_path, f'[server]\nprot = 1\n[model]\npath = "{model_dir}"\n')
    r = cli("--role", "pd", "--config", f)
    assert r.returncode == 2
    assert "unknown key 'server.prot'" in r.stderr and "allowed keys in [server]: header_timeout_s, host, max_connections" in r.stderr


def test_unknown_top_level_key(tmp_path):
    r = cli("--role", "pd", "--config", write(tmp_path, "sever = 1\n"))
    assert r.returncode == 2 and "unknown key 'sever'" in r.stderr and "server" in r.stderr


def test_wrong_type(tmp_path, model_dir):
    f = write(tmp_path, f'[server]\nport = "eighty"\n[model]\npath = "{model_dir}"\n')
    r = cli("--role", "pd", "--config", f)
    assert r.returncode == 2
    assert "server.port = 'eighty'" in r.stderr and "Expected `int`" in r.stderr and "allowed: int" in r.stderr


def test_wrong_type_in_file_is_strict(tmp_path, model_dir):
    # A TOML string is not silently turned into a number.
    with pytest.raises(ConfigError, match="server.port = '8080'"):
        load("pd", write(tmp_path, f'[server]\nport = "8080"\n[model]\npath = "{model_dir}"\n'), {}, env={})


def test_wrong_choice(model_dir):
    r = cli("--role", "pd", "--model", str(model_dir), "--log-level", "loud")
    assert r.returncode == 2
    assert "log.level = 'loud'" in r.stderr and "'debug', 'info', 'warning', 'error'" in r.stderr


@pytest.mark.parametrize("port", ["0", "65536", "-1"])
def test_port_out_of_range_flag(model_dir, port):
    r = cli("--role", "pd", "--model", str(model_dir), f"--port={port}")
    assert r.returncode == 2
    assert f"server.port = '{port}' (from --port)" in r.stderr and "allowed: int >= 1 and <= 65535" in r.stderr


def test_port_out_of_range_env(model_dir):
    r = cli("--role", "pd", "--model", str(model_dir), env={"ASCENDSERVE_PORT": "70000"})
    assert r.returncode == 2 and "from $ASCENDSERVE_PORT" in r.stderr and "<= 65535" in r.stderr


def test_port_out_of_range_file(tmp_path, model_dir):
    r = cli("--role", "pd", "--config", write(tmp_path, f'[server]\nport = 70000\n[model]\npath = "{model_dir}"\n'))
    assert r.returncode == 2 and "server.port = 70000" in r.stderr and "<= 65535" in r.stderr


def test_missing_model_path(tmp_path):
    missing = tmp_path / "nope"
    r = cli("--role", "pd", "--model", str(missing))
    assert r.returncode == 2
    assert f"model.path = '{missing}' does not exist" in r.stderr


def test_model_dir_without_config(tmp_path):
    r = cli("--role", "decode", "--model", str(tmp_path))
    assert r.returncode == 2 and "has no config.json" in r.stderr


def test_model_required_for_engine_roles():
    r = cli("--role", "encoder")
    assert r.returncode == 2 and "model.path is required" in r.stderr


def test_bad_toml_syntax(tmp_path):
    r = cli("--role", "pd", "--config", write(tmp_path, "[server\nport = 1\n"))
    assert r.returncode == 2 and "is not valid TOML" in r.stderr


def test_missing_config_file(tmp_path):
    r = cli("--role", "pd", "--config", str(tmp_path / "absent.toml"))
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_unknown_role():
    r = cli("--role", "router")
    assert r.returncode == 2 and "invalid choice: 'router'" in r.stderr


def test_no_role():
    r = cli()
    assert r.returncode == 2 and "no role given" in r.stderr


def test_role_owned_vllm_argument_refused(model_dir):
    r = cli("--role", "decode", "--model", str(model_dir), "--vllm-arg=--kv-transfer-config={}")
    assert r.returncode == 2
    assert "--kv-transfer-config is set by ascendserve" in r.stderr and "[kv]" in r.stderr


def test_secrets_redacted(model_dir):
    c = load("pd", None, {"model__path": str(model_dir), "cluster__token": "s3cret",
                          "engine__vllm_args": ["--api-key", "k3y", "--seed=1"]}, env={})
    shown = redacted(c)
    assert shown["cluster"]["token"] == REDACTED
    assert shown["engine"]["vllm_args"] == ["--api-key", REDACTED, "--seed=1"]
    assert "s3cret" not in repr(shown) and "k3y" not in repr(shown)


def test_shipped_configs_are_valid(model_dir):
    conf = Path(__file__).resolve().parents[2] / "conf"
    files = sorted(conf.glob("*.toml"))
    assert {f.stem for f in files} >= {"encoder", "prefill", "decode", "pd", "proxy", "metaserver", "elastic-server", "all"}
    for f in files:
        # the files ship no secret; a NetLoader seed (elastic-server) refuses to start without one
        c = load(None, str(f), {"model__path": str(model_dir)}, env={"ASCENDSERVE_CLUSTER_TOKEN": "t"})
        assert c.role == f.stem, f


def test_netloader_settings(model_dir):
    c = load("decode", None, {"model__path": str(model_dir), "server__port": "9000",
                              "netloader__sources": ["10.0.0.1:9600", "10.0.0.2:9600"]}, env={})
    assert c.netloader.port == 11000 and c.netloader.fallback == "disk" and not c.netloader.serve
    with pytest.raises(ConfigError, match="set cluster.token"):
        load("pd", None, {"model__path": str(model_dir), "netloader__serve": True}, env={})
    with pytest.raises(ConfigError, match="needs|metaserver"):
        load("pd", None, {"model__path": str(model_dir), "netloader__sources": ["auto"]}, env={})
    with pytest.raises(ConfigError, match="netloader.sources"):
        load("pd", None, {"model__path": str(model_dir), "netloader__sources": ["nohost"]}, env={})
    with pytest.raises(ConfigError, match="encoder role loads its weights from disk"):
        load("encoder", None, {"model__path": str(model_dir), "netloader__sources": ["h:1"]}, env={})
    with pytest.raises(ConfigError, match="fallback"):
        load("pd", None, {"model__path": str(model_dir), "netloader__fallback": "maybe"}, env={})


def test_vllm_ascend_proxy_flags_expand():
    c = load("proxy", None, {"proxy__prefiller_hosts": ["10.0.0.1", "10.0.0.2"], "proxy__prefiller_ports": ["9000", "9000"],
                             "proxy__prefiller_hosts_num": ["2", "2"], "proxy__prefiller_ports_inc": ["2", "2"],
                             "proxy__decoder_hosts": ["10.0.0.3"], "proxy__decoder_ports": ["9100"]}, env={})
    assert c.proxy.prefill == ["http://10.0.0.1:9000", "http://10.0.0.1:9001", "http://10.0.0.2:9000",
                               "http://10.0.0.2:9001"]
    assert c.proxy.decode == ["http://10.0.0.3:9100"]


def test_proxy_flag_lists_from_env():
    c = load("proxy", None, {}, env={"ASCENDSERVE_PD": "127.0.0.1:8001,127.0.0.1:8002"})
    assert c.proxy.pd == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]


@pytest.mark.parametrize("flags,needle", [
    ({"proxy__decoder_hosts": ["a", "b"], "proxy__decoder_ports": ["1"]}, "2 decoder hosts but 1 decoder ports"),
    ({"proxy__decoder_hosts": ["a"], "proxy__decoder_ports": ["1"], "proxy__decoder_hosts_num": ["1", "2"]},
     "--decoder-hosts-num has 2 values for 1"),
    ({"proxy__decoder_hosts": ["a"], "proxy__decoder_ports": ["65535"], "proxy__decoder_ports_inc": ["2"]},
     "expands to 65536"),
    ({"proxy__pd": ["nohostport"]}, "proxy.pd: 'nohostport' is invalid"),
    ({"proxy__mode": "push"}, "needs cluster.metaserver_url"),
    ({"cluster__metaserver_url": "http://0.0.0.0:8500"}, "wildcard address"),
    ({"proxy__max_retries": "-1"}, "proxy.max_retries = '-1'"),
])
def test_bad_proxy_config(flags, needle):
    with pytest.raises(ConfigError) as info:
        load("proxy", None, flags, env={})
    assert needle in str(info.value)


def test_example_deployment_configs_give_the_seed_layout(model_dir):
    """conf/examples/deepseek-8node: P DP2·TP8·EP16 per node, D DP64·TP1·EP64 over 4 nodes."""
    from ascendserve.launch.dp import parser, resolve

    example = Path(__file__).resolve().parents[2] / "conf" / "examples" / "deepseek-8node"
    env = {"ASCENDSERVE_CLUSTER_TOKEN": "t"}
    layouts = {}
    for f in sorted(example.glob("*.toml")):
        c = load(None, str(f), {"model__path": str(model_dir)}, env=env)
        assert c.role == f.stem
        if c.is_engine:
            args, _ = parser().parse_known_args(["--role", c.role])
            resolve(args, c)
            layouts[c.role] = (args.dp_size, args.dp_size_local, args.tp_size, c.engine.enable_expert_parallel)
    assert layouts == {"prefill": (2, 2, 8, True), "decode": (64, 16, 1, True)}
    third = load("decode", str(example / "decode.toml"), {"model__path": str(model_dir)},
                 env={**env, "ASCENDSERVE_DATA_PARALLEL_RANK_START": "32"})
    assert third.engine.data_parallel_rank_start == 32


def test_the_removed_text_affinity_keys_are_refused_with_the_reason(tmp_path):
    from ascendserve.config import ConfigError, load

    f = tmp_path / "proxy.toml"
    f.write_text("[proxy]\nprefix_aware = true\n")
    with pytest.raises(ConfigError, match=r"proxy.prefix_aware .* was removed: .*routing = 'kv'"):
        load("proxy", str(f), {}, env={})
