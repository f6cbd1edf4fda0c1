"""Generate the latency benchmark model: ResNet-18 at 224×224, random weights.

    python -m training.make_resnet18 [--out runs/models/resnet18_latency_benchmark.onnx]

**A latency benchmark model, not a reward model**: its weights are random
(seeded) and its output means nothing. It has the cost of the seed's
benchmark network so `bench/reward_latency.py` can compare with the figures
in docs/design.md, "Measured physics". It is written to a git-ignored path (``runs/``) and never
shipped or served by default.

Architecture: ResNet-18 as in He et al., "Deep Residual Learning for Image
Recognition" (CVPR 2016), table 1: 7×7/2 conv (64) + batch norm + ReLU,
3×3/2 max pool, four stages of two basic blocks (two 3×3 convs each;
64, 128, 256, 512 channels; stride 2 and a 1×1/2 projection shortcut at the
start of stages 2-4), global average pool, fully connected. Written here in
plain torch (no torchvision). Two changes for a reward service, neither
material to the cost: the input is what an engine has, ``frame`` uint8
[N, 224, 224, 3] (NHWC), converted and normalised (ImageNet mean and std)
inside the model; and the last layer is 512 -> 1 (``value`` float32 [N, 1])
instead of 1000 classes.

The batch-norm running statistics are set by two forward passes over random
frames in training mode, so activations stay in range (an FP16 copy does not
overflow on random weights).
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from tandem.paths import REPO_ROOT

DEFAULT_OUT = REPO_ROOT / "runs" / "models" / "resnet18_latency_benchmark.onnx"
MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)


def build_resnet18(seed: int = 0, outputs: int = 1):
    """The torch module (eval mode, calibrated batch norm). Input uint8
    [N, 224, 224, 3]; output float32 [N, outputs]."""
    import torch
    from torch import nn

    class BasicBlock(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.shortcut = None
            if stride != 1 or cin != cout:
                self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            y = torch.relu(self.bn1(self.conv1(x)))
            y = self.bn2(self.conv2(y))
            return torch.relu(y + (x if self.shortcut is None else self.shortcut(x)))

    class ResNet18(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("mean", torch.tensor(MEAN).view(1, 3, 1, 1))
            self.register_buffer("inv_std", 1.0 / torch.tensor(STD).view(1, 3, 1, 1))
            self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                      nn.MaxPool2d(3, 2, 1))
            stages, cin = [], 64
            for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
                stages += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
                cin = cout
            self.stages = nn.Sequential(*stages)
            self.fc = nn.Linear(512, outputs)

        def forward(self, frame):
            x = (frame.permute(0, 3, 1, 2).to(torch.float32) - self.mean) * self.inv_std
            x = self.stages(self.stem(x))
            return self.fc(torch.flatten(torch.mean(x, dim=(2, 3)), 1))

    torch.manual_seed(seed)
    model = ResNet18()
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        if isinstance(m, nn.BatchNorm2d):
            m.momentum = None  # cumulative average over the calibration passes
    gen = torch.Generator().manual_seed(seed)
    model.train()
    with torch.no_grad():
        for _ in range(2):
            model(torch.randint(0, 256, (8, 224, 224, 3), dtype=torch.uint8, generator=gen))
    return model.eval()


def export(out: Path = DEFAULT_OUT, seed: int = 0) -> Path:
    """Writes the ONNX file (opset 17, dynamic batch) and returns its path."""
    import onnx
    import torch

    model = build_resnet18(seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.zeros((1, 224, 224, 3), dtype=torch.uint8),), str(out), dynamo=False,
                          opset_version=17, input_names=["frame"], output_names=["value"],
                          dynamic_axes={"frame": {0: "N"}, "value": {0: "N"}})
    proto = onnx.load(str(out))
    proto.doc_string = "ResNet-18 latency benchmark model: random weights, not a reward model (make_resnet18.py)"
    proto.metadata_props.add(key="purpose", value="latency benchmark only; random weights")
    onnx.save(proto, str(out))
    onnx.checker.check_model(str(out))
    return out


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    path = export(args.out, args.seed)
    print(f"wrote {path} ({path.stat().st_size} bytes): ResNet-18 latency benchmark model, random weights")
    return 0


if __name__ == "__main__":
    sys.exit(main())
