"""fetch() without the network: urlopen is replaced by fakes, or reads a local file:// URL."""
import dataclasses
import hashlib
import io
import tarfile
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest

from gr_functional.data import DataError, dataset_label, dataset_path
from gr_functional.data import fetch as fetch_module
from gr_functional.data.fetch import fetch
from gr_functional.data.sources.kuairand_features import load_kuairand_features


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


# --- KuaiRand releases (tar.gz) and the 27K length table (single file, sha256) ---------------------

# Made-up rows in the official schemas (not KuaiRand data).
_LOG = ("user_id,video_id,date,hourmin,time_ms,is_click,is_like,is_follow,is_comment,is_forward,is_hate,long_view,"
        "play_time_ms,duration_ms,profile_stay_time,comment_stay_time,is_profile_enter,is_rand,tab\n"
        "0,5,20220422,1000,1650592800000,1,0,0,0,0,0,1,9000,10000,0,0,0,0,1\n")
_USERS = "user_id,user_active_degree,follow_user_num\n0,high_active,5\n1,UNKNOWN,0\n"
_VIDEOS = "video_id,author_id,tag\n5,7,\"20,43\"\n"
_PURE = {"log_standard_4_22_to_5_08_pure.csv": _LOG, "log_standard_4_08_to_4_21_pure.csv": _LOG,
         "log_random_4_22_to_5_08_pure.csv": _LOG, "user_features_pure.csv": _USERS,
         "video_features_basic_pure.csv": _VIDEOS, "video_features_statistic_pure.csv": "video_id\n5\n"}


