"""Compile report: every Triton kernel of Penelope compiled for Ampere, Hopper and Blackwell, no GPU needed.

Triton compiles for a GPU target on any machine: the kernel's Python is lowered to PTX, and the
``ptxas`` shipped in Triton's wheel assembles it into a cubin, whose SASS ``nvdisasm`` prints. So
"should run well on an H100" becomes figures a CPU-only CI can check, per kernel, target and
configuration:

- ``registers`` per thread and ``spill_store_bytes`` / ``spill_load_bytes`` (``ptxas -v``): a spill
  moves registers through local memory on every use, a large slowdown in a loop;
- ``shared_bytes``: Triton's dynamic shared memory plus the cubin's static shared memory, against
  the target's per-block limit;
- ``mma_instructions``: tensor-core MMA instructions in the SASS (HMMA on sm_80, HGMMA on sm_90a,
  UTC*MMA on sm_100a), and per main loop of the kernel (``loop_mma``; ``main_loops``: loops that
  load from global memory): the attention kernel's two loops (interior and diagonal KV tiles) must
  both run on tensor cores;
- ``loop_fp_ops``: the floating-point instructions of each loop. The interior and diagonal loops of
  the attention kernel must compile to the same ones (the masked step only adds a select): with
  FMA contraction on, this is what keeps a query's result independent of which kind of tile a KV
  tile is for its query tile.

Each launch is built by the launcher's own argument builder (``ragged_launch``, ``store_launch``,
``check_slots_launch``, ``copy_launch``) with small CPU tensors of the real dtypes and strides, and
specialised by Triton's own binder for the target, so the report compiles what the launcher runs.

Run (Triton must not be in interpreter mode)::

    python -m penelope.kernels.compile_report                 # the table (pinned configurations)
    python -m penelope.kernels.compile_report --markdown      # as in microbench/README.md
    python -m penelope.kernels.compile_report --json out.json --jobs 2
    python -m penelope.kernels.compile_report --candidates    # the tile shapes the tables were chosen from

Compiles are CPU work (about 1 to 5 s each); nothing is cached between runs (a fresh Triton cache
directory each time, so the figures and timings come from real compiles).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path

# Shapes of the models the report compiles for: (q heads, kv heads, head dim) of one rank.
SHAPES = {
    "qwen3-8b": (32, 8, 128),
    "qwen3-32b": (64, 8, 128),
    # GQA groups that are not powers of two (q heads per kv head: 3, 5, 6, 7), at head dim 128.
    "gqa3": (24, 8, 128),
    "gqa5": (40, 8, 128),
    "gqa6": (48, 8, 128),
    "gqa7": (28, 4, 128),
    # The other head-dim buckets of the pinned tables.
    "hd64-gqa4": (32, 8, 64),
    "hd256-gqa4": (16, 4, 256),
}


@dataclass(frozen=True)
class Target:
    """A compile target: Triton's compute capability, the SASS opcode of its tensor-core MMAs, and
    its largest shared memory per thread block (CUDA C Programming Guide, compute capabilities)."""

    name: str
    arch: int
    mma_opcode: str
    shared_limit: int


TARGETS = {
    # The sm_80 table also serves sm_86 and sm_89 (99 KB per block), so that is its limit.
    "sm_80": Target("sm_80", 80, "HMMA", 99 * 1024),
    "sm_90a": Target("sm_90a", 90, "HGMMA", 227 * 1024),
    "sm_100a": Target("sm_100a", 100, "UTC*MMA", 227 * 1024),
}

# SASS opcodes of floating-point arithmetic compared between the attention kernel's two loops. The
# paired forms of sm_100 (FFMA2, FADD2, FMUL2: the same operation on two lanes, each rounded on its
# own) count as two of the single form, so packing differences do not count as different math.
FP_OPCODES = ("FFMA", "FMUL", "FADD", "MUFU.EX2")
_PAIRED = {"FFMA2": "FFMA", "FMUL2": "FMUL", "FADD2": "FADD"}


@dataclass(frozen=True)
class Entry:
    """One kernel instantiation to compile: kernel name, model shape, dtype, target, and for the
    attention kernel the tile shape (None: the pinned one) and whether it returns the LSE."""

    kernel: str
    shape: str
    dtype: str
    target: str
    tiles: tuple[int, int, int, int] | None = None  # rows, block_n, warps, stages
    return_lse: bool = False

    @property
    def pinned(self) -> bool:
        return self.tiles is None


@dataclass
class Figures:
    """What the compile of one ``Entry`` gave."""

    entry: Entry
    config: str
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_bytes: int
    shared_bytes: int
    mma_instructions: int
    mma_opcodes: list[str]
    loop_mma: list[int]
    loop_fp_ops: list[dict[str, int]]
    compile_seconds: float
    problems: list[str] = field(default_factory=list)


def sass_loops(sass: str) -> list[list[str]]:
    """The instruction lines of every back edge in ``nvdisasm -c`` output, in address order.

    A back edge is a branch to a label that appears earlier; its body is every instruction from
    the label to the branch. This includes more than the kernel's loops: on sm_100 the waits on
    asynchronous MMAs are out-of-line blocks after the last EXIT that branch back into the code;
    ``main_loops`` keeps the loops that load from global memory. The branch-to-itself that ptxas
    puts after the last EXIT is left out."""
    lines = sass.splitlines()
    labels = {}
    for index, line in enumerate(lines):
        match = re.match(r"^(\.L_x_\d+):", line.strip())
        if match:
            labels[match.group(1)] = index
    loops = []
    for index, line in enumerate(lines):
        # "BRA `(.L_x_3)", "@!P0 BRA `(.L_x_3)", and on sm_100 "BRA.U UP1, `(.L_x_3)".
        match = re.search(r"\bBRA(?:\.\w+)*\s+(?:!?U?P\w+,\s*)?`?\(?(\.L_x_\d+)\)?", line)
        if match and labels.get(match.group(1), index) < index:
            body = [text for text in lines[labels[match.group(1)] : index + 1] if _INSTRUCTION.search(text)]
            if len(body) > 1:
                loops.append(body)
    return loops


_INSTRUCTION = re.compile(r"/\*[0-9a-f]+\*/")
# Opcodes that read global memory (cp.async is LDGSTS; TMA loads are UTMALDG).
_GLOBAL_LOADS = ("LDG", "LDGSTS", "UTMALDG")


def main_loops(sass: str) -> list[list[str]]:
    """The loops of a kernel's own code: back edges that branch before the first EXIT (not the
    out-of-line wait blocks placed after it) and whose body loads from global memory (not a spin
    on a barrier)."""
    lines = [line for line in sass.splitlines() if _INSTRUCTION.search(line)]
    exits = [i for i, line in enumerate(lines) if opcode(line) == "EXIT"]
    first_exit = lines[exits[0]] if exits else None
    end = _address(first_exit) if first_exit is not None else None
    loops = []
    for body in sass_loops(sass):
        if end is not None and _address(body[-1]) > end:
            continue
        if any(opcode(line).split(".", 1)[0] in _GLOBAL_LOADS for line in body):
            loops.append(body)
    return loops


def _address(line: str) -> int:
    return int(_INSTRUCTION.search(line).group(0)[2:-2], 16)


def opcode(line: str) -> str:
    """The opcode with its modifiers (``HGMMA.64x64x16.F32.BF16``) of one SASS instruction line."""
    text = re.sub(r"^\s*/\*[0-9a-f]+\*/\s*", "", line.strip())
    text = re.sub(r"^@!?U?P[T0-9]+\s+", "", text)
    return text.split(None, 1)[0].rstrip(";") if text else ""


def is_mma(op: str, target: Target) -> bool:
    base = op.split(".", 1)[0]
    if target.mma_opcode.endswith("*MMA"):
        return base.startswith(target.mma_opcode[:-4]) and base.endswith("MMA")
    return base == target.mma_opcode


def fp_ops(lines: list[str]) -> dict[str, int]:
    """Counts of the ``FP_OPCODES`` among instruction ``lines`` (paired forms count twice)."""
    counts = Counter()
    for line in lines:
        op = opcode(line)
        base = op.split(".", 1)[0]
        if base in _PAIRED:
            counts[_PAIRED[base]] += 2
            continue
        key = "MUFU.EX2" if op.startswith("MUFU.EX2") else base
        if key in FP_OPCODES:
            counts[key] += 1
    return dict(sorted(counts.items()))


def fp_mix(counts: dict[str, int]) -> dict[str, Fraction]:
    """FP instruction counts per exponential (``MUFU.EX2``): the mix of one softmax step, the same
    whether ptxas unrolled a loop or not."""
    per = counts.get("MUFU.EX2", 0) or 1
    return {op: Fraction(count, per) for op, count in counts.items()}


def parse_ptxas_log(log: str) -> dict[str, int]:
    """Registers, stack frame and spill bytes from a ``ptxas -v`` log (ValueError if absent)."""
    registers = re.search(r"Used (\d+) registers", log)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if registers is None or frame is None:
        raise ValueError(f"no register/spill figures in the ptxas log: {log[-500:]!r}")
    return dict(registers=int(registers.group(1)), stack_bytes=int(frame.group(1)),
                spill_store_bytes=int(frame.group(2)), spill_load_bytes=int(frame.group(3)))


def _tool(name: str) -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: this Triton wheel does not ship {name}")
    return str(path)


def _dtype(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def _launch(entry: Entry):
    """The (kernel, args, kwargs, config label) the launcher would use for ``entry``."""
    import torch

    from .kv_swap import kernel as swap
    from .ragged_attention import configs, kernel, slot_check, store

    num_q_heads, num_kv_heads, head_dim = SHAPES[entry.shape]
    dtype = _dtype(entry.dtype)
    ints = torch.zeros(8, dtype=torch.int32)
    # Tensors with the real dtypes and strides (one row: nothing runs); SGLang's table is wider.
    req_to_token = torch.zeros((2, 131072 + 8), dtype=torch.int32)
    k_buffer = torch.empty((1, num_kv_heads, head_dim), dtype=dtype)
    if entry.kernel == "ragged_attention":
        group = num_q_heads // num_kv_heads
        blocks = configs.ragged_attention_blocks(head_dim, group, entry.target, dtype)
        q = torch.empty((1, num_q_heads, head_dim), dtype=dtype)
        lse = torch.empty((1, num_q_heads), dtype=torch.float32) if entry.return_lse else None
        _, args, kwargs = kernel.ragged_launch(q, k_buffer, k_buffer, req_to_token, ints.view(2, 4), ints[:1], 1.0,
                                               q, lse, blocks, entry.target)
        if entry.tiles is not None:
            rows, block_n, warps, stages = entry.tiles
            kwargs.update(BLOCK_M=rows // group, BLOCK_R=rows, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
        blocks = configs.RaggedBlocks(kwargs["BLOCK_M"], kwargs["BLOCK_N"], kwargs["BLOCK_R"], kwargs["num_warps"],
                                      kwargs["num_stages"])
        label = f"{entry.dtype} g{group} d{head_dim} {blocks.label}" + (" lse" if entry.return_lse else "")
        return kernel._ragged_prefill_fwd_kernel, args, kwargs, label
    if entry.kernel == "check_slots":
        _, args, kwargs = slot_check.check_slots_launch(req_to_token, ints[:6].view(2, 3), ints[:1], 1 << 20, 1)
        return slot_check._check_slots_kernel, args, kwargs, f"block {slot_check.CHECK_BLOCK}"
    if entry.kernel == "store_kv":
        kv = torch.empty((1, num_kv_heads, head_dim), dtype=dtype)
        _, args, kwargs = store.store_launch(k_buffer, k_buffer, torch.zeros(1, dtype=torch.int64), kv, kv)
        return store._store_kv_kernel, args, kwargs, f"{entry.dtype} h{num_kv_heads} d{head_dim}"
    if entry.kernel == "copy_kv_slots":
        pool = [torch.empty((1, num_kv_heads, head_dim), dtype=dtype) for _ in range(2)]
        pools = swap.check_pools(pool[:1], pool[1:])
        table = torch.zeros(1, dtype=torch.int64)
        slots = torch.zeros(1, dtype=torch.int64)
        _, args, kwargs = swap.copy_launch(pools, table, table, slots, slots, "cuda")
        # CUDA allocations are at least 256-byte aligned: the launcher then passes ALIGN=16.
        kwargs["ALIGN"] = 16
        row = num_kv_heads * head_dim * dtype.itemsize
        label = f"{row} B rows, {kwargs['BLOCK_SLOTS']} x {kwargs['BLOCK_WORDS']} words"
        return swap._copy_kv_slots_kernel, args, kwargs, label
    raise ValueError(f"unknown kernel {entry.kernel!r}")


def _compile(fn, args, kwargs, target: Target):
    """``triton.compile`` of ``fn`` specialised for ``args`` as Triton's launcher would, for ``target``;
    returns the compiled kernel and the ptxas log."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    gpu = GPUTarget("cuda", target.arch, 32)
    backend = make_backend(gpu)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(kwargs, debug=False, instrumentation_mode=knobs.compilation.instrumentation_mode)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=gpu, options=options.__dict__)
    return compiled, log.getvalue()


