"""Opening SQLite through a driver that can load sqlite-vec."""

from __future__ import annotations

from pathlib import Path

from proxy.store.sqlite import db


def test_driver_loads_sqlite_vec(tmp_path: Path) -> None:
    drv = db.driver()
    assert drv.name in db.DRIVER_ORDER
    conn = db.connect(tmp_path / "x.db")
    try:
        (version,) = conn.execute("SELECT vec_version()").fetchone()
        assert str(version).startswith("v")
        assert db.has_fts5(conn)
        try:
            conn.execute("SELECT * FROM no_such_table")
        except drv.OperationalError as exc:  # the driver's own exception classes
            assert "no_such_table" in str(exc)
        else:
            raise AssertionError("expected an OperationalError")
    finally:
        conn.close()


def test_readonly_connection_cannot_write(tmp_path: Path) -> None:
    path = tmp_path / "ro.db"
    rw = db.connect(path)
    rw.execute("CREATE TABLE t (x)")
    ro = db.connect(path, readonly=True)
    try:
        try:
            ro.execute("INSERT INTO t VALUES (1)")
        except db.driver().OperationalError:
            pass
        else:
            raise AssertionError("a readonly connection wrote")
        assert ro.execute("SELECT count(*) FROM t").fetchone() == (0,)
    finally:
        ro.close()
        rw.close()


def test_describe(tmp_path: Path) -> None:
    info = db.database_info(tmp_path / "d.db")
    assert info.driver == db.driver().name
    assert info.fts5 is True
    assert info.vec_version is not None and info.vec_version.startswith("v")
    assert tuple(int(p) for p in info.sqlite_version.split(".")[:2]) >= (3, 38)
    assert info.journal_mode == "wal"
