"""Test-wide setup: without a GPU, Triton kernels run in the interpreter (set before any kernel
module imports triton). scripts/test.sh sets TRITON_INTERPRET=1 too; this makes a bare
`python -m pytest` behave the same."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