def _run_on_cubin(compiled, tool: str, *options: str) -> str:
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        return subprocess.run([_tool(tool), *options, str(cubin)], capture_output=True, text=True, check=True).stdout


def sass_of(compiled) -> str:
    """The SASS of a compiled kernel (``nvdisasm -c`` of its cubin)."""
    return _run_on_cubin(compiled, "nvdisasm", "-c")


def compile_entry(entry: Entry) -> Figures:
    """Compile ``entry`` and measure it (registers, spills, shared memory, MMAs, loops)."""
    from triton import knobs

    from .ragged_attention.kernel import is_interpreted

    if is_interpreted():
        raise RuntimeError("the compile report needs compiled kernels: unset TRITON_INTERPRET")
    target = TARGETS[entry.target]
    fn, args, kwargs, label = _launch(entry)
    knobs.compilation.always_compile = True
    knobs.nvidia.dump_ptxas_log = True
    start = time.perf_counter()
    compiled, log = _compile(fn, args, kwargs, target)
    seconds = time.perf_counter() - start
    ptxas = parse_ptxas_log(log)
    usage = _run_on_cubin(compiled, "cuobjdump", "-res-usage")
    sass = sass_of(compiled)
    registers = re.search(r"REG:(\d+)", usage)
    static_shared = re.search(r"SHARED:(\d+)", usage)
    if registers is None or static_shared is None or int(registers.group(1)) != ptxas["registers"]:
        raise ValueError(f"cuobjdump's resource usage {usage!r} disagrees with the ptxas log {ptxas}")
    ops = [opcode(line) for line in sass.splitlines() if _INSTRUCTION.search(line)]
    mmas = [op for op in ops if is_mma(op, target)]
    loops = main_loops(sass)
    figures = Figures(
        entry=entry,
        config=label,
        shared_bytes=compiled.metadata.shared + int(static_shared.group(1)),
        mma_instructions=len(mmas),
        mma_opcodes=sorted(set(mmas)),
        loop_mma=[sum(is_mma(opcode(line), target) for line in body) for body in loops],
        loop_fp_ops=[fp_ops(body) for body in loops],
        compile_seconds=round(seconds, 2),
        **ptxas,
    )
    figures.problems = problems(figures)
    return figures


