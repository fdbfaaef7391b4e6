"""packaging/: the systemd units and install.sh, checked without root or a running systemd.

The units are verified with `systemd-analyze verify` (Debian package: systemd)
as instances for several names; install.sh installs a fake release into a
temp root (--root), which skips useradd, chown and systemctl.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
UNITS = REPO / "packaging" / "systemd"
TEMPLATE = UNITS / "ascendserve@.service"
INSTALL_SH = REPO / "packaging" / "install.sh"
BINARY = "/opt/ascendserve/current/bin/ascendserve"
INSTANCES = ["proxy", "decode-1", "encoder", "pd", "metaserver", "all"]

needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                   reason="systemd-analyze missing (Debian package: systemd)")


def _directives(text: str) -> dict[str, list[str]]:
    """Key -> values of a unit file, comments and section headers dropped."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def _instantiate(tmp_path: Path, names: list[str], text: str | None = None) -> list[Path]:
    """Copies of the template as ascendserve@NAME.service (and the target) in tmp_path,
    ExecStart pointed at a stub under tmp_path: verify insists the binary exists."""
    stub = tmp_path / "root" / BINARY.lstrip("/")
    stub.parent.mkdir(parents=True, exist_ok=True)
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    text = (TEMPLATE.read_text() if text is None else text).replace(BINARY, str(stub))
    units = []
    for name in names:
        unit = tmp_path / f"ascendserve@{name}.service"
        unit.write_text(text)
        units.append(unit)
    shutil.copy(UNITS / "ascendserve.target", tmp_path / "ascendserve.target")
    return units + [tmp_path / "ascendserve.target"]


def _analyze(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """systemd-analyze in the user scope, its runtime dir and HOME in tmp_path. In the
    system scope, as root, it would touch /run/systemd/systemd-units-load; the unit
    file parser and the checks used here are the same in both scopes."""
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path / "xdg-run"), "HOME": str(tmp_path / "home")}
    for d in ("xdg-run", "home"):
        (tmp_path / d).mkdir(mode=0o700, exist_ok=True)
    return subprocess.run(["systemd-analyze", "--user", *args], capture_output=True, text=True,
                          timeout=60, env=env)


def _verify(units: list[Path]) -> tuple[int, list[str]]:
    """Exit status and the lines about our units: verify only warns (exit 0) on an
    unknown key or a value it cannot parse, so both count."""
    done = _analyze(units[0].parent, "verify", "--man=no", *map(str, units))
    ours = [line for line in (done.stdout + done.stderr).splitlines() if "ascendserve" in line]
    return done.returncode, ours


@needs_analyze
def test_units_verify_for_several_instances(tmp_path):
    code, complaints = _verify(_instantiate(tmp_path, INSTANCES))
    assert code == 0 and complaints == []


@needs_analyze
@pytest.mark.parametrize("good, bad", [
    ("KillMode=control-group", "KillMode=control-groups"),  # bad value: a warning, exit 0
    ("ProtectSystem=strict", "ProtectSytem=strict"),         # unknown key: a warning, exit 0
    (r"ExecStart=/\S+", "ExecStart=opt/ascendserve"),       # not an absolute path: exit 1
])
def test_verify_catches_a_broken_unit(tmp_path, good, bad):
    text, n = re.subn(rf"^{good}", bad, TEMPLATE.read_text(), count=1, flags=re.MULTILINE)
    assert n == 1
    code, complaints = _verify(_instantiate(tmp_path, ["proxy"], text))
    assert code != 0 or complaints


@needs_analyze
def test_hardening_exposure_stays_low(tmp_path):
    (unit, *_) = _instantiate(tmp_path, ["proxy"])
    done = _analyze(tmp_path, "security", "--offline=yes", "--man=no", str(unit))
    level = re.search(r"Overall exposure level for \S+: ([\d.]+)", done.stdout)
    assert level, done.stdout[-2000:] + done.stderr[-2000:]
    assert float(level.group(1)) <= 4.0, done.stdout


