#!/usr/bin/env python3
# tests/tensorboard_roundtrip.py -- reads a mixtape SummaryWriter folder with TensorBoard's own
# EventAccumulator and checks every scalar (tag, step, f32 bits) against a list of expectations,
# and the histogram and texts the test wrote;
# tools/plot_run.py's own small reader must read the same scalars.
# Usage: tensorboard_roundtrip.py LOGDIR EXPECTED (lines "tag step f32-bits")
import os
import struct
import sys

from tensorboard.backend.event_processing import event_accumulator


def main():
    logdir, expected_path = sys.argv[1:3]
    expected = []
    with open(expected_path) as f:
        for line in f:
            tag, step, bits = line.split()
            expected.append((tag, int(step), int(bits)))
    acc = event_accumulator.EventAccumulator(
        logdir, size_guidance={event_accumulator.SCALARS: 0, event_accumulator.HISTOGRAMS: 0,
                               event_accumulator.TENSORS: 0})
    acc.Reload()
    got = []
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            got.append((tag, event.step, struct.unpack("<I", struct.pack("<f", event.value))[0]))
    if sorted(got) != sorted(expected):
        print("missing:", sorted(set(expected) - set(got)))
        print("unexpected:", sorted(set(got) - set(expected)))
        return 1
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
    import plot_run
    own = []
    for tag, points in plot_run.load_run(logdir).items():
        own += [(tag, step, struct.unpack("<I", struct.pack("<f", v))[0]) for step, v in points]
    if sorted(own) != sorted(expected):
        print("plot_run's reader disagrees:", sorted(set(own) ^ set(expected)))
        return 1
    histograms = acc.Histograms("weights")
    h = histograms[0].histogram_value
    if (len(histograms), histograms[0].step, h.num, h.sum, h.min, h.max, sum(h.bucket)) != (
            1, 5, 4.0, 2.0, -1.0, 2.0, 4.0):
        print("histogram:", histograms)
        return 1
    # add_text: torch's layout, a string tensor of one element under "<tag>/text_summary" that
    # the text plugin claims.
    from tensorboard.util import tensor_util
    texts = [(e.step, tensor_util.make_ndarray(e.tensor_proto).tolist())
             for e in acc.Tensors("notes/text_summary")]
    if texts != [(3, ["lr 3e-4, **bf16** \u00e9t\u00e9".encode()]), (4, [b""])]:
        print("texts:", texts)
        return 1
    if list(acc.PluginTagToContent("text")) != ["notes/text_summary"]:
        print("text plugin tags:", acc.PluginTagToContent("text"))
        return 1
    print(f"tensorboard (and plot_run.py) read {len(got)} scalars, the histogram and the texts "
          "back exactly")
    return 0


if __name__ == "__main__":
    sys.exit(main())
