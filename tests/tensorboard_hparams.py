#!/usr/bin/env python3
# tests/tensorboard_hparams.py -- checks the runs mixtape's SummaryWriter.add_hparams wrote into
# LOGDIR against the same call of torch.utils.tensorboard's add_hparams, both read back with
# TensorBoard's EventAccumulator and its hparams plugin's protobufs.
# Usage: tensorboard_hparams.py LOGDIR TORCH_LOGDIR (a Python with torch and tensorboard)
import os
import sys

from tensorboard.backend.event_processing import event_accumulator
from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2
from torch.utils.tensorboard import SummaryWriter


def read(run_dir):
    acc = event_accumulator.EventAccumulator(run_dir)
    acc.Reload()
    data = {tag: plugin_data_pb2.HParamsPluginData.FromString(content)
            for tag, content in acc.PluginTagToContent('hparams').items()}
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()['scalars']}
    return data, scalars


def main():
    ours, theirs = sys.argv[1:3]
    writer = SummaryWriter(theirs)
    writer.add_hparams({'lr': 3e-4, 'layers': 4, 'policy': 'autocast-bf16', 'zero': 0.0},
                       {'hparam/val_loss': 1.25, 'hparam/accuracy': 0.5},
                       hparam_domain_discrete={'policy': ['fp32', 'autocast-bf16'],
                                               'layers': [2, 4, 8]},
                       run_name='compare')
    writer.close()
    ours_compare, theirs_compare = read(os.path.join(ours, 'compare')), read(
        os.path.join(theirs, 'compare'))
    assert sorted(ours_compare[0]) == ['_hparams_/experiment', '_hparams_/session_end_info',
                                       '_hparams_/session_start_info'], sorted(ours_compare[0])
    assert ours_compare[0] == theirs_compare[0], (ours_compare[0], theirs_compare[0])
    assert ours_compare[1] == theirs_compare[1], (ours_compare[1], theirs_compare[1])

    # Flags: bools (torch's own call would write Python's True as the number 1).
    flags, scalars = read(os.path.join(ours, 'flags'))
    start = flags['_hparams_/session_start_info'].session_start_info.hparams
    assert start['shuffle'].WhichOneof('kind') == 'bool_value' and start['shuffle'].bool_value
    assert start['ema'].WhichOneof('kind') == 'bool_value' and not start['ema'].bool_value
    types = {info.name: info.type for info in flags['_hparams_/experiment'].experiment.hparam_infos}
    assert types == {'shuffle': api_pb2.DATA_TYPE_BOOL, 'ema': api_pb2.DATA_TYPE_BOOL}, types
    end = flags['_hparams_/session_end_info'].session_end_info
    assert end.status == api_pb2.STATUS_SUCCESS, end
    assert scalars == {'loss': [(0, 2.0)]}, scalars

    # The run named by the time, as torch's default; the refused calls made no folder.
    runs = sorted(name for name in os.listdir(ours) if os.path.isdir(os.path.join(ours, name)))
    assert len(runs) == 3 and runs[1:] == ['compare', 'flags'], runs
    float(runs[0])
    timed, _ = read(os.path.join(ours, runs[0]))
    assert timed['_hparams_/session_start_info'].session_start_info.hparams['seed'].number_value == 7
    print('ok')


if __name__ == '__main__':
    main()
