"""Why the ragged kernel computes the softmax exponent with an explicit FMA (run as a script).

Two loops like the kernel's interior and diagonal KV tiles: the second masks the scores with a
select. ``split`` scales the scores, masks them, then subtracts the running maximum, as the kernel
did before; ``explicit`` masks the raw scores and computes ``fma(s, scale, -m)`` in both loops.
Compiled with FMA contraction on, ``split`` fuses the multiply and the subtract into one FFMA in the
unmasked loop only (the select sits between them in the masked one), so the two loops round the
exponent differently; ``explicit`` gives both loops the same instructions. Prints, as JSON, the
floating-point instructions of each loop for both variants on the target given as argument.
"""

import json
import sys

import torch
import triton
import triton.language as tl

from penelope.kernels.compile_report import TARGETS, _compile, fp_ops, main_loops, sass_of


@triton.jit
def _probe_kernel(out_ptr, x_ptr, scale, n_interior, n_visit, EXPLICIT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m_i = tl.load(x_ptr + offs)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, n_interior):
        s = tl.load(x_ptr + i * BLOCK + offs)
        if EXPLICIT:
            m_new = tl.maximum(m_i, tl.max(s, 0) * scale)
            p = tl.math.exp2(tl.fma(s, scale, -m_new))
        else:
            s = s * scale
            m_new = tl.maximum(m_i, tl.max(s, 0))
            p = tl.math.exp2(s - m_new)
        acc += p
        m_i = m_new
    for i in range(n_interior, n_visit):
        s = tl.load(x_ptr + i * BLOCK + offs)
        if EXPLICIT:
            s = tl.where(offs <= i, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0) * scale)
            p = tl.math.exp2(tl.fma(s, scale, -m_new))
        else:
            s = s * scale
            s = tl.where(offs <= i, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            p = tl.math.exp2(s - m_new)
        acc += p
        m_i = m_new
    tl.store(out_ptr + offs, acc)


def main(target_name: str) -> dict:
    target = TARGETS[target_name]
    buffer = torch.empty(128, dtype=torch.float32)
    result = {}
    for explicit in (False, True):
        compiled, _ = _compile(_probe_kernel, (buffer, buffer, 0.5, 3, 7),
                               dict(EXPLICIT=explicit, BLOCK=128, num_warps=4, enable_fp_fusion=True), target)
        loops = main_loops(sass_of(compiled))
        result["explicit" if explicit else "split"] = [fp_ops(body) for body in loops]
    return result


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1] if len(sys.argv) > 1 else "sm_90a")))
