"""`penelope verify`: deterministic phantom batches reproduce a never-evicting cache bit for bit,
on the naive path and on the Triton kernel (interpreted), GPU-only and with a CPU tier whose moves
run on the real K/V pools, and the check catches broken plans and skipped copies."""
import os

# The "triton" backend runs the kernel under the interpreter on CPU; it must be chosen before
# the kernel package is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import penelope.cache.phantom  # noqa: E402
from penelope.cache.phantom import build_batch  # noqa: E402
from penelope.cache.policies import policy_names  # noqa: E402
from penelope.cache.swap_executor import SwapExecutor  # noqa: E402
from penelope.cli import main  # noqa: E402
from penelope.commands.verify import VerifyOptions, compare_runs, verify  # noqa: E402
from penelope.engine.session import RunRecord, SessionRecord  # noqa: E402

# Small enough for the interpreter: 3 sessions x 3 turns, 32-token blocks, a 384-token cache
# that Penelope must evict from (two holes refilled by phantoms with seed 0).
SMALL = VerifyOptions(sessions=3, turns=3, cache_tokens=384, block_size=32, system_tokens=64, message_tokens=48,
                      reply_tokens=3)
# The same workload over a two-tier cache: a 256-token GPU tier (the longest session is 253
# tokens) and a 128-token CPU tier, so requests load CPU spans, both tiers fill up and loads go
# through a one-block swap buffer in several chunks, and deleted fronts leave holes for phantoms.
TWO_TIER = dataclasses.replace(SMALL, cache_tokens=256, cpu_cache=128, swap_buffer=32)
CONTRACT = {"identical_tokens", "bitwise_identical_logprobs", "max_abs_logprob_diff", "requests", "phantom_tokens",
            "holes_refilled", "loads", "swap_buffer_loads", "demotions"}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def assert_identical_with_phantoms(report, requests):
    assert report.identical_tokens and report.bitwise_identical_logprobs and report.identical
    assert report.max_abs_logprob_diff == 0.0
    assert report.requests == requests
    assert report.phantom_tokens > 0 and report.holes_refilled > 0
    assert report.missing_positions == 0 and report.recomputed_values > 0
    assert report.evicted_tokens > 0


