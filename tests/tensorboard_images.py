#!/usr/bin/env python3
# tests/tensorboard_images.py -- checks the images mixtape's SummaryWriter.add_image and
# add_images wrote into LOGDIR, read back by TensorBoard's EventAccumulator, against
# torch.utils.tensorboard's own image summary of the same tensors clipped to [0, 1] (saved by the
# test in IMAGES, a safetensors file whose metadata gives each tensor's dataformats): the same
# height, width and channel count, and the same pixels once both PNGs are decoded (PIL).
# Usage: tensorboard_images.py LOGDIR IMAGES (a Python with torch, tensorboard and PIL)
import io
import json
import sys
import warnings

import numpy as np
from PIL import Image
from safetensors import safe_open
from tensorboard.backend.event_processing import event_accumulator
from torch.utils.tensorboard import summary


def pixels(png):
    return np.asarray(Image.open(io.BytesIO(png)))


def rgba_grid(tag, images, dataformats):
    """torch 1.13's make_grid takes 1 or 3 channels (later versions 4 too): a batch of RGBA images
    as its rule tiles them, up to 8 columns row by row, the empty cells zero, each cell torch's
    own image summary of that image."""
    if dataformats == 'NHWC':
        images = images.permute(0, 3, 1, 2)
    count, _, height, width = images.shape
    columns = min(count, 8)
    rows = (count + columns - 1) // columns
    canvas = np.zeros((rows * height, columns * width, 4), dtype=np.uint8)
    for n in range(count):
        cell = pixels(summary.image(tag, images[n], dataformats='CHW').value[0].image
                      .encoded_image_string)
        y, x = n // columns * height, n % columns * width
        canvas[y:y + height, x:x + width] = cell
    return canvas


def main():
    # NaN cast to a byte, in torch's own summary (as 0, as mixtape writes it).
    warnings.filterwarnings('ignore', 'invalid value encountered in cast')
    logdir, images = sys.argv[1:3]
    acc = event_accumulator.EventAccumulator(logdir, size_guidance={event_accumulator.IMAGES: 0})
    acc.Reload()
    with safe_open(images, framework='pt') as f:
        formats = json.loads(f.metadata()['dataformats'])
        assert sorted(acc.Tags()['images']) == sorted(formats), (acc.Tags()['images'], formats)
        for tag, dataformats in formats.items():
            events = acc.Images(tag)
            assert len(events) == 1 and events[0].step == 3, (tag, events)
            ours = events[0]
            # torch 1.13 casts x * 255 to bytes unclipped (values past [0, 1] wrap around);
            # later versions clip it to [0, 255], as mixtape does, which clamping first equals.
            image = f.get_tensor(tag).float().clamp(0, 1)
            got = pixels(ours.encoded_image_string)
            if dataformats.startswith('N') and image.shape[dataformats.index('C')] == 4:
                want = rgba_grid(tag, image, dataformats)
            else:
                theirs = summary.image(tag, image, dataformats=dataformats).value[0].image
                assert (ours.height, ours.width) == (theirs.height, theirs.width), tag
                assert theirs.colorspace == got.shape[2], (tag, theirs.colorspace, got.shape)
                want = pixels(theirs.encoded_image_string)
            assert got.shape == want.shape, (tag, got.shape, want.shape)
            assert np.array_equal(got, want), (tag, got, want)
    print('ok: %d images as torch makes them' % len(formats))


if __name__ == '__main__':
    main()