def problems(figures: Figures) -> list[str]:
    """Why a configuration the launcher may choose must not ship: spills, shared memory over the
    target's limit, and for the attention kernel a loop without tensor-core MMAs (16-bit dtypes)
    or interior and diagonal loops whose floating-point instructions differ."""
    entry, target = figures.entry, TARGETS[figures.entry.target]
    found = []
    if figures.spill_store_bytes or figures.spill_load_bytes:
        found.append(f"spills {figures.spill_store_bytes} B stored / {figures.spill_load_bytes} B loaded")
    if figures.shared_bytes > target.shared_limit:
        found.append(f"shared memory {figures.shared_bytes} B over the {target.shared_limit} B limit")
    if entry.kernel == "ragged_attention":
        if len(figures.loop_mma) < 2:
            found.append(f"{len(figures.loop_mma)} loop(s) in the SASS, expected the interior and diagonal ones")
        elif entry.dtype != "fp32" and min(figures.loop_mma) == 0:
            found.append(f"a main loop without {target.mma_opcode} (per loop: {figures.loop_mma})")
        elif any(fp_mix(ops) != fp_mix(figures.loop_fp_ops[0]) for ops in figures.loop_fp_ops[1:]):
            found.append(f"interior and diagonal loops differ in FP instructions: {figures.loop_fp_ops}")
    return found


