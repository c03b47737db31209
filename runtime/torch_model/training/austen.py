"""The default model's corpus: Jane Austen's six novels, from Debian's r-cran-janeaustenr package.

Source (specs/default-model.md §19.1): the Debian package `r-cran-janeaustenr` (bookworm
main, version 1.0.0-1; the CRAN package janeaustenr by Julia Silge, MIT licence), which ships the
Project Gutenberg texts of the six completed novels (public domain) as an R lazy-load database of
character vectors, one line of the printed text per element. `fetch_deb` gets the package with
`apt-get download` (or takes a .deb given by path); `read_novels` opens it with the standard library
alone (ar, tar and R's serialization, rdata.py); `paragraphs` joins the lines of each paragraph and
drops Gutenberg's `_italic_` marks; `split` keeps the last HELD_OUT share of each novel's paragraphs
apart for evaluation (contiguous, so no held-out sentence has a neighbour in training).
"""

from __future__ import annotations

import hashlib
import io
import re
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

from .rdata import lazy_load_db

PACKAGE = "r-cran-janeaustenr"
DATA_PATH = "usr/lib/R/site-library/janeaustenr/data/Rdata"
NOVELS = ("sensesensibility", "prideprejudice", "mansfieldpark", "emma", "northangerabbey", "persuasion")
HELD_OUT = 0.05  # share of each novel's paragraphs (its last ones) kept for evaluation
# sha256 of r-cran-janeaustenr_1.0.0-1_all.deb, the file the shipped model was trained from: another
# file is used (a later Debian revision may carry the same text) but the build report says so
SHIPPED_SHA256 = "df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95"


class CorpusError(RuntimeError):
    """The corpus could not be fetched or read (the message names the file or the command)."""


@dataclass(frozen=True)
class Corpus:
    """Paragraphs per novel, split into training and held-out text (NOVELS order)."""

    train: tuple[tuple[str, ...], ...]
    held_out: tuple[tuple[str, ...], ...]
    source_sha256: str = ""  # of the package file read

    def train_text(self) -> str:
        return "\n\n".join("\n\n".join(novel) for novel in self.train)

    def held_out_text(self) -> str:
        return "\n\n".join("\n\n".join(novel) for novel in self.held_out)


def fetch_deb(cache_dir: Path, deb: Path | None = None) -> Path:
    """The package file: `deb` when given, else one already in cache_dir, else `apt-get download`."""
    if deb is not None:
        if not deb.is_file():
            raise CorpusError(f"{deb}: no such file")
        return deb
    cache_dir.mkdir(parents=True, exist_ok=True)
    found = sorted(cache_dir.glob(f"{PACKAGE}_*.deb"))
    if found:
        return found[-1]
    if shutil.which("apt-get") is None:
        raise CorpusError(f"apt-get is not on this machine: download the Debian package {PACKAGE} "
                          f"and give it with --corpus-deb")
    done = subprocess.run(["apt-get", "download", PACKAGE], cwd=cache_dir, capture_output=True, text=True,
                          timeout=300, check=False)
    found = sorted(cache_dir.glob(f"{PACKAGE}_*.deb"))
    if done.returncode != 0 or not found:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise CorpusError(f"apt-get download {PACKAGE} failed ({last}); give the .deb with --corpus-deb")
    return found[-1]


def _ar_members(data: bytes, source: str) -> dict[str, bytes]:
    if data[:8] != b"!<arch>\n":
        raise CorpusError(f"{source}: not a Debian package (no ar header)")
    pos, out = 8, {}
    while pos + 60 <= len(data):
        header = data[pos:pos + 60]
        name = header[:16].decode("ascii", errors="replace").strip().rstrip("/")
        size = int(header[48:58].decode("ascii").strip())
        out[name] = data[pos + 60:pos + 60 + size]
        pos += 60 + size + (size % 2)
    return out


def read_novels(deb: Path) -> dict[str, list[str]]:
    """Each novel's lines (NOVELS' names) from the package file."""
    members = _ar_members(deb.read_bytes(), str(deb))
    data_name = next((n for n in members if n.startswith("data.tar")), None)
    if data_name is None:
        raise CorpusError(f"{deb}: no data.tar member")
    files: dict[str, bytes] = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(members[data_name]), mode="r:*") as tar:
            for member in tar.getmembers():
                name = member.name.lstrip("./")
                if name in (f"{DATA_PATH}.rdx", f"{DATA_PATH}.rdb"):
                    extracted = tar.extractfile(member)
                    if extracted is not None:
                        files[name[-3:]] = extracted.read()
    except tarfile.TarError as err:
        raise CorpusError(f"{deb}: {data_name}: {err}") from None
    if set(files) != {"rdx", "rdb"}:
        raise CorpusError(f"{deb}: no {DATA_PATH}.rdx/.rdb in the package")
    variables = lazy_load_db(files["rdx"], files["rdb"], f"{deb}:{DATA_PATH}")
    missing = [n for n in NOVELS if not isinstance(variables.get(n), list)]
    if missing:
        raise CorpusError(f"{deb}: no character vector {', '.join(missing)}")
    return {n: [line or "" for line in variables[n]] for n in NOVELS}


_ITALIC = re.compile(r"_(?=\S)|(?<=\S)_")


def paragraphs(lines: list[str]) -> list[str]:
    """Lines joined into paragraphs (blank lines separate them), whitespace collapsed, `_` marks dropped."""
    out: list[str] = []
    current: list[str] = []
    for line in [*lines, ""]:
        text = line.strip()
        if text:
            current.append(text)
        elif current:
            out.append(" ".join(_ITALIC.sub("", " ".join(current)).split()))
            current = []
    return out


def split(novels: dict[str, list[str]], held_out: float = HELD_OUT) -> Corpus:
    """Training and held-out paragraphs: the last `held_out` share of each novel is held out."""
    train, test = [], []
    for name in NOVELS:
        paras = paragraphs(novels[name])
        cut = len(paras) - max(1, round(len(paras) * held_out))
        train.append(tuple(paras[:cut]))
        test.append(tuple(paras[cut:]))
    return Corpus(tuple(train), tuple(test))


def load_corpus(cache_dir: Path, deb: Path | None = None) -> Corpus:
    """The split corpus (fetching the package into cache_dir when no .deb is given)."""
    path = fetch_deb(cache_dir, deb)
    corpus = split(read_novels(path))
    return Corpus(corpus.train, corpus.held_out, hashlib.sha256(path.read_bytes()).hexdigest())