def test_cli_default_run_is_bitwise_identical_with_phantoms(tmp_path, capsys):
    out = tmp_path / "verify.json"
    assert main(["verify", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert CONTRACT <= set(report)
    assert report["identical_tokens"] is True and report["bitwise_identical_logprobs"] is True
    assert report["max_abs_logprob_diff"] == 0.0
    assert report["requests"] == 24 and report["phantom_tokens"] > 0 and report["holes_refilled"] > 0
    assert report["positions_compared"] > 4 * 256
    assert (report["loads"], report["swap_buffer_loads"], report["demotions"]) == (0, 0, 0)
    printed = capsys.readouterr().out
    assert "PASS" in printed and "holes refilled by phantoms" in printed


def test_triton_kernel_is_bitwise_identical_with_phantoms():
    report = verify(dataclasses.replace(SMALL, attention="triton"))
    assert_identical_with_phantoms(report, requests=9)


@pytest.mark.parametrize("policy", policy_names())
def test_every_policy_reproduces_the_never_evicting_run(policy):
    report = verify(dataclasses.replace(SMALL, policy=policy))
    assert report.identical and report.evicted_tokens > 0
    if policy in ("leaf-head-block", "private-head-block"):
        assert report.phantom_tokens > 0


@pytest.mark.parametrize("policy", ["penelope-agent", "oracle"])
def test_hinted_policies_on_two_tiers_reproduce_the_never_evicting_run(policy):
    # The workload tells the cache of arrivals and finishes (`turn_hint`): penelope-agent orders
    # victims and prefetches tool-waiting histories from them, the oracle reads the schedule.
    report = verify(dataclasses.replace(TWO_TIER, policy=policy))
    assert report.identical and report.loads > 0 and report.demotions > 0


def assert_every_tier_move(report):
    assert report.loads > 0 and report.loaded_tokens > 0
    assert report.swap_buffer_loads > 0 and report.swapped_tokens > TWO_TIER.swap_buffer  # several chunks
    assert report.demotions > 0 and report.demoted_tokens > 0
    assert report.plans_run > 0 and report.bytes_moved > 0


@pytest.mark.parametrize("copy", ["naive", "triton"])
def test_two_tier_cache_is_bitwise_identical_with_loads_swaps_and_phantoms(copy):
    report = verify(dataclasses.replace(TWO_TIER, copy=copy))
    assert_identical_with_phantoms(report, requests=9)
    assert_every_tier_move(report)
    assert report.cpu_cache_tokens == 128


def plan_kind(plan):
    if plan.swapped_tokens:
        return "exchange"
    return "load" if len(plan.to_gpu_host) else "demotion"


@pytest.mark.parametrize("skipped", ["exchange", "load", "demotion"])
def test_a_skipped_tier_copy_is_detected(monkeypatch, skipped):
    """The engine must run every plan the cache emits: dropping the first plan of one kind (a
    swap-buffer exchange, a plain load, a demotion) leaves K/V rows that differ from what the cache
    believes, and the outputs differ."""
    run = SwapExecutor.run
    dropped = []

    def skip_first(self, plan):
        if not dropped and plan_kind(plan) == skipped:
            dropped.append(plan)
            return
        run(self, plan)

    monkeypatch.setattr(SwapExecutor, "run", skip_first)
    report = verify(dataclasses.replace(TWO_TIER, copy="naive"))
    assert len(dropped) == 1
    assert not report.identical and not report.bitwise_identical_logprobs
    assert report.max_abs_logprob_diff > 1e-4


def test_cli_two_tier_json_reports_the_tier_moves(tmp_path, capsys):
    out = tmp_path / "verify.json"
    args = ["verify", "--sessions", "3", "--turns", "3", "--cache-tokens", "256", "--cpu-cache", "128",
            "--swap-buffer", "32", "--copy", "triton", "--block-size", "32", "--system-tokens", "64",
            "--message-tokens", "48", "--reply-tokens", "3", "--json", str(out)]
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert CONTRACT <= set(report)
    assert report["identical_tokens"] is True and report["bitwise_identical_logprobs"] is True
    assert report["loads"] > 0 and report["swap_buffer_loads"] > 0 and report["demotions"] > 0
    assert report["phantom_tokens"] > 0 and report["requests"] == 9
    printed = capsys.readouterr().out
    assert "PASS" in printed and "through the swap buffer" in printed and "triton copy" in printed


def skip_phantoms(plans):
    """A broken planner: the real request runs without refilling its holes."""
    return build_batch([dataclasses.replace(plan, segments=[s for s in plan.segments if not s.phantom])
                        for plan in plans])


def shifted_phantoms(plans):
    """A broken planner with an off-by-one: each phantom recomputes its hole with the tokens one
    position later (right slots and positions, wrong tokens)."""
    broken = []
    for plan in plans:
        tokens = plan.tokens.copy()
        for start, end in plan.holes:
            tokens[start:end] = plan.tokens[start + 1 : end + 1]
        broken.append(dataclasses.replace(plan, tokens=tokens))
    return build_batch(broken)


@pytest.mark.parametrize("broken", [skip_phantoms, shifted_phantoms])
def test_a_broken_plan_is_detected(broken):
    good = verify(SMALL)
    assert good.identical and good.phantom_tokens > 0
    report = verify(SMALL, layout_fn=broken)
    assert not report.identical
    assert not report.bitwise_identical_logprobs
    assert report.max_abs_logprob_diff > 1e-4


def test_cli_exits_1_when_outputs_differ(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(penelope.cache.phantom, "build_batch", skip_phantoms)
    out = tmp_path / "verify.json"
    args = ["verify", "--sessions", "3", "--turns", "3", "--cache-tokens", "384", "--block-size", "32",
            "--system-tokens", "64", "--message-tokens", "48", "--reply-tokens", "3", "--json", str(out)]
    assert main(args) == 1
    report = json.loads(out.read_text())
    assert report["bitwise_identical_logprobs"] is False and report["phantom_tokens"] > 0
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--cache-tokens", "512"], "more than --cache-tokens"),
        (["--policy", "fifo"], "unknown policy"),
        (["--sessions", "0"], "sessions must be a positive integer"),
        (["--block-size", "0"], "--block-size must be a positive integer"),
        (["--seed", "-1"], "seed must be a non-negative integer"),
        (["--reply-tokens", "0"], "--reply-tokens must be a positive integer"),
        (["--cpu-cache", "-1"], "--cpu-cache must be a non-negative integer"),
        (["--cpu-cache", "32"], "cpu_cache of 32 tokens is smaller than one block of 64 tokens"),
        (["--cpu-cache", "256", "--swap-buffer", "32"], "swap_buffer of 32 tokens is smaller than one block"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args, message, capsys):
    assert main(["verify", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def record(histories, logprobs, replies):
    return RunRecord([SessionRecord(np.asarray(h), r, lp) for h, lp, r in zip(histories, logprobs, replies,
                                                                               strict=True)])


def rows(*values):
    """A log-softmax row over a 4-token vocabulary whose entry 1 is `value`."""
    return [np.asarray([0.0, v, 0.0, 0.0], dtype=np.float32) for v in values]


def test_compare_runs_flags_one_ulp_missing_positions_and_shared_prefixes():
    history = [[0, 1, 1, 1], [0, 1, 1, 2]]
    # Position p's row depends on tokens 0..p: the sessions share the rows at positions 0..2, so
    # session 1 computed only position 2 itself and takes 0 and 1 from session 0.
    shared_row = rows(-3.0)[0]
    computed = [{0: rows(-1.0), 1: rows(-2.0), 2: [shared_row]}, {2: [shared_row]}]
    reference = record(history, computed, [[1], [2]])
    same = compare_runs(reference, reference)
    assert same["bitwise_identical_logprobs"] and same["identical_tokens"]
    assert same["positions_compared"] == 6 and same["missing_positions"] == 0
    assert same["values_compared"] == 10 and same["recomputed_values"] == 2  # both rows at position 2, twice

    ulp = float(np.nextafter(np.float32(-2.0), np.float32(0.0)))
    recomputed = record(history, [{**computed[0], 1: rows(-2.0, ulp)}, computed[1]], [[1], [2]])
    off = compare_runs(recomputed, reference)
    assert not off["bitwise_identical_logprobs"] and off["identical_tokens"]
    assert off["max_abs_logprob_diff"] == 2.0 + ulp and off["recomputed_values"] == 4

    missing = record(history, [{0: rows(-1.0), 2: [shared_row]}, computed[1]], [[1], [2]])
    gap = compare_runs(missing, reference)
    assert not gap["bitwise_identical_logprobs"] and gap["missing_positions"] == 2

    # Different replies: histories agree on [0, 1, 1] only, so position 2 (scored by token 3) is
    # not compared for session 0; the tokens are reported different.
    diverged = compare_runs(record([[0, 1, 1, 3], history[1]], computed, [[3], [2]]), reference)
    assert not diverged["identical_tokens"] and diverged["bitwise_identical_logprobs"]
    assert diverged["positions_compared"] == 5


@pytest.mark.slow
def test_cli_default_run_on_the_triton_kernel(tmp_path):
    out = tmp_path / "verify.json"
    assert main(["verify", "--attention", "triton", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["bitwise_identical_logprobs"] and report["identical_tokens"] and report["phantom_tokens"] > 0


def test_two_tier_cache_on_the_triton_kernel():
    report = verify(dataclasses.replace(TWO_TIER, attention="triton", copy="triton"))
    assert_identical_with_phantoms(report, requests=9)
    assert_every_tier_move(report)


def test_verify_without_torch_is_one_line():
    """A user who installed penelope-kv without the torch extra gets one line saying what to
    install (exit 2), not a traceback."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "from penelope.cli import main\n"
            "sys.exit(main(['verify', '--sessions', '1']))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr == "penelope: error: verify runs a model and needs torch: pip install 'penelope-kv[torch]'\n"


ROOT = Path(__file__).resolve().parents[2]


class _EnginesWouldStart(Exception):
    """Raised in place of starting SGLang's Engines: the test only looks at what they would get."""


def _sglang_check_spec(argv, monkeypatch):
    """The EngineCheck `penelope verify --engine sglang ...` would hand to the Engines."""
    import penelope.integration.sglang.verify as engine_verify

    seen = {}

    def check(model, spec, progress=None):
        seen["spec"] = spec
        raise _EnginesWouldStart

    monkeypatch.setattr(engine_verify, "check", check)
    # The CUDA cases run on machines without a GPU too.
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    with pytest.raises(_EnginesWouldStart):
        main(["verify", "--engine", "sglang", *argv])
    return seen["spec"]


@pytest.mark.parametrize(("argv", "dtype", "atol"), [
    (["--device", "cuda"], "bfloat16", 0.1),
    (["--device", "cuda", "--atol", "0.02"], "bfloat16", 0.02),
    (["--device", "cuda", "--engine-arg", 'dtype="float32"'], "float32", 1e-3),
    (["--device", "cuda", "--engine-arg", 'dtype="half"'], "float16", 0.05),
])
def test_verify_on_cuda_defaults_to_bf16_with_its_tolerance(argv, dtype, atol, monkeypatch):
    """FA3 and trtllm_mha have no fp32 kernels and the ragged kernel needs 16-bit inputs for
    tensor cores: on CUDA the Engines get bf16 unless --engine-arg dtype says otherwise."""
    spec = _sglang_check_spec(argv, monkeypatch)
    assert (spec.setup.dtype, spec.atol, spec.setup.device) == (dtype, atol, "cuda")
    assert "dtype" not in spec.setup.extra
    assert spec.setup.engine_args("model")["dtype"] == dtype


def test_verify_on_cpu_keeps_fp32(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "engine_stub"))  # the tests' sgl_kernel stand-in
    spec = _sglang_check_spec(["--device", "cpu"], monkeypatch)
    assert (spec.setup.dtype, spec.atol) == ("float32", 1e-3)


def test_the_gpu_smoke_script_runs_the_projects_venv_over_every_configuration(tmp_path):
    """``smoke_gpu.sh --dry-run`` prints its commands (it has not run on a GPU here): the venv's
    python, bf16 on CUDA, phantoms (chunk 4096) on FA3 (SGLang's default on Hopper), trtllm_mha and
    Triton, with and without deterministic inference, the hole-first chunks, the CPU tier and
    SGLang's Triton kernel; every command passes the CLI's own option checks."""
    import shlex

    from penelope.cli import build_parser
    from penelope.commands.verify_sglang import (
        check_engine_arg_keys,
        check_sglang_options,
        engine_args,
        engine_precision,
    )

    venv = tmp_path / "venv"
    run = subprocess.run(["bash", "integration/sglang/smoke_gpu.sh", "--dry-run", str(tmp_path / "out")],
                         cwd=ROOT, env={**os.environ, "PENELOPE_VENV": str(venv)}, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    commands = dict(line.split(": ", 1) for line in run.stdout.strip().splitlines())
    assert list(commands) == ["fa3-chunk256-det", "fa3-phantoms-det", "fa3-phantoms", "fa3-two-tiers",
                              "trtllm-phantoms", "triton-phantoms-det", "triton-phantoms", "triton-sglang-det"]
    configs = {}
    for name, command in commands.items():
        words = shlex.split(command)
        at = words.index(f"{venv}/bin/python")
        assert words[at + 1:at + 3] == ["-m", "penelope.cli"]
        args = build_parser().parse_args(words[at + 3:])
        check_sglang_options(args)
        extra = engine_args(args.engine_arg)
        check_engine_arg_keys(extra)
        assert engine_precision(args.device, extra, args.atol)[0] == "bfloat16"
        configs[name] = (extra.get("attention_backend"), args.chunk, bool(extra.get("enable_deterministic_inference")),
                         args.cpu_cache, words[at - 3])
    phantoms = {(backend, det) for backend, chunk, det, cpu, _ in configs.values() if chunk == 4096}
    assert {(None, True), (None, False), ("trtllm_mha", False), ("triton", True), ("triton", False)} <= phantoms
    assert configs["fa3-chunk256-det"][1] == 256 and configs["fa3-two-tiers"][3] > 0
    assert configs["triton-sglang-det"][4] == "PENELOPE_ATTENTION=sglang"
    assert {attention for *_, attention in configs.values()} == {"PENELOPE_ATTENTION=ragged",
                                                                 "PENELOPE_ATTENTION=sglang"}


@pytest.mark.parametrize(("argv", "message"), [
    (["--policy", "oracle"], "--policy oracle is an offline reference"),
    (["--swap-buffer", "2048"], "--swap-buffer applies to --engine reference only (verify --engine sglang does not"),
])
def test_sglang_engine_options_it_cannot_run_exit_2_before_any_engine(argv, message, capsys):
    assert main(["verify", "--engine", "sglang", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_sglang_on_cuda_without_a_gpu_exits_2_before_any_engine(monkeypatch, capsys):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert main(["verify", "--engine", "sglang", "--device", "cuda"]) == 2
    assert "--device cuda: torch sees no CUDA device" in capsys.readouterr().err