def test_unit_keeps_what_serving_needs():
    d = _directives(TEMPLATE.read_text())
    # things that would break accelerators, /dev/shm sharing, JIT or sockets
    for key in ("PrivateDevices", "DevicePolicy", "DeviceAllow", "ProtectClock", "MemoryDenyWriteExecute",
                "RestrictAddressFamilies", "ProcSubset", "PrivateNetwork", "DynamicUser"):
        assert key not in d, key
    assert d["RemoveIPC"] == ["no"]  # the host's EC region outlives any one instance
    assert d["KillMode"] == ["control-group"] and d["LimitMEMLOCK"] == ["infinity"]
    assert d["User"] == ["ascendserve"] and d["ProtectSystem"] == ["strict"]
    assert d["ExecStart"] == [f"{BINARY} --config ${{ASCENDSERVE_CONFIG}}"]
    assert d["Environment"][0] == "ASCENDSERVE_CONFIG=/etc/ascendserve/%i.toml"
    assert d["EnvironmentFile"] == ["-/etc/ascendserve/common.env", "-/etc/ascendserve/%i.env"]
    assert "2" in d["RestartPreventExitStatus"][0].split()  # config errors (exit 2) do not loop


def test_shipped_configs_name_their_role():
    """`systemctl start ascendserve@<name>` with conf/<name>.toml runs role <name>: the
    role comes from the file, not the instance name."""
    for conf in sorted((REPO / "conf").glob("*.toml")):
        assert tomllib.loads(conf.read_text())["role"] == conf.stem, conf


# --- install.sh ------------------------------------------------------------

def _release(tmp_path: Path, version: str, marker: str = "") -> Path:
    """A fake unpacked tarball, as build.sh lays it out (the real one is tested elsewhere)."""
    tree = tmp_path / f"ascendserve-{version}-cpu-x86_64"
    (tree / "bin" / "_internal").mkdir(parents=True)
    binary = tree / "bin" / "ascendserve"
    binary.write_text(f"#!/bin/sh\necho ascendserve {version}\n")
    binary.chmod(0o755)
    (tree / "bin" / "_internal" / "lib.txt").write_text(marker or version)
    shutil.copytree(REPO / "conf", tree / "conf")
    shutil.copytree(UNITS, tree / "systemd")
    shutil.copy(INSTALL_SH, tree / "install.sh")
    (tree / "README.md").write_text("readme\n")
    (tree / "BUILD_INFO").write_text(f"version={version}\ndevice=cpu\n")
    return _seal(tree)


def _seal(tree: Path) -> Path:
    """(Re)write SHA256SUMS as build.sh does: every file but itself."""
    files = sorted(str(p.relative_to(tree)) for p in tree.rglob("*") if p.is_file() and p.name != "SHA256SUMS")
    sums = subprocess.run(["sha256sum", *files], cwd=tree, capture_output=True, text=True, check=True).stdout
    (tree / "SHA256SUMS").write_text(sums)
    return tree


def _install(tree: Path, root: Path, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "DESTDIR"}
    done = subprocess.run(["bash", str(tree / "install.sh"), "--root", str(root), *args],
                          capture_output=True, text=True, timeout=120, env=env)
    assert (done.returncode == 0) == ok, done.stdout + done.stderr
    return done


def test_fresh_install_layout(tmp_path):
    root = tmp_path / "root"
    out = _install(_release(tmp_path, "1.0.0"), root).stdout
    assert "skipping user creation, chown and systemctl" in out
    opt = root / "opt" / "ascendserve"
    assert (opt / "current").is_symlink() and os.readlink(opt / "current") == "1.0.0"
    assert os.access(opt / "current" / "bin" / "ascendserve", os.X_OK)
    assert (opt / "1.0.0" / "bin" / "_internal" / "lib.txt").is_file()
    for conf in (REPO / "conf").glob("*.toml"):
        assert (root / "etc" / "ascendserve" / conf.name).read_text() == conf.read_text()
    units = root / "etc" / "systemd" / "system"
    assert (units / "ascendserve@.service").read_text() == TEMPLATE.read_text()
    assert (units / "ascendserve.target").is_file()
    assert sorted(p.name for p in opt.iterdir()) == ["1.0.0", "current"]  # no staging leftovers