def pinned_entries(targets=tuple(TARGETS)) -> list[Entry]:
    """Every configuration the launchers choose on ``targets``, at the report's shapes."""
    entries = []
    for target in targets:
        for shape in SHAPES:
            entries.append(Entry("ragged_attention", shape, "bf16", target))
        entries.append(Entry("ragged_attention", "qwen3-8b", "fp16", target))
        entries.append(Entry("ragged_attention", "qwen3-8b", "bf16", target, return_lse=True))
        for shape in ("qwen3-8b", "hd64-gqa4", "hd256-gqa4"):
            entries.append(Entry("ragged_attention", shape, "fp32", target))
        entries.append(Entry("check_slots", "qwen3-8b", "bf16", target))
        entries.append(Entry("store_kv", "qwen3-8b", "bf16", target))
        entries.append(Entry("copy_kv_slots", "qwen3-8b", "bf16", target))
    return entries


# Tile shapes (rows, block_n, warps, stages) the pinned tables were chosen from; fp32 inputs (no
# tensor cores, for tests and references) try small tiles.
CANDIDATE_TILES = [(rows, block_n, warps, stages) for rows in (64, 128) for block_n in (32, 64, 128)
                   for warps in (4, 8) for stages in (2, 3)]
CANDIDATE_TILES_FP32 = [(16, 16, 4, 1), (32, 16, 4, 1), (32, 16, 8, 1), (32, 32, 8, 1)]


