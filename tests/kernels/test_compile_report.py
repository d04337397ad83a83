"""The compile report: every kernel, compiled for sm_80, sm_90a and sm_100a without a GPU.

The report runs once per session in a subprocess without ``TRITON_INTERPRET`` (compiles are CPU
work: about 1-2 minutes on 2 cores, printed at the end of the session). The tests fail on a spill in
any configuration a launcher can choose, shared memory over a target's limit, an attention loop
without tensor-core MMAs, or interior and diagonal loops that compile to different floating-point
instructions. The SASS parsing the checks rest on is tested on hand-written SASS first.
"""

import json
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from penelope.kernels.compile_report import (
    SHAPES,
    TARGETS,
    Entry,
    Figures,
    fp_mix,
    fp_ops,
    is_mma,
    main_loops,
    opcode,
    parse_ptxas_log,
    pinned_entries,
    problems,
    sass_loops,
)

REPO = Path(__file__).resolve().parents[2]

SASS = """
        /*0000*/                   LDC R1, c[0x0][0x37c] ;
.L_x_9:
        /*0004*/                   SYNCS.PHASECHK.TRANS64 P0, [UR4], R2 ;
        /*0008*/              @!P0 BRA `(.L_x_9) ;
        /*0010*/              @!P0 BRA `(.L_x_0) ;
.L_x_1:
        /*0020*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR4][R4.64] ;
        /*0024*/                   HGMMA.64x64x16.F32.BF16 R88, gdesc[UR48], RZ, !UPT ;
        /*0030*/                   FFMA R6, R6, UR5, -R5 ;
        /*0040*/                   MUFU.EX2 R7, R6 ;
        /*0050*/              @!P0 BRA `(.L_x_1) ;
.L_x_0:
        /*0060*/                   FMUL R9, R10, UR5 ;
.L_x_2:
        /*0070*/                   LDG.E R8, desc[UR4][R2.64] ;
        /*0074*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0080*/                   UTCHMMA gdesc[UR4], gdesc[UR6], tmem[UR8], tmem[UR10], idesc[UR11], UPT ;
        /*0084*/                   FFMA2 R6, R6.F32x2.HI_LO, UR5.F32, -R5.F32x2.HI_LO ;
        /*0090*/                   BRA.U UP1, `(.L_x_2) ;
        /*00a0*/                   EXIT ;
.L_x_5:
        /*00b0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2 ;
        /*00c0*/                   BRA `(.L_x_1) ;
.L_x_3:
        /*00d0*/                   BRA `(.L_x_3);
"""


def test_sass_loops_are_back_edges_and_main_loops_load_global_memory():
    loops = sass_loops(SASS)
    # The barrier spin, the two loops, the wait block after EXIT (not the final trap).
    assert [len(body) for body in loops] == [2, 5, 5, 14]
    assert opcode(loops[1][1]) == "HGMMA.64x64x16.F32.BF16" and opcode(loops[2][-1]) == "BRA.U"
    assert opcode("        /*0010*/              @!P0 BRA `(.L_x_0) ;") == "BRA"
    # Kept: loops before the first EXIT that read global memory (LDGSTS, LDG).
    assert main_loops(SASS) == loops[1:3]


def test_mma_opcodes_per_target():
    ops = [opcode(line) for line in SASS.splitlines() if "/*" in line]
    found = {name: [op for op in ops if is_mma(op, target)] for name, target in TARGETS.items()}
    assert found == {"sm_80": ["HMMA.16816.F32.BF16"], "sm_90a": ["HGMMA.64x64x16.F32.BF16"],
                     "sm_100a": ["UTCHMMA"]}


def test_fp_mix_is_per_exponential():
    assert fp_ops(main_loops(SASS)[0]) == {"FFMA": 1, "MUFU.EX2": 1}
    # A paired sm_100 FFMA2 is two FFMAs.
    assert fp_ops(main_loops(SASS)[1]) == {"FFMA": 2}
    assert fp_mix({"FFMA": 4, "FMUL": 4, "MUFU.EX2": 4}) == fp_mix({"FFMA": 1, "FMUL": 1, "MUFU.EX2": 1})
    assert fp_mix({"FADD": 2, "FMUL": 1, "MUFU.EX2": 1}) == {"FADD": Fraction(2), "FMUL": 1, "MUFU.EX2": 1}


def test_ptxas_log_parsing():
    log = ("ptxas info    : Function properties for k\n    16 bytes stack frame, 12 bytes spill stores, "
           "8 bytes spill loads\nptxas info    : Used 255 registers, used 1 barriers\n")
    assert parse_ptxas_log(log) == dict(registers=255, stack_bytes=16, spill_store_bytes=12, spill_load_bytes=8)
    with pytest.raises(ValueError, match="no register"):
        parse_ptxas_log("ptxas info: nothing")


def figures(**changes):
    base = dict(entry=Entry("ragged_attention", "qwen3-8b", "bf16", "sm_90a"), config="", registers=180,
                spill_store_bytes=0, spill_load_bytes=0, stack_bytes=0, shared_bytes=99328, mma_instructions=24,
                mma_opcodes=["HGMMA.64x64x16.F32.BF16"], loop_mma=[12, 12],
                loop_fp_ops=[{"FFMA": 64, "MUFU.EX2": 64}, {"FFMA": 64, "MUFU.EX2": 64}], compile_seconds=1.0)
    return Figures(**(base | changes))


