"""Run by tests/test_interrupts.py in a fresh process: interrupt the first plan with a real SIGINT (``import``: inside
sympy's import, which torch imports lazily; ``workers``: while a forked worker runs a simulation), then plan again. Prints
one JSON line: the second plan's JSON, whether the first was interrupted, and the children left."""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import time

import torch
from torch import nn

import autofit
from autofit.core import workers

analyse = importlib.import_module("autofit.analyse.analyse")  # the module, not autofit.analyse()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 8))


def _children() -> list[int]:
    """Process ids whose parent is this process (zombies included)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                        found.append(int(entry))
            except OSError:
                continue
    return found


class _InterruptAt:
    """An import finder that sends this process SIGINT when ``name`` is first looked for (then finds nothing)."""

    def __init__(self, name: str) -> None:
        self.name, self.fired = name, False

    def find_spec(self, name, path=None, target=None):
        if name == self.name and not self.fired:
            self.fired = True
            os.kill(os.getpid(), signal.SIGINT)
        return None


def main(mode: str, budget: str) -> None:
    model = _model()
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 8, (64,), generator=torch.Generator().manual_seed(2))

    def plan() -> autofit.Plan:
        return autofit.plan(model, x, budget, target=y, device="T4", precision="fp32")

    out: dict = {"mode": mode}
    if mode != "none":
        if mode == "import":  # a real SIGINT inside sympy's import, which the first simulation triggers
            sys.meta_path.insert(0, _InterruptAt("sympy.printing"))
        else:  # the first simulation this process runs while a forked worker is alive
            original = analyse.simulate_step

            def interrupting(*args, **kwargs):
                if workers._alive > 0:
                    analyse.simulate_step = original
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(1.0)  # the KeyboardInterrupt arrives here
                return original(*args, **kwargs)

            analyse.simulate_step = interrupting
        try:
            plan()
            out["interrupted"] = False
        except KeyboardInterrupt:
            out["interrupted"] = True
        out["children"] = _children()
    out["plan"] = json.loads(plan().to_json())
    out["children_after"] = _children()
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
