"""The table ``launch.compile`` prints: per-device HBM, FLOPs, bytes, roofline time and MFU bound per program."""

from __future__ import annotations

from launch.compile_measure import Row
from runtime import aot


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def peak_bytes(row: Row, resident: float) -> float:
    """A program's peak per device: the resident state next to its own arguments, outputs and temporaries."""
    return resident + row.memory.total


def fits(rows: list[Row], resident: float, tpu: aot.Slice) -> bool:
    """Whether every program fits in one device's HBM next to the resident state."""
    return all(peak_bytes(row, resident) <= tpu.device_hbm for row in rows)


def iteration_seconds(rows: list[Row], tpu: aot.Slice) -> tuple[float, float]:
    """``(roofline seconds, MFU bound)`` of one iteration: every program at its roofline, as often as it runs."""
    seconds = sum(row.count * aot.roofline(row.flops, row.bytes_accessed, tpu)[0] for row in rows)
    flops = sum(row.count * row.flops for row in rows)
    return seconds, (flops / tpu.device_peak_flops / seconds if seconds else 0.0)


def report(rows: list[Row], resident: float, tpu: aot.Slice) -> str:
    """The table (markdown) of the measured programs."""
    lines = [f"resident state (train states, frozen and reference parameters): {_gb(resident)} GB per device",
             "| program | runs/iter | args GB | temps GB | peak GB | % HBM | fits | TFLOP | HBM GB read+written "
             "| roofline ms | MFU bound |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        peak = peak_bytes(row, resident)
        seconds, mfu = aot.roofline(row.flops, row.bytes_accessed, tpu)
        lines.append(f"| {row.name} | {row.count} | {_gb(row.memory.arguments)} | {_gb(row.memory.temporaries)} "
                     f"| {_gb(peak)} | {100 * peak / tpu.device_hbm:.0f} | {'yes' if peak <= tpu.device_hbm else 'NO'} "
                     f"| {row.flops / 1e12:.2f} | {_gb(row.bytes_accessed)} | {1e3 * seconds:.1f} | {100 * mfu:.0f} % |")
    if any(row.flops for row in rows):
        seconds, mfu = iteration_seconds(rows, tpu)
        lines.append(f"roofline time of one iteration (sum of runs/iter x roofline): {seconds:.2f} s, "
                     f"MFU bound {100 * mfu:.0f} %")
    return "\n".join(lines)


def peaks(tpu: aot.Slice) -> str:
    """The slice and the chip's peak figures with their source."""
    c = tpu.chip
    per = f", {tpu.devices_per_chip} devices (TensorCores) per chip" if tpu.devices_per_chip > 1 else ""
    return (f"{tpu.name}: {tpu.chips} chips on {tpu.hosts} host(s){per}; {c.name} peaks per chip: "
            f"{c.peak_flops / 1e12:.0f} TFLOP/s bf16, {c.hbm_bytes / 1e9:.1f} GB HBM at {c.hbm_bandwidth / 1e9:.0f} GB/s "
            f"(source: {c.source})")