@pytest.mark.parametrize(("changes", "message"), [
    (dict(spill_store_bytes=4), "spills"),
    (dict(spill_load_bytes=4), "spills"),
    (dict(shared_bytes=227 * 1024 + 1), "over the"),
    (dict(loop_mma=[12, 0]), "without HGMMA"),
    (dict(loop_mma=[12]), "1 loop"),
    (dict(loop_fp_ops=[{"FFMA": 64, "MUFU.EX2": 64}, {"FMUL": 64, "FADD": 64, "MUFU.EX2": 64}]), "differ"),
])
def test_problems_name_each_failure(changes, message):
    assert problems(figures()) == []
    found = problems(figures(**changes))
    assert len(found) == 1 and message in found[0]


def test_fp32_attention_needs_no_tensor_cores_but_no_spill_either():
    fp32 = Entry("ragged_attention", "qwen3-8b", "fp32", "sm_90a")
    assert problems(figures(entry=fp32, loop_mma=[0, 0])) == []
    assert problems(figures(entry=fp32, loop_mma=[0, 0], spill_store_bytes=8))


def _without_interpreter() -> dict:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "tests"), env.get("PYTHONPATH")]))
    return env


# The report (one compile of every kernel target, minutes on 2 cores) is built once per process:
# a parallel run keeps this module's tests on one worker (`--dist loadgroup`, scripts/test.sh).
pytestmark = pytest.mark.xdist_group("compile_report")


@pytest.fixture(scope="session")
def report(tmp_path_factory, request):
    out = tmp_path_factory.mktemp("compile-report") / "report.json"
    done = subprocess.run([sys.executable, "-m", "penelope.kernels.compile_report", "--json", str(out), "--jobs", "2"],
                          cwd=REPO, env=_without_interpreter(), capture_output=True, text=True, timeout=1200)
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(out.read_text())
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"compile report: {len(data['results'])} compiles in {data['wall_seconds']} s")
    return data


@pytest.mark.slow
def test_the_report_covers_every_kernel_target_and_shape(report):
    seen = {(r["entry"]["kernel"], r["entry"]["target"], r["entry"]["shape"], r["entry"]["dtype"],
             r["entry"]["return_lse"]) for r in report["results"]}
    expected = {(e.kernel, e.target, e.shape, e.dtype, e.return_lse) for e in pinned_entries()}
    assert seen == expected
    for target in TARGETS:
        for shape in ("qwen3-8b", "qwen3-32b", "gqa3", "gqa5", "gqa6", "gqa7"):
            assert ("ragged_attention", target, shape, "bf16", False) in seen
        for kernel in ("check_slots", "store_kv", "copy_kv_slots"):
            assert any(s[0] == kernel and s[1] == target for s in seen)
    assert set(SHAPES) <= {s[2] for s in seen}


def test_no_pinned_configuration_spills_or_overflows_shared_memory(report):
    bad = [(r["entry"], r["config"], r["problems"]) for r in report["results"] if r["problems"]]
    assert bad == []
    for r in report["results"]:
        assert r["spill_store_bytes"] == 0 and r["spill_load_bytes"] == 0
        assert 0 <= r["shared_bytes"] <= TARGETS[r["entry"]["target"]].shared_limit


def test_attention_loops_run_on_the_targets_tensor_cores(report):
    expected = {"sm_80": "HMMA", "sm_90a": "HGMMA", "sm_100a": "UTCHMMA"}
    for r in report["results"]:
        entry = r["entry"]
        if entry["kernel"] != "ragged_attention" or entry["dtype"] == "fp32":
            continue
        assert {op.split(".")[0] for op in r["mma_opcodes"]} == {expected[entry["target"]]}, r
        assert len(r["loop_mma"]) >= 2 and min(r["loop_mma"]) > 0, r


def test_interior_and_diagonal_loops_compile_to_the_same_fp_instructions(report):
    for r in report["results"]:
        if r["entry"]["kernel"] == "ragged_attention":
            mixes = [fp_mix(ops) for ops in r["loop_fp_ops"]]
            assert all(mix == mixes[0] for mix in mixes), r["loop_fp_ops"]


@pytest.mark.parametrize("target", list(TARGETS))
def test_explicit_fma_keeps_masked_and_unmasked_loops_alike(target):
    """The measurement behind ``enable_fp_fusion=True`` (tests/fma_probe.py): with contraction on,
    scaling before the mask fuses the scale into the subtraction only in the unmasked loop; the
    kernel's explicit FMA gives every loop the same instruction mix."""
    done = subprocess.run([sys.executable, str(REPO / "tests" / "fma_probe.py"), target], cwd=REPO,
                          env=_without_interpreter(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    loops = json.loads(done.stdout)
    split = [fp_mix(ops) for ops in loops["split"]]
    explicit = [fp_mix(ops) for ops in loops["explicit"]]
    assert len(split) >= 2 and any(mix != split[0] for mix in split)
    assert "FFMA" not in split[-1]
    assert len(explicit) >= 2 and all(mix == explicit[0] for mix in explicit)
