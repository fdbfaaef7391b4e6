from __future__ import annotations

import subprocess
import sys

import pytest

from ascendserve import __version__


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ascendserve", *args], capture_output=True, text=True, timeout=60)


def test_version():
    r = run("version")
    assert r.returncode == 0 and r.stdout.strip() == f"ascendserve {__version__}"


def test_help_lists_every_role():
    r = run("--help")
    assert r.returncode == 0
    for role in ("encoder", "prefill", "decode", "pd", "proxy", "metaserver", "elastic-server", "all"):
        assert f"  {role} " in r.stdout


def test_per_role_help_shows_only_that_roles_flags():
    pd, proxy, decode = run("--role", "pd", "--help"), run("--role", "proxy", "--help"), run("--role", "decode", "--help")
    assert pd.returncode == proxy.returncode == decode.returncode == 0
    assert "--model" in pd.stdout and "--ec-enabled" in pd.stdout and "--kv-connector" not in pd.stdout
    assert "--kv-connector" in decode.stdout and "--ec-enabled" not in decode.stdout
    assert "--model" not in proxy.stdout and "--port" in proxy.stdout
    assert "ASCENDSERVE_PORT" in proxy.stdout


def test_a_seed_without_cluster_token_or_model_exits_2_without_traceback(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    no_token = run("--role", "elastic-server", "--model", str(tmp_path))
    assert no_token.returncode == 2 and "set cluster.token" in no_token.stderr
    no_model = run("--role", "elastic-server", "--cluster-token", "t")
    assert no_model.returncode == 2 and "model" in no_model.stderr
    for r in (no_token, no_model):
        assert "Traceback" not in r.stderr


def test_control_plane_help_imports_no_torch_or_vllm():
    code = (
        "import sys\n"
        "from ascendserve.cli import main\n"
        "try:\n    main(['--role', 'proxy', '--help'])\nexcept SystemExit:\n    pass\n"
        "bad = [m for m in ('torch', 'vllm', 'transformers') if m in sys.modules]\n"
        "print('HEAVY', bad)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "HEAVY []" in r.stdout, r.stdout + r.stderr
