# tests/torch/torch_resnet.py -- torchvision's ResNet-18 written out (torchvision is not
# installed), with its layout and state_dict names: the reference of test_torch_parity and the
# PyTorch peer of bench/peer_torch.py both build it from here.
import torch
import torch.nn as nn
import torch.nn.functional as F


class BasicBlock(nn.Module):
    """torchvision's BasicBlock (examples/resnet_model.h): conv3x3-bn-relu-conv3x3-bn plus the
    identity or a strided 1x1 conv-bn, then relu."""

    def __init__(self, inp, out, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(inp, out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out)
        self.conv2 = nn.Conv2d(out, out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out)
        self.downsample = None
        if stride != 1 or inp != out:
            self.downsample = nn.Sequential(nn.Conv2d(inp, out, 1, stride, bias=False),
                                            nn.BatchNorm2d(out))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + identity)


class ResNet18(nn.Module):
    """torchvision.models.resnet18: 7x7 stride-2 stem, 3x3 stride-2 max pooling, four stages of
    two BasicBlocks, global average pooling, linear."""

    def __init__(self, classes):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        # (in, out, stride) of each stage's first block; its second keeps out channels.
        stages = ((64, 64, 1), (64, 128, 2), (128, 256, 2), (256, 512, 2))
        for i, (inp, out, stride) in enumerate(stages, 1):
            setattr(self, f"layer{i}",
                    nn.Sequential(BasicBlock(inp, out, stride), BasicBlock(out, out, 1)))
        self.fc = nn.Linear(512, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
