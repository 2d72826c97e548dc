"""A stored results folder and its archive: python -m bench results unpack|pack|table FOLDER.

Each folder under bench/results/ keeps in git its README.md (the question, the command, the machine,
versions and load, the table) and small summaries; its raw per-run files (each run's metrics.jsonl
and config.toml, the full race.json, logs) live in one archive beside them, raw.tar.xz, whose files
unpack under FOLDER/raw/ (ignored by git).

  unpack  FOLDER/raw.tar.xz -> FOLDER/raw/
  pack    FOLDER/raw/ -> FOLDER/raw.tar.xz: sorted names, mtime 0, owner root, mode 644, xz -9e, so
          packing what was unpacked gives the same bytes
  table   the README's table re-made from the archive by the report code that writes it (bench race's
          race_report, bench soak's), printed
"""

from __future__ import annotations

import io
import json
import lzma
import sys
import tarfile
from pathlib import Path, PurePosixPath

from fastpt.errors import ArgumentParser, FastptError, fail

ARCHIVE = "raw.tar.xz"
RAW = "raw"
TABLE_BEGIN = "<!-- table: python -m bench results table FOLDER re-makes it from raw.tar.xz -->"
TABLE_END = "<!-- end of table -->"


def pack(folder: Path) -> Path:
    """Every file under folder/raw/ into folder/raw.tar.xz, byte for byte the same on every packing."""
    raw = folder / RAW
    files = sorted(p for p in raw.rglob("*") if p.is_file()) if raw.is_dir() else []
    if not files:
        raise FastptError(f"{raw}: no files to pack")
    tar_bytes = io.BytesIO()
    with tarfile.open(fileobj=tar_bytes, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for path in files:
            data = path.read_bytes()
            info = tarfile.TarInfo(path.relative_to(raw).as_posix())
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            tar.addfile(info, io.BytesIO(data))
    archive = folder / ARCHIVE
    archive.write_bytes(lzma.compress(tar_bytes.getvalue(), preset=9 | lzma.PRESET_EXTREME))
    return archive


def members(folder: Path) -> dict[str, bytes]:
    """The archive's files, name -> bytes, read in memory (nothing written)."""
    archive = folder / ARCHIVE
    if not archive.is_file():
        raise FastptError(f"{archive}: no such archive (a results folder holds its raw files in {ARCHIVE})")
    out = {}
    with tarfile.open(archive, mode="r:xz") as tar:
        for member in tar.getmembers():
            name = PurePosixPath(member.name)
            if not member.isfile() or name.is_absolute() or ".." in name.parts:
                raise FastptError(f"{archive}: {member.name!r} is not a plain file inside the folder")
            out[member.name] = tar.extractfile(member).read()
    return out


def unpack(folder: Path) -> Path:
    """folder/raw.tar.xz's files written under folder/raw/ (an existing file there is replaced)."""
    raw = folder / RAW
    for name, data in members(folder).items():
        (raw / name).parent.mkdir(parents=True, exist_ok=True)
        (raw / name).write_bytes(data)
    return raw


def current_race(result: dict) -> dict | None:
    """A stored race.json in the form race_report reads today (a race before --baseline compared every
    recipe with the seed, as vs_seed), or None for a race before per-budget rows, which it cannot read."""
    corpora = result.get("corpora", {}).values()
    if "info" not in result or not all("budgets" in row for r in corpora for row in r["rows"]):
        return None
    for r in corpora:
        r.setdefault("baseline", "seed")
        for row in r["rows"]:
            if "vs_seed" in row:
                row["vs_baseline"] = row.pop("vs_seed")
    return result


def table(folder: Path) -> str:
    """The folder's table, re-made from its archive: each race.json's summary (a race in a subfolder
    under its name), or the soak's table."""
    from bench import race_report, soak  # they load torch: unpack and pack do without it

    files = members(folder)
    parts = []
    for name in sorted(n for n in files if PurePosixPath(n).name in ("race.json", "soak.json")):
        result = json.loads(files[name])
        if name.endswith("soak.json"):
            parts.append(soak.to_markdown(result) + "\n")
            continue
        if (race := current_race(result)) is None:
            raise FastptError(f"{folder / ARCHIVE}: {name} is older than bench race's report; its table is race.md")
        parent = PurePosixPath(name).parent
        parts.append((f"### Race `{parent}/`\n\n" if parent.name else "") + race_report.summary(race))
    if not parts:
        raise FastptError(f"{folder / ARCHIVE}: no race.json or soak.json to make a table from")
    return "\n".join(parts)


def readme_table(folder: Path) -> str:
    """The table the folder's README.md holds between its table markers."""
    readme = folder / "README.md"
    text = readme.read_text() if readme.is_file() else ""
    if TABLE_BEGIN not in text or TABLE_END not in text:
        raise FastptError(f"{readme}: no re-made table (the lines {TABLE_BEGIN!r} ... {TABLE_END!r})")
    return text.split(TABLE_BEGIN, 1)[1].split(TABLE_END, 1)[0].strip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m bench results", description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["unpack", "pack", "table"])
    ap.add_argument("folder", type=Path, help="a folder under bench/results/")
    try:
        args = ap.parse_args(sys.argv[1:] if argv is None else argv)
        if not args.folder.is_dir():
            raise FastptError(f"{args.folder}: no such folder")
        if args.action == "table":
            print(table(args.folder), end="")
        else:
            print({"unpack": unpack, "pack": pack}[args.action](args.folder))
    except FastptError as e:
        fail(str(e))
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