def test_reinstall_is_idempotent(tmp_path):
    root, tree = tmp_path / "root", _release(tmp_path, "1.0.0")
    _install(tree, root)
    out = _install(tree, root).stdout
    assert "already installed and unchanged" in out
    assert not list((root / "etc" / "ascendserve").glob("*.new"))


def test_edited_config_survives_and_new_default_lands_beside(tmp_path):
    root = tmp_path / "root"
    _install(_release(tmp_path / "a", "1.0.0"), root)
    proxy = root / "etc" / "ascendserve" / "proxy.toml"
    edited = proxy.read_text().replace("port = 8000", "port = 9000")
    proxy.write_text(edited)
    v2 = _release(tmp_path / "b", "1.1.0")
    (v2 / "conf" / "metaserver.toml").write_text((v2 / "conf" / "metaserver.toml").read_text() + "# new\n")
    (v2 / "conf" / "proxy.toml").write_text((v2 / "conf" / "proxy.toml").read_text() + "# new\n")
    _install(_seal(v2), root)
    assert proxy.read_text() == edited
    assert (root / "etc" / "ascendserve" / "proxy.toml.new").read_text().endswith("# new\n")
    # an unedited config follows the new default, no .new
    assert (root / "etc" / "ascendserve" / "metaserver.toml").read_text().endswith("# new\n")
    assert not (root / "etc" / "ascendserve" / "metaserver.toml.new").exists()


