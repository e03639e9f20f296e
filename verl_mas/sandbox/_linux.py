"""Linux system calls the sandbox needs that Python 3.10/3.11 lacks (ctypes), and small fd/file helpers.

Stdlib only: imported by the fork server, which runs as a script with ``python -I -S``.
"""

from __future__ import annotations

import array
import ctypes
import os
import socket
import stat

__all__ = ["CLONE_NEWIPC", "CLONE_NEWNET", "CLONE_NEWNS", "CLONE_NEWPID", "CLONE_NEWUSER", "CLONE_NEWUTS",
           "MS_BIND", "MS_NODEV", "MS_NOEXEC", "MS_NOSUID", "MS_PRIVATE", "MS_REC", "PR_SET_NO_NEW_PRIVS",
           "PR_SET_PDEATHSIG", "capture", "copy_tree", "make_readonly", "mount", "prctl", "read_all",
           "recv_with_fds", "setns", "unshare"]

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SYS_MOUNT_SETATTR = 442  # same number on every architecture (added in Linux 5.12)
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x1, 0x2

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _raise_errno(what: str) -> None:
    err = ctypes.get_errno()
    raise OSError(err, f"{what}: {os.strerror(err)}")


def unshare(flags: int) -> None:
    """unshare(2): move this process into new namespaces (``CLONE_NEWPID``: its next child's)."""
    if _libc.unshare(ctypes.c_int(flags)) != 0:
        _raise_errno(f"unshare({flags:#x})")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    """mount(2)."""
    if _libc.mount(_enc(source), _enc(target), _enc(fstype), ctypes.c_ulong(flags), _enc(data)) != 0:
        _raise_errno(f"mount({source!r} -> {target!r}, {fstype!r})")


def _enc(text: str | None) -> bytes | None:
    return None if text is None else text.encode()


def setns(fd: int, nstype: int) -> None:
    """setns(2): join the namespace open as ``fd``."""
    if _libc.setns(ctypes.c_int(fd), ctypes.c_int(nstype)) != 0:
        _raise_errno(f"setns({nstype:#x})")


def prctl(option: int, arg: int) -> None:
    """prctl(2) with one argument."""
    if _libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0),
                   ctypes.c_ulong(0)) != 0:
        _raise_errno(f"prctl({option})")


def make_readonly(path: str, recursive: bool) -> None:
    """Mark the mount at ``path`` (and, if ``recursive``, every mount below it) read-only and nosuid."""
    attr = _MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0)
    ret = _libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), path.encode(),
                        ctypes.c_uint(AT_RECURSIVE if recursive else 0), ctypes.byref(attr),
                        ctypes.c_size_t(ctypes.sizeof(attr)))
    if ret == 0:
        return
    if ctypes.get_errno() != 38:  # anything but ENOSYS is a real failure
        _raise_errno(f"mount_setattr({path!r}, RDONLY)")
    # Kernel < 5.12: remount each mount read-only, keeping its nodev/noexec (locked flags must be kept).
    targets = [path]
    if recursive:
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            points = [_unescape(line.split()[4]) for line in f]
        targets = [p for p in points if p == path or p.startswith(path.rstrip("/") + "/")]
    for target in sorted(set(targets), key=len):
        st = os.statvfs(target)
        keep = st.f_flag & (MS_NODEV | MS_NOEXEC)
        mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | keep)


def _unescape(field: str) -> str:
    """Decode the octal escapes (``\\040`` for space) of /proc/self/mountinfo."""
    return field.encode().decode("unicode_escape")


def capture(argv: list[str]) -> bytes:
    """Stdout of ``argv`` (which must exit 0). Not ``subprocess``: importing it pulls in ``threading``, whose
    at-fork hooks double the cost of every fork this server makes."""
    r, w = os.pipe()
    try:
        pid = os.posix_spawn(argv[0], argv, {"PATH": "/usr/bin:/bin"},
                             file_actions=[(os.POSIX_SPAWN_DUP2, w, 1), (os.POSIX_SPAWN_CLOSE, r)])
    finally:
        os.close(w)
    try:
        out = read_all(r)
    finally:
        os.close(r)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        raise RuntimeError(f"{argv[0]} failed (wait status {status}) while probing its paths")
    return out


def recv_with_fds(sock: socket.socket) -> tuple[bytes, list[int]]:
    """One message and the descriptors sent with it, without blocking. (``socket.recv_fds`` ignores its
    ``flags`` argument on Python <= 3.11, so it would block here.)"""
    fds = array.array("i")
    data, ancdata, _, _ = sock.recvmsg(1 << 20, socket.CMSG_SPACE(8 * fds.itemsize), socket.MSG_DONTWAIT)
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return data, list(fds)


def read_all(fd: int) -> bytes:
    """Read ``fd`` to EOF (blocking)."""
    chunks: list[bytes] = []
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def copy_tree(src_fd: int, dst: str, uid: int | None) -> None:
    """Copy the staging directory (open as ``src_fd``) into ``dst``, owned by ``uid``."""
    for name in os.listdir(src_fd):
        st = os.stat(name, dir_fd=src_fd, follow_symlinks=False)
        target = os.path.join(dst, name)
        if stat.S_ISDIR(st.st_mode):
            os.mkdir(target, 0o755)
            sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=src_fd)
            copy_tree(sub, target, uid)
            os.close(sub)
        elif stat.S_ISREG(st.st_mode):
            src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=src_fd)
            out = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            while os.sendfile(out, src, None, 1 << 20):
                pass
            os.close(src)
            os.close(out)
        else:
            continue  # the host writes only files and directories
        if uid is not None:
            os.lchown(target, uid, uid)
