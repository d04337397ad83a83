"""Helpers shared by the workload loader tests (WEKA, Mooncake, `penelope.sim.workloads.types`)."""
import json

import numpy as np

CONTEXT_128K = 128 * 1024


def common_prefix(a, b):
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


def write_jsonl(path, rows):
    path.write_text("\n".join(row if isinstance(row, str) else json.dumps(row) for row in rows) + "\n")
    return path