def _tar(members, top: str = "KuaiRand-Pure") -> bytes:
    """A tar.gz of ``members``: (name, text) regular files, or TarInfo objects added as they are."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for dirname in (top, f"{top}/data"):
            info = tarfile.TarInfo(dirname)
            info.type = tarfile.DIRTYPE
            t.addfile(info)
        for m in members:
            if isinstance(m, tarfile.TarInfo):
                t.addfile(m)
            else:
                data = m[1].encode()
                info = tarfile.TarInfo(m[0])
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _pure_payload(prefix: str = "") -> bytes:
    files = [(f"{prefix}KuaiRand-Pure/data/{name}", text) for name, text in _PURE.items()]
    return _tar([*files, (f"{prefix}KuaiRand-Pure/load_data_pure.py", "print('not under data/')\n")])


def _as_file_url(monkeypatch, tmp_path, name: str, payload: bytes, fetch_name: str, **digest) -> Path:
    """Serve ``payload`` from a local file:// URL in place of ``fetch_name``'s download (the real
    urlopen reads it), with the given checksum; returns the file."""
    served = tmp_path / "served" / name
    served.parent.mkdir()
    served.write_bytes(payload)
    src = fetch_module.FILE_DOWNLOADS[fetch_name]
    monkeypatch.setitem(fetch_module.FILE_DOWNLOADS, fetch_name,
                        dataclasses.replace(src, url=served.as_uri(), **digest))
    return served


@pytest.mark.parametrize("prefix", ["", "./"])
def test_kuairand_pure_tarball_lands_where_the_registry_looks(tmp_path, monkeypatch, prefix):
    payload = _pure_payload(prefix)
    _as_file_url(monkeypatch, tmp_path, "KuaiRand-Pure.tar.gz", payload, "kuairand-pure",
                 md5=hashlib.md5(payload).hexdigest())
    data = tmp_path / "data"
    monkeypatch.setenv("GRF_DATA_DIR", str(data))
    assert not data.exists()
    path = fetch_module.fetch("kuairand-pure")
    folder = data / "kuairand" / "KuaiRand-Pure" / "data"
    assert path == folder / "log_standard_4_22_to_5_08_pure.csv" and path.read_text() == _LOG
    assert sorted(p.name for p in folder.iterdir()) == sorted(_PURE)  # no load_data_pure.py, no .part, no archive
    assert dataset_path("kuairand-user-features") == folder / "user_features_pure.csv"
    assert dataset_path("kuairand-video-features") == folder / "video_features_basic_pure.csv"
    assert dataset_path("kuairand-pure-log") == path
    assert list(load_kuairand_features(kind="user").ids) == [0, 1]
    # The team's partial copy, when present, is still found first.
    partial = folder / "log_standard_pure_20220425_to_20220504.partial.csv"
    partial.write_text(_LOG)
    assert dataset_path("kuairand-pure-log") == partial


def test_kuairand_1k_official_log_comes_after_the_sample(tmp_path, monkeypatch):
    payload = _tar([("KuaiRand-1K/data/log_random_4_22_to_5_08_1k.csv", _LOG),
                    ("KuaiRand-1K/data/user_features_1k.csv", _USERS)], top="KuaiRand-1K")
    _as_file_url(monkeypatch, tmp_path, "KuaiRand-1K.tar.gz", payload, "kuairand-1k",
                 md5=hashlib.md5(payload).hexdigest())
    monkeypatch.setenv("GRF_DATA_DIR", str(tmp_path / "data"))
    path = fetch_module.fetch("kuairand-1k")
    assert path == tmp_path / "data/kuairand/KuaiRand-1K/data/log_random_4_22_to_5_08_1k.csv"
    assert dataset_path("kuairand") == path
    assert dataset_label("kuairand", path) == "KuaiRand (log_random_4_22_to_5_08_1k.csv)"
    assert dataset_path("kuairand-user-features").name == "user_features_1k.csv"  # no Pure file here
    sample = path.with_name("log_random_4_22_to_5_08_1k.head_users0-3.csv")
    sample.write_text(_LOG)
    assert dataset_path("kuairand") == sample


def test_kuairand_bad_checksum_deletes_the_download(tmp_path, monkeypatch):
    payload = _pure_payload()
    calls = _serve(monkeypatch, payload)
    with pytest.raises(DataError) as exc:
        fetch_module.fetch("kuairand-pure", tmp_path)
    msg = str(exc.value)
    assert calls == ["https://zenodo.org/records/10439422/files/KuaiRand-Pure.tar.gz"]
    assert f"checksum mismatch for {calls[0]}: md5 {hashlib.md5(payload).hexdigest()}" in msg
    assert "the KuaiRand authors publishes 0820331067a3784d9691136f772b35a7" in msg
    assert "unpack it (tar -xzf) so that" in msg and str(tmp_path / "kuairand/KuaiRand-Pure/data") in msg
    assert not (tmp_path / "kuairand").exists()  # no archive, no empty folders left behind


def test_hostile_tar_members_are_refused(tmp_path, monkeypatch):
    outside = tmp_path / "outside"
    members = [("KuaiRand-Pure/data/log_standard_4_22_to_5_08_pure.csv", _LOG),
               ("../x.csv", "escapes upward"),
               ("KuaiRand-Pure/data/../../../y.csv", "escapes through the prefix"),
               (str(outside / "abs.csv"), "absolute path")]
    link = tarfile.TarInfo("KuaiRand-Pure/data/user_features_pure.csv")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    hard = tarfile.TarInfo("KuaiRand-Pure/data/video_features_basic_pure.csv")
    hard.type, hard.linkname = tarfile.LNKTYPE, "KuaiRand-Pure/data/log_standard_4_22_to_5_08_pure.csv"
    fifo = tarfile.TarInfo("KuaiRand-Pure/data/fifo.csv")
    fifo.type = tarfile.FIFOTYPE
    payload = _tar([*members, link, hard, fifo])
    _serve(monkeypatch, payload)
    src = fetch_module.FILE_DOWNLOADS["kuairand-pure"]
    monkeypatch.setitem(fetch_module.FILE_DOWNLOADS, "kuairand-pure",
                        dataclasses.replace(src, md5=hashlib.md5(payload).hexdigest()))
    root = tmp_path / "data"
    path = fetch_module.fetch("kuairand-pure", root)
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file() or p.is_symlink())
    assert written == [str(path.relative_to(tmp_path))]  # only the plain file under the prefix
    assert not outside.exists()


def test_a_corrupt_tarball_is_a_data_error(tmp_path, monkeypatch):
    payload = _pure_payload()[:200]  # truncated, but it is what the checksum was taken of
    _serve(monkeypatch, payload)
    src = fetch_module.FILE_DOWNLOADS["kuairand-pure"]
    monkeypatch.setitem(fetch_module.FILE_DOWNLOADS, "kuairand-pure",
                        dataclasses.replace(src, md5=hashlib.md5(payload).hexdigest()))
    with pytest.raises(DataError, match="the download is not a valid tar.gz archive"):
        fetch_module.fetch("kuairand-pure", tmp_path)
    assert not (tmp_path / "kuairand").exists()


_LENGTHS = "\ufeffexposures,clicks,ctr\n10015,4505.0,0.44982526210683976\n18945,6116.0,0.3228292425442069\n".encode()


def test_27k_lengths_single_file_sha256(tmp_path, monkeypatch):
    _as_file_url(monkeypatch, tmp_path, "log_standard_user_stats_distribution.csv", _LENGTHS, "kuairand-27k-lengths",
                 sha256=hashlib.sha256(_LENGTHS).hexdigest())
    monkeypatch.setenv("GRF_DATA_DIR", str(tmp_path / "data"))
    path = fetch_module.fetch("kuairand-27k-lengths")
    assert path == dataset_path("kuairand-27k-lengths")
    assert path == tmp_path / "data/kuairand/stats_kuairand27k_third_party/log_standard_user_stats_distribution.csv"
    assert path.read_bytes() == _LENGTHS  # byte for byte, BOM included
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


def test_27k_lengths_bad_sha256(tmp_path, monkeypatch):
    _serve(monkeypatch, _LENGTHS)
    with pytest.raises(DataError) as exc:
        fetch_module.fetch("kuairand-27k-lengths", tmp_path)
    msg = str(exc.value)
    assert f"sha256 {hashlib.sha256(_LENGTHS).hexdigest()}, but the pinned value is " \
           "f9532007fb904d8f23c1e9228b6be9ecd469f331af40b84200502697d7e5b066" in msg
    assert "check `sha256sum` prints f953" in msg and "and save it as" in msg
    assert not (tmp_path / "kuairand").exists()


def test_kuairand_downloads_are_pinned_and_listed():
    pure, k1, lengths = (fetch_module.FILE_DOWNLOADS[n]
                         for n in ("kuairand-pure", "kuairand-1k", "kuairand-27k-lengths"))
    # The KuaiRand README's wget lines (github.com/chongminggao/KuaiRand); guard against accidental edits.
    assert (pure.url, pure.md5, pure.kind) == ("https://zenodo.org/records/10439422/files/KuaiRand-Pure.tar.gz",
                                               "0820331067a3784d9691136f772b35a7", "tar.gz")
    assert (k1.url, k1.md5, k1.kind) == ("https://zenodo.org/records/10439422/files/KuaiRand-1K.tar.gz",
                                         "6b0b9c8222d67fcd4c676218edca3f1f", "tar.gz")
    assert lengths.url == ("https://raw.githubusercontent.com/limings02/kuairand/"
                           "e49bef71584f09252b45fb54b4716e8c7c1f8459/"
                           "EDA/kuairand_report/tables/log_standard_user_stats_distribution.csv")
    assert (lengths.kind, lengths.md5, lengths.checksum) == (
        "file", "", ("sha256", "f9532007fb904d8f23c1e9228b6be9ecd469f331af40b84200502697d7e5b066"))
    assert fetch_module.fetchable() == ("ml-1m", "ml-20m", "kuairand-pure", "kuairand-1k", "kuairand-27k-lengths")
    lines = dict(line.split(": ", 1) for line in fetch_module.listing())
    assert "about 47 MB from zenodo.org; CC BY-SA 4.0" in lines["kuairand-pure"]
    assert "about 1.1 GB from zenodo.org" in lines["kuairand-1k"]
    assert "no licence" in lines["kuairand-27k-lengths"]
    with pytest.raises(DataError, match=r"other downloads: kuairand-pure, kuairand-1k, kuairand-27k-lengths"):
        fetch("kuairand")


def test_download_needs_one_checksum_and_a_known_kind():
    from gr_functional.data import Download

    with pytest.raises(ValueError, match="exactly one checksum"):
        Download("https://example.invalid/a.csv", "", "f", "", "a.csv", 1, kind="file")
    with pytest.raises(ValueError, match="kind must be one of zip, tar.gz, file"):
        Download("https://example.invalid/a.rar", "0" * 32, "f", "", "a.csv", 1, kind="rar")
