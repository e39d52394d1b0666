"""Recorded ``launch.compile`` results (``--record FILE``) and the README grid made from them.

Each run appends one entry (the command, date, host, versions, slice, every program's HBM and cost,
whether it fits, the wall time); a rerun of the same command replaces its entry.

    python -m launch.compile_record docs/tpu_compile_results.json   # the README grid, from the records
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import sys
from pathlib import Path

import jax

from launch.compile_measure import Row
from launch.compile_report import fits, iteration_seconds, peak_bytes
from runtime import aot


def entry(argv: list[str], subject: str, rows: list[Row], resident: float, tpu: aot.Slice, seconds: float,
          compiled: int) -> dict:
    """One run's record."""
    return dict(
        command="python -m launch.compile " + " ".join(argv), subject=subject, topology=tpu.name,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        host=f"{platform.machine()} {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end",
        versions=dict(jax=jax.__version__, libtpu=importlib.metadata.version("libtpu")),
        chip=dataclasses.asdict(tpu.chip), device_hbm=tpu.device_hbm, devices=len(tpu.devices),
        resident=resident, fits=fits(rows, resident, tpu), wall_seconds=round(seconds), programs_compiled=compiled,
        rows=[dict(name=row.name, count=row.count, flops=row.flops, bytes_accessed=row.bytes_accessed,
                   memory=dataclasses.asdict(row.memory)) for row in rows])


def record(path: Path, new: dict) -> None:
    """Appends ``new`` to the JSON list at ``path``, replacing an entry of the same command."""
    entries = json.loads(path.read_text()) if path.is_file() else []
    entries = [old for old in entries if old["command"] != new["command"]] + [new]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(entries, indent=1) + "\n")


def _tpu(item: dict) -> aot.Slice:
    """A stand-in slice with the recorded chip, for the roofline (one device per chip unless recorded)."""
    chips = item["chip"]["hbm_bytes"] / item["device_hbm"]
    return aot.Slice(item["topology"], aot.Chip(**item["chip"]), tuple(range(item["devices"])),
                     round(item["devices"] / chips), 1)


def _rows(item: dict) -> list[Row]:
    return [Row(r["name"], aot.Measure(**r["memory"]), r["flops"], r["bytes_accessed"], r["count"])
            for r in item["rows"]]


def cell(item: dict) -> str:
    """One grid cell: fits or not, the largest program's peak per device, the iteration's roofline and MFU."""
    tpu, rows = _tpu(item), _rows(item)
    largest = max(rows, key=lambda row: peak_bytes(row, item["resident"]))
    peak = peak_bytes(largest, item["resident"])
    text = (f"**{'fits' if item['fits'] else 'does not fit'}**: resident {item['resident'] / 1e9:.2f}, peak "
            f"{peak / 1e9:.2f} GB ({largest.name}, {100 * peak / tpu.device_hbm:.0f} %)")
    if all(row.flops for row in rows):
        seconds, mfu = iteration_seconds(rows, tpu)
        text += f"; iteration {seconds:.1f} s at the roofline, MFU bound {100 * mfu:.0f} %"
    elif any(row.flops == 0 for row in rows) and item["fits"]:
        text += "; no cost (HBM only)"
    return text + f"; {item['wall_seconds']} s"


def grid(entries: list[dict]) -> str:
    """Markdown: one row per subject, one column per topology; in each cell the latest entry with costs
    (FLOPs of every program), else the latest HBM-only one."""
    topologies = list(dict.fromkeys(item["topology"] for item in entries))
    subjects = list(dict.fromkeys(item["subject"] for item in entries))
    ordered = sorted(entries, key=lambda item: all(row["flops"] for row in item["rows"]))  # stable: costed last
    cells = {(item["subject"], item["topology"]): cell(item) for item in ordered}
    lines = ["| | " + " | ".join(topologies) + " |", "|---" * (len(topologies) + 1) + "|"]
    lines += [f"| {subject} | " + " | ".join(cells.get((subject, t), "not measured") for t in topologies) + " |"
              for subject in subjects]
    lines += ["", "Commands:", "", "```bash"] + [item["command"] for item in entries] + ["```"]
    return "\n".join(lines)


if __name__ == "__main__":
    print(grid(json.loads(Path(sys.argv[1]).read_text())))
