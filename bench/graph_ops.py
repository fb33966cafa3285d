"""The frozen TorchScript graph of the REFERENCE encoder, as op counts: run it in two trees and diff the output
to show that a change leaves the reference model's forward op for op the same (no new per-call work).

  PYTHONPATH=<tree> python bench/graph_ops.py > ops.txt
"""

from __future__ import annotations

import collections
import re

import torch

from model.config import REFERENCE
from model.encoder import Encoder


def main() -> None:
    module = torch.jit.freeze(torch.jit.script(Encoder(REFERENCE).init_weights(0).eval()))
    graph = module.graph
    torch._C._jit_pass_inline(graph)
    counts = collections.Counter(re.findall(r"(?:aten|prim)::\w+", str(graph)))
    print(f"{sum(counts.values())} ops")
    for op, n in sorted(counts.items()):
        print(f"{op} {n}")


if __name__ == "__main__":
    main()