def candidate_entries(targets=tuple(TARGETS)) -> list[Entry]:
    """The candidate tile shapes of every head-dim bucket (16-bit inputs) and of fp32 inputs."""
    entries = []
    for target in targets:
        for shape in ("qwen3-8b", "hd64-gqa4", "hd256-gqa4"):
            entries += [Entry("ragged_attention", shape, "bf16", target, tiles) for tiles in CANDIDATE_TILES]
        entries += [Entry("ragged_attention", shape, "fp32", target, tiles) for shape in ("qwen3-8b", "hd64-gqa4",
                    "hd256-gqa4") for tiles in CANDIDATE_TILES_FP32]
    return entries


def _compile_in_worker(entry: Entry) -> Figures:
    try:
        return compile_entry(entry)
    except Exception as error:  # a failed compile is a row of the report, not the end of it
        figures = Figures(entry, "", -1, -1, -1, -1, -1, -1, [], [], [], 0.0)
        figures.problems = [f"compile failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}"]
        return figures


def run(entries: list[Entry], jobs: int = 1, progress=None) -> list[Figures]:
    """Compile every entry (``jobs`` processes), in a fresh Triton cache directory; ``progress`` is
    called with each result as it comes (in entry order)."""
    with tempfile.TemporaryDirectory(prefix="penelope-compile-report-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        results = []
        with ProcessPoolExecutor(max_workers=max(jobs, 1)) as pool:
            for figures in pool.map(_compile_in_worker, entries):
                results.append(figures)
                if progress is not None:
                    progress(figures)
        return results


def format_table(results: list[Figures], markdown: bool = False) -> str:
    header = ("kernel", "target", "shape", "config", "regs", "spill st/ld B", "shared B", "MMA", "per loop",
              "compile s", "status")
    rows = []
    for figures in results:
        entry = figures.entry
        mma = f"{figures.mma_instructions} {'/'.join(sorted({op.split('.')[0] for op in figures.mma_opcodes}))}"
        rows.append((entry.kernel, entry.target, entry.shape, figures.config, str(figures.registers),
                     f"{figures.spill_store_bytes}/{figures.spill_load_bytes}", str(figures.shared_bytes),
                     mma.strip(), " ".join(map(str, figures.loop_mma)) or "-", f"{figures.compile_seconds:.1f}",
                     "; ".join(figures.problems) or "ok"))
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(line[i]) for line in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
                     for line in [header, *rows])


def to_json(results: list[Figures], seconds: float) -> dict:
    return {"wall_seconds": round(seconds, 1), "results": [asdict(figures) for figures in results]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", nargs="+", choices=list(TARGETS), default=list(TARGETS))
    parser.add_argument("--candidates", action="store_true", help="compile the candidate tile shapes instead")
    parser.add_argument("--kernel", help="only entries of this kernel")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="only entries of this dtype")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="compile processes")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--json", help="also write the figures as JSON to this file")
    args = parser.parse_args(argv)
    entries = candidate_entries(args.targets) if args.candidates else pinned_entries(args.targets)
    if args.kernel:
        entries = [entry for entry in entries if entry.kernel == args.kernel]
    if args.dtype:
        entries = [entry for entry in entries if entry.dtype == args.dtype]
    start = time.perf_counter()

    def progress(figures):
        print(f"[{len(done) + 1}/{len(entries)}] {format_table([figures]).splitlines()[1]}", file=sys.stderr,
              flush=True)
        done.append(figures)

    done: list[Figures] = []
    results = run(entries, args.jobs, progress)
    seconds = time.perf_counter() - start
    print(format_table(results, args.markdown))
    print(f"\n{len(results)} compiles in {seconds:.1f} s with {args.jobs} process(es)")
    if args.json:
        Path(args.json).write_text(json.dumps(to_json(results, seconds), indent=1) + "\n")
    bad = [figures for figures in results if figures.problems and figures.entry.pinned]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
