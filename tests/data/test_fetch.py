"""fetch() without the network: urlopen is replaced by fakes."""
import dataclasses
import hashlib
import io
import urllib.error
import urllib.request
import zipfile

import pytest

from gr_functional.data import DataError
from gr_functional.data import fetch as fetch_module
from gr_functional.data.fetch import fetch


def _zip_payload() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        # Made-up rows in the ratings.dat format (not MovieLens data).
        z.writestr("ml-1m/ratings.dat", "1::10::5::100\n1::20::4::200\n")
        z.writestr("ml-1m/movies.dat", "10::A (2000)::Drama\n20::B (2001)::Comedy\n")
        z.writestr("ml-1m/../evil.dat", "must not be written outside the target folder")
        z.writestr("other/ignored.dat", "not under the archive's ml-1m/ folder")
    return buf.getvalue()


def _serve(monkeypatch, payload: bytes):
    calls = []

    def fake_urlopen(url, timeout=None):
        calls.append(url)
        return io.BytesIO(payload)

    monkeypatch.setattr(urllib.request, "urlopen", fake_urlopen)
    return calls


def test_offline_is_a_clear_error(tmp_path, monkeypatch):
    def offline(url, timeout=None):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(DataError) as exc:
        fetch("ml-1m", tmp_path)
    msg = str(exc.value)
    assert msg.startswith("could not reach files.grouplens.org: [Errno -3]")
    assert "download https://files.grouplens.org/datasets/movielens/ml-1m.zip by hand" in msg
    assert str(tmp_path / "movielens-1m" / "ratings.dat") in msg and "GRF_DATA_DIR" in msg
    assert not (tmp_path / "movielens-1m").exists()  # no partial download or empty folder left behind


def test_connection_dropped_mid_download(tmp_path, monkeypatch):
    class Dropping(io.BytesIO):
        def read(self, n=-1):
            raise ConnectionResetError(104, "Connection reset by peer")

    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout=None: Dropping(b""))
    with pytest.raises(DataError, match="could not reach files.grouplens.org: .*Connection reset"):
        fetch("ml-1m", tmp_path)
    assert not (tmp_path / "movielens-1m").exists()


def test_http_error(tmp_path, monkeypatch):
    def not_found(url, timeout=None):
        raise urllib.error.HTTPError(url, 404, "Not Found", {}, None)

    monkeypatch.setattr(urllib.request, "urlopen", not_found)
    with pytest.raises(DataError, match="answered HTTP 404"):
        fetch("ml-20m", tmp_path)


def test_checksum_mismatch_deletes_download(tmp_path, monkeypatch):
    _serve(monkeypatch, _zip_payload())
    with pytest.raises(DataError) as exc:
        fetch("ml-1m", tmp_path)
    msg = str(exc.value)
    assert "checksum mismatch" in msg and "c4d9eecfca2ab87c1945afe126590906" in msg
    assert hashlib.md5(_zip_payload()).hexdigest() in msg
    assert not (tmp_path / "movielens-1m").exists()


def test_verified_download_is_unzipped_flat(tmp_path, monkeypatch):
    payload = _zip_payload()
    calls = _serve(monkeypatch, payload)
    src = fetch_module.SOURCES["ml-1m"]
    monkeypatch.setitem(fetch_module.SOURCES, "ml-1m",
                        dataclasses.replace(src, md5=hashlib.md5(payload).hexdigest()))
    path = fetch("ml-1m", tmp_path)
    assert path == tmp_path / "movielens-1m" / "ratings.dat"
    assert path.read_text() == "1::10::5::100\n1::20::4::200\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["movies.dat", "ratings.dat"]
    assert not (tmp_path / "evil.dat").exists()
    assert calls == [src.url]
    # Already there: no second download unless force=True.
    assert fetch("ml-1m", tmp_path) == path and len(calls) == 1
    fetch("ml-1m", tmp_path, force=True)
    assert len(calls) == 2


def test_data_dir_default(tmp_path, monkeypatch):
    payload = _zip_payload()
    _serve(monkeypatch, payload)
    monkeypatch.setitem(fetch_module.SOURCES, "ml-1m",
                        dataclasses.replace(fetch_module.SOURCES["ml-1m"], md5=hashlib.md5(payload).hexdigest()))
    monkeypatch.setenv("GRF_DATA_DIR", str(tmp_path))
    assert fetch("ml-1m") == tmp_path / "movielens-1m" / "ratings.dat"


def test_unknown_dataset(tmp_path):
    with pytest.raises(DataError, match="fetchable datasets are ml-1m, ml-20m"):
        fetch("kuairand", tmp_path)


def test_published_checksums_are_pinned():
    # GroupLens' ml-1m.zip.md5 / ml-20m.zip.md5 sidecars; guard against accidental edits.
    assert fetch_module.SOURCES["ml-1m"].md5 == "c4d9eecfca2ab87c1945afe126590906"
    assert fetch_module.SOURCES["ml-20m"].md5 == "cd245b17a1ae2cc31bb14903e1204af3"
