"""Isolation that must not silently degrade: interpreters reached through symlinks under /tmp stay fully
isolated, and a sandbox that cannot isolate refuses to run (fail closed) unless told otherwise.

Needs root on Linux with namespaces (as the attack corpus); elsewhere the module is skipped with the reason.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from verl_mas.sandbox import PROTECTIONS, LocalSandbox, SandboxConfig, SandboxError

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or os.geteuid() != 0,
    reason="isolation tests need root on Linux (namespaces, unprivileged uids); CI runs them as root")

REAL_PYTHON = os.path.realpath(sys.executable)


@pytest.fixture(scope="module")
def work_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sandbox_staging")


@pytest.fixture
def in_tmp() -> Iterator[Path]:
    """A fresh directory directly under /tmp (whatever pytest's basetemp is), removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix="verl_mas_interp_", dir="/tmp"))
    yield root
    shutil.rmtree(root)


@pytest.fixture
def host_targets() -> Iterator[tuple[Path, Path]]:
    """(a world-writable host directory, a root-only 0600 file), both outside /tmp."""
    base = Path(f"/var/tmp/verl_mas_isolation_{uuid.uuid4().hex}")
    base.mkdir(mode=0o755)
    writable = base / "writable"
    writable.mkdir()
    writable.chmod(0o777)  # permissions alone would let any uid write here; the read-only mount must not
    secret = base / "secret"
    secret.write_text("root only")
    secret.chmod(0o600)
    assert secret.read_text() == "root only"  # positive control: the host (root) reads it
    yield writable, secret
    shutil.rmtree(base)


def _venv_through_a_symlink(root: Path) -> Path:
    """A real virtual environment at root/y/.venv, reached as root/x/.venv -> ../y/.venv (a CI clone's shape)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "y" / ".venv")], check=True)
    (root / "x").mkdir()
    (root / "x" / ".venv").symlink_to("../y/.venv")
    return root / "x" / ".venv" / "bin" / "python"


def _symlink_chain(root: Path) -> Path:
    """root/a/bin/python -> root/b/python -> the real interpreter (outside /tmp)."""
    (root / "a" / "bin").mkdir(parents=True)
    (root / "b").mkdir()
    (root / "b" / "python").symlink_to(REAL_PYTHON)
    (root / "a" / "bin" / "python").symlink_to(root / "b" / "python")
    return root / "a" / "bin" / "python"


@pytest.mark.parametrize("make_python", [_venv_through_a_symlink, _symlink_chain], ids=["venv", "chain"])
async def test_interpreter_through_symlinks_under_tmp_is_fully_isolated(
        make_python: Callable[[Path], Path], in_tmp, host_targets, work_root, procs_of):
    writable, secret = host_targets
    python = make_python(in_tmp)
    assert os.path.realpath(python) == REAL_PYTHON  # it really is a symlinked interpreter
    host_file = in_tmp / "pwned"
    program = f"""
import os, sys
print(os.getuid())
print(sys.executable)
for path in ({str(writable / "pwned")!r}, {str(host_file)!r}):
    try:
        open(path, "w").write("pwned")
        print("WROTE", path)
    except OSError as exc:
        print("denied", exc.errno)
try:
    print("READ", open({str(secret)!r}).read())
except OSError as exc:
    print("denied", exc.errno)
"""
    # Default config: isolation required (fail closed), so an unisolated fallback would raise here.
    box = LocalSandbox(SandboxConfig(python=str(python), pool_size=1, work_root=str(work_root)))
    try:
        r = await box.run_python(program)
        assert r.ok, r.stderr
        assert r.isolation == dict.fromkeys(PROTECTIONS, True)
        uid, executable, *rest = r.stdout.splitlines()
        assert int(uid) in box.uids and executable == str(python)
        # EROFS (30): /var/tmp is on the read-only root. EACCES (13): the run's /tmp is private, and the
        # directory bound back for the interpreter is root's, 0755. EACCES: the secret is root's, 0600.
        assert rest == ["denied 30", "denied 13", "denied 13"]
        assert os.listdir(writable) == [] and not host_file.exists()
        assert procs_of(box.uids) == []
    finally:
        box.close()


def _uid_refusing_python(directory: Path) -> Path:
    """An interpreter that exits 1 unless it runs as root: under the sandbox's unprivileged uid it cannot
    start, which the fork server's start-up probe detects (a protection the machine cannot give it)."""
    wrapper = directory / "python"
    wrapper.write_text(f"#!{REAL_PYTHON} -I\n"
                       "import os, sys\n"
                       "if os.getuid() != 0:\n"
                       "    sys.exit('this interpreter refuses to run as an unprivileged uid')\n"
                       f"os.execv({REAL_PYTHON!r}, [{REAL_PYTHON!r}, *sys.argv[1:]])\n")
    wrapper.chmod(0o755)
    return wrapper


@pytest.fixture
def refusing_python() -> Iterator[Path]:
    directory = Path(f"/var/tmp/verl_mas_interp_{uuid.uuid4().hex}")
    directory.mkdir(mode=0o755)
    yield _uid_refusing_python(directory)
    shutil.rmtree(directory)


async def test_default_refuses_to_run_when_a_protection_is_missing(refusing_python, work_root, caplog):
    box = LocalSandbox(SandboxConfig(python=str(refusing_python), pool_size=1, work_root=str(work_root)))
    try:
        with pytest.raises(SandboxError) as info:
            await box.run_python("print('ran')")
        text = str(info.value)
        assert "UNAVAILABLE" in text and "unprivileged_uid" in text  # what
        assert "refuses to run model-written code" in text  # why
        assert "require_isolation: false" in text and "isolation: none" in text  # how to allow it explicitly
        assert box.zygote_pid is None  # torn down: nothing runs
    finally:
        box.close()
    # The explicit opt-out runs with what the machine allows, says so in every result, and warns once.
    box = LocalSandbox(SandboxConfig(python=str(refusing_python), pool_size=1, work_root=str(work_root),
                                     require_isolation=False))
    try:
        with caplog.at_level(logging.WARNING, logger="verl_mas.sandbox.local"):
            r = await box.run_python("import os\nprint(os.getuid())\n")
        assert r.ok and r.stdout == "0\n"
        assert r.missing_isolation == ("unprivileged_uid",)
        assert [rec.levelno for rec in caplog.records if "UNAVAILABLE" in rec.getMessage()] == [logging.WARNING]
    finally:
        box.close()