def test_second_version_switches_current_and_keeps_first(tmp_path):
    root = tmp_path / "root"
    _install(_release(tmp_path / "a", "1.0.0"), root)
    _install(_release(tmp_path / "b", "1.1.0"), root)
    opt = root / "opt" / "ascendserve"
    assert os.readlink(opt / "current") == "1.1.0"
    assert (opt / "1.0.0" / "bin" / "ascendserve").is_file()
    # rollback through the installed copy of install.sh
    subprocess.run(["bash", str(opt / "current" / "install.sh"), "--root", str(root), "--switch", "1.0.0"],
                   check=True, capture_output=True, timeout=60)
    assert os.readlink(opt / "current") == "1.0.0"
    done = subprocess.run(["bash", str(opt / "current" / "install.sh"), "--root", str(root), "--switch", "9.9"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "not an installed version" in done.stderr


def test_damaged_release_is_refused(tmp_path):
    root, tree = tmp_path / "root", _release(tmp_path, "1.0.0")
    (tree / "bin" / "_internal" / "lib.txt").write_text("tampered")
    out = _install(tree, root, ok=False)
    assert "SHA256SUMS" in out.stderr
    assert not (root / "opt" / "ascendserve" / "current").exists()


def test_uninstall_keeps_etc(tmp_path):
    root = tmp_path / "root"
    _install(_release(tmp_path, "1.0.0"), root)
    units = root / "etc" / "systemd" / "system"
    wants = units / "multi-user.target.wants"
    wants.mkdir()
    (wants / "ascendserve@proxy.service").symlink_to("/etc/systemd/system/ascendserve@.service")
    (root / "etc" / "ascendserve" / "proxy.env").write_text("ASCENDSERVE_PORT=9000\n")
    subprocess.run(["bash", str(root / "opt" / "ascendserve" / "current" / "install.sh"),
                    "--root", str(root), "--uninstall"], check=True, capture_output=True, timeout=60)
    assert not (root / "opt" / "ascendserve").exists()
    assert not (units / "ascendserve@.service").exists() and not (units / "ascendserve.target").exists()
    assert not (wants / "ascendserve@proxy.service").is_symlink()
    assert (root / "etc" / "ascendserve" / "proxy.toml").is_file()
    assert (root / "etc" / "ascendserve" / "proxy.env").read_text() == "ASCENDSERVE_PORT=9000\n"


# --- the frozen entry point and the build cache key ---------------------------

def _load(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_packaging_{name}", REPO / "packaging" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_entry_tells_python_command_lines_from_ours(tmp_path):
    command = _load("entry")._python_command
    script = tmp_path / "__main__.py"
    script.write_text("")
    assert command(["-m", "vllm.model_executor.models.registry"]) == ("-m", "vllm.model_executor.models.registry", [])
    assert command(["-B", "-S", "-I", "-c", "print(1)", "x"]) == ("-c", "print(1)", ["x"])
    assert command(["-W", "ignore", "-m", "m", "--a"]) == ("-m", "m", ["--a"])
    # inductor's compile-worker pool: sys.executable .../compile_worker/__main__.py --workers=2 ...
    assert command([str(script), "--workers=2"]) == ("script", str(script), ["--workers=2"])
    for ours in (["--role", "pd"], ["version"], ["model", "tiny", "--out", "x.py"], [], [str(tmp_path / "no.py")]):
        assert command(ours) is None, ours


def _repo(tmp_path: Path, body: str) -> Path:
    for pkg in ("ascendserve", "roles"):
        (tmp_path / pkg).mkdir(exist_ok=True)
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "ascendserve" / "mod.py").write_text(body)
    return tmp_path


def test_build_key_follows_imports_not_our_code(tmp_path):
    key = _load("build_key")

    def imports(body: str) -> list[str]:
        return key.external_imports(_repo(tmp_path, body))

    base = imports("import json\nfrom ascendserve import cli\nfrom . import x\n\ndef f():\n    return 1\n")
    assert base == ["json"]  # ours and relative imports are not dependencies
    assert imports("import json\n\ndef f():\n    return 2  # edited\n") == base
    assert imports("import json\n\ndef f():\n    import csv\n") == ["csv", "json"]  # function-level too
    # a submodule named in `from X import Y` is one (PyInstaller follows it); a function is not
    assert imports("from json import decoder, loads\n") == ["json", "json.decoder"]


def test_build_key_ignores_ascendserve_itself_and_is_stable(tmp_path):
    # the key names PyInstaller's version: build.sh installs it (CI builds before the suite)
    pytest.importorskip("PyInstaller", reason="PyInstaller not installed yet: ./build.sh installs it")
    key = _load("build_key")
    repo = _repo(tmp_path, "import json\n")
    assert not any(d.startswith("ascendserve==") for d in key.distributions())
    first = key.inputs(repo, "1", "0.1.0", "cpu")
    assert key.inputs(repo, "1", "0.1.0", "cpu") == first
    assert key.inputs(repo, "2", "0.1.0", "cpu") != first  # the bundle format is in the key
    (repo / "ascendserve" / "mod.py").write_text("import json\nX = 1\n")
    assert key.inputs(repo, "1", "0.1.0", "cpu") == first


# --- package data ----------------------------------------------------------

def test_every_file_the_package_ships_beside_its_code_is_package_data():
    """A wheel carries only .py files and what [tool.setuptools.package-data] names: the
    dashboard's page, script and style must be among them (the tarball copies every file of
    ascendserve/, build.sh). A new asset outside the globs fails here."""
    import fnmatch

    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    tracked = subprocess.run(["git", "ls-files", "ascendserve", "roles"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split()
    assets = [f for f in tracked if not f.endswith(".py")]
    assert "ascendserve/dashboard/static/dashboard.js" in assets
    for path in assets:
        covered = any(path.startswith(package.replace(".", "/") + "/")
                      and fnmatch.fnmatch(path[len(package) + 1:], pattern)
                      for package, patterns in data.items() for pattern in patterns)
        assert covered, f"{path} is not package data (pyproject.toml [tool.setuptools.package-data])"
