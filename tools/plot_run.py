#!/usr/bin/env python3
# tools/plot_run.py -- draws training runs from their TensorBoard event files (mt::SummaryWriter,
# an example's --logdir) into one PNG: the loss, the loss scale with skipped steps marked, and the
# share of gradient values that are zero (underflowed), over steps, one line per run.
#
# Usage: tools/plot_run.py DIR... [-o OUT.png] [--title TEXT]
# Each DIR is a run (holding events.out.tfevents.* files), or a folder of runs (its subfolders
# that hold event files, as `tensorboard --logdir` reads it). Runs are named by their folder.
# Needs matplotlib (Debian: python3-matplotlib); the event files are read by the small reader
# below, which checks every record's CRC32C, so TensorFlow and tensorboard are not needed.
import argparse
import os
import struct
import sys


def _crc32c_table():
    table = []
    for i in range(256):
        crc = i
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def masked_crc32c(data):
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(data, i):
    value, shift = 0, 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, i


def _fields(message):
    """Yields (field number, value) of a protobuf message: ints for varints, bytes otherwise."""
    i = 0
    while i < len(message):
        key, i = _varint(message, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(message, i)
        elif wire == 1:
            value, i = message[i:i + 8], i + 8
        elif wire == 5:
            value, i = message[i:i + 4], i + 4
        elif wire == 2:
            length, i = _varint(message, i)
            value, i = message[i:i + length], i + length
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield number, value


def read_scalars(path, scalars):
    """Adds the file's (step, value) pairs to scalars[tag]. A truncated last record (a file still
    being written) ends the file; a record whose CRC does not match is an error."""
    with open(path, "rb") as f:
        data = f.read()
    i = 0
    while i + 12 <= len(data):
        header = data[i:i + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", data[i + 8:i + 12])
        if masked_crc32c(header) != length_crc:
            raise ValueError(f"{path}: corrupt record length at byte {i}")
        if i + 16 + length > len(data):
            break
        record = data[i + 12:i + 12 + length]
        (data_crc,) = struct.unpack("<I", data[i + 12 + length:i + 16 + length])
        if masked_crc32c(record) != data_crc:
            raise ValueError(f"{path}: corrupt record at byte {i}")
        i += 16 + length
        step, summary = 0, None
        for number, value in _fields(record):
            if number == 2:
                step = value - (1 << 64) if value >= 1 << 63 else value
            elif number == 5:
                summary = value
        if summary is None:
            continue
        for number, value in _fields(summary):
            if number != 1:
                continue
            tag, simple = None, None
            for n, v in _fields(value):
                if n == 1:
                    tag = v.decode("utf-8")
                elif n == 2:
                    (simple,) = struct.unpack("<f", v)
            if tag is not None and simple is not None:
                scalars.setdefault(tag, []).append((step, simple))


def has_events(folder):
    return any(name.startswith("events.out.tfevents.") for name in os.listdir(folder))


def find_runs(dirs):
    runs = []
    for d in dirs:
        if not os.path.isdir(d):
            sys.exit(f"plot_run: {d} is not a folder")
        if has_events(d):
            runs.append(d)
        else:
            subs = sorted(os.path.join(d, s) for s in os.listdir(d))
            found = [s for s in subs if os.path.isdir(s) and has_events(s)]
            if not found:
                sys.exit(f"plot_run: no event files in {d} or its subfolders")
            runs.extend(found)
    return runs


def load_run(folder):
    scalars = {}
    for name in sorted(os.listdir(folder)):
        if name.startswith("events.out.tfevents."):
            read_scalars(os.path.join(folder, name), scalars)
    # Sorted by step; a later value for the same step (a restarted run) wins, as in TensorBoard.
    return {tag: sorted(dict(points).items()) for tag, points in scalars.items()}


def smoothed(values, weight=0.9):
    out, last = [], None
    for v in values:
        last = v if last is None else weight * last + (1 - weight) * v
        out.append(last)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("dirs", nargs="+", metavar="DIR")
    parser.add_argument("-o", "--output", default="run.png")
    parser.add_argument("--title", default=None)
    args = parser.parse_args()
    try:
        import matplotlib
    except ImportError:
        sys.exit("plot_run: matplotlib is missing (Debian: apt install python3-matplotlib)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(os.path.basename(os.path.normpath(d)), load_run(d)) for d in find_runs(args.dirs)]
    fig, (ax_loss, ax_scale, ax_zero) = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, (name, scalars) in enumerate(runs):
        color = colors[k % len(colors)]
        if "loss" in scalars:
            steps, values = zip(*scalars["loss"])
            # Faint per-step values under an exponential moving average (TensorBoard's smoothing).
            ax_loss.plot(steps, values, color=color, alpha=0.2, linewidth=0.8)
            ax_loss.plot(steps, smoothed(values), color=color, label=name, linewidth=1.4)
        if "loss_scale" in scalars:
            steps, values = zip(*scalars["loss_scale"])
            ax_scale.step(steps, values, where="post", color=color, label=name, linewidth=1.2)
            skipped = dict(scalars.get("skipped", []))
            marks = [(s, v) for s, v in scalars["loss_scale"] if skipped.get(s, 0) > 0]
            if marks:
                ax_scale.scatter(*zip(*marks), marker="x", color=color, s=30, zorder=3,
                                 label=f"{name}: skipped steps ({len(marks)})")
        if "grad_zero_fraction/total" in scalars:
            steps, values = zip(*scalars["grad_zero_fraction/total"])
            ax_zero.plot(steps, [100 * v for v in values], color=color, label=name,
                         marker=".", markersize=3, linewidth=1.2)
    ax_loss.set_ylabel("loss (smoothed; faint: per step)")
    ax_loss.set_yscale("log")
    ax_scale.set_ylabel("loss scale (1: not scaled)")
    ax_scale.set_yscale("log", base=2)
    ax_zero.set_ylabel("gradient values that are zero (%)")
    ax_zero.set_ylim(-2, 102)
    ax_zero.set_xlabel("step")
    for ax in (ax_loss, ax_scale, ax_zero):
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(args.title or ", ".join(name for name, _ in runs))
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(f"plot_run: wrote {args.output} ({len(runs)} runs)")


if __name__ == "__main__":
    main()
