"""``penelope verify --engine sglang``: SGLang's real Engine with Penelope's cache on a pool small
enough to evict gives the outputs of the same Engine on a pool that never evicts.

One check runs the same ``AgentTraffic`` three times, each Engine in a process of its own
(``engine_check``): Penelope on the small pool, Penelope on a pool holding everything, and
SGLang's default radix cache on the small pool. It compares every request's generated tokens
(identical) and log-probabilities (input, from the tokens new in its turn, and output: within
`atol`) with the never-evicting run, requires every request to finish, and reports the prefill
tokens each cache recomputed because of eviction (its prefill tokens minus the never-evicting
run's; phantoms and hole chunks included). A small pool that never evicted fails the check: it
would pass without testing anything.
"""
from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from penelope.errors import UsageError

from .engine_check import AgentTraffic, EngineSetup

ABORTED = "aborted"


@dataclass(frozen=True)
class EngineCheck:
    """One comparison: the traffic, the small pool's setup (Penelope's cache), extra environment
    variables for the Engine processes, the log-probability tolerance and whether SGLang's
    default cache runs too."""

    traffic: AgentTraffic
    setup: EngineSetup
    env: dict = field(default_factory=dict)
    atol: float = 1e-3
    with_default: bool = True

    def __post_init__(self):
        if self.setup.cache != "penelope":
            raise UsageError("the checked setup must use Penelope's cache")
        if not self.atol >= 0 or not math.isfinite(self.atol):
            raise UsageError(f"atol must be a finite non-negative number, got {self.atol}")

    def reference(self) -> EngineSetup:
        """The setup with a GPU pool that holds the whole traffic (whole pages), no CPU tier."""
        page = self.setup.page_size
        pool = max(self.setup.pool_tokens, -(-self.traffic.peak_tokens() // page) * page)
        return replace(self.setup, pool_tokens=pool, cpu_cache=0)


def run_engine(model: str, traffic: AgentTraffic, setup: EngineSetup, env: dict | None = None,
               timeout: float = 900) -> dict:
    """One Engine run in a child process (``engine_check``); its JSON result. Raises RuntimeError
    with the end of the child's output when it fails or times out. The child and the processes
    SGLang starts form a process group of their own: a timeout, Ctrl-C or SIGTERM here stops the
    whole group, so nothing outlives the check."""
    with tempfile.TemporaryDirectory(prefix="penelope-engine-") as tmp:
        out = Path(tmp) / "run.json"
        command = [sys.executable, "-m", "penelope.integration.sglang.engine_check", "--model", str(model),
                   "--traffic", json.dumps(asdict(traffic)), "--setup", json.dumps(asdict(setup)),
                   "--out", str(out), "--timeout", str(timeout)]
        child_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        if setup.device == "cpu":
            child_env["SGLANG_USE_CPU_ENGINE"] = "1"
        child = subprocess.Popen(command, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, start_new_session=True)
        try:
            output, _ = child.communicate(timeout=timeout + 120)
        except subprocess.TimeoutExpired:
            _stop_group(child)
            raise RuntimeError(f"the {setup.cache} Engine run timed out after {timeout + 120:.0f} s") from None
        except BaseException:
            _stop_group(child)
            raise
        _stop_group(child)
        if child.returncode != 0 or not out.exists():
            raise RuntimeError(f"the {setup.cache} Engine run failed (exit {child.returncode}): "
                               f"{failure_line(output)}; its whole output: {_keep_log(output)}")
        return json.loads(out.read_text())


def failure_line(output: str) -> str:
    """The line of a failed Engine's output that says why: the last exception raised (SGLang's
    scheduler reports it in its own processes' tracebacks), else the last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if _EXCEPTION.match(line)]
    return (errors or lines or ["no output"])[-1]


_EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)|AssertionError)(:|$)")


def _keep_log(output: str) -> str:
    """Write a failed Engine's output to a file of its own (kept after the check) and name it."""
    handle, path = tempfile.mkstemp(prefix="penelope-engine-", suffix=".log")
    with os.fdopen(handle, "w") as log:
        log.write(output)
    return path


def _stop_group(child: subprocess.Popen) -> None:
    """Kill what is left of `child`'s process group (SGLang's scheduler and detokenizer too)."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    child.wait()


def compare(run: dict, reference: dict, atol: float) -> dict:
    """Agreement of `run` with `reference`, request by request (the aborted request excluded)."""
    ours = {r["rid"]: r for r in run["requests"] if r["rid"] != ABORTED}
    theirs = {r["rid"]: r for r in reference["requests"] if r["rid"] != ABORTED}
    finished = sum(r["finish"] == "length" for r in ours.values())
    different, worst, where = [], 0.0, None
    for rid, want in theirs.items():
        got = ours.get(rid)
        if got is None or got["output_ids"] != want["output_ids"]:
            different.append(rid)
            continue
        for kind in ("input_logprobs", "output_logprobs"):
            a, b = got[kind], want[kind]
            if len(a) != len(b):
                different.append(rid)
                break
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                diff = abs((x if x is not None else math.nan) - (y if y is not None else math.nan))
                if not diff <= worst:
                    worst, where = diff, f"{rid} {kind}[{i}]"
    return {"requests": len(theirs), "finished": finished, "unfinished": len(ours) - finished,
            "identical_tokens": not different, "different": different,
            "max_logprob_diff": worst, "max_logprob_diff_at": where,
            "logprobs_within_atol": worst <= atol}


def check(model: str, spec: EngineCheck, timeout: float = 900, progress=None) -> dict:
    """Run `spec` (three Engines, or two without the default cache) and report."""
    say = progress or (lambda message: None)
    say("penelope, small pool")
    small = run_engine(model, spec.traffic, spec.setup, spec.env, timeout)
    say("penelope, never-evicting pool")
    reference = run_engine(model, spec.traffic, spec.reference(), spec.env, timeout)
    runs = {"penelope": small, "reference": reference}
    if spec.setup.cpu_cache:
        say("penelope, small pool without the CPU tier")
        runs["gpu_only"] = run_engine(model, spec.traffic, replace(spec.setup, cpu_cache=0), spec.env, timeout)
    if spec.with_default:
        say("default radix cache, small pool")
        runs["default"] = run_engine(model, spec.traffic, replace(spec.setup, cache="default", cpu_cache=0),
                                     spec.env, timeout)
    baseline = reference["counters"]
    c_lin = _c_lin(model)
    report = {"traffic": asdict(spec.traffic), "setup": asdict(spec.setup), "env": spec.env, "atol": spec.atol,
              "comparison": compare(small, reference, spec.atol), "runs": {}}
    for name, run in runs.items():
        counters = run["counters"] or {}
        tokens = counters.get("prefill_tokens", 0) - baseline["prefill_tokens"]
        positions = counters.get("prefill_positions", 0) - baseline["prefill_positions"]
        report["runs"][name] = {
            "prefill_tokens": counters.get("prefill_tokens"), "recomputed_tokens": tokens,
            "recomputed_cost": tokens * c_lin + positions if c_lin is not None else None,
            "phantom_tokens": counters.get("phantom_tokens"),
            "chunk_refill_tokens": counters.get("chunk_refill_tokens"),
            "ragged_batches": counters.get("ragged_batches"),
            "duplicate_tokens": counters.get("duplicate_tokens"),
            "tiers": {name[5:]: value for name, value in counters.items() if name.startswith("tier_")},
            "evicted_tokens": counters.get("evicted_tokens"), "start_s": round(run["start_s"], 1),
            "serve_s": round(run["serve_s"], 2),
            "aborted": [r["finish"] for r in run["requests"] if r["rid"] == ABORTED]}
        if name == "default":
            report["default_comparison"] = compare(run, reference, spec.atol)
    probes = {r["rid"]: r["output_ids"] for r in reference["requests"] if r["rid"].startswith("probe")}
    report["probe_outputs_differ"] = len(probes) == 2 and probes["probe0"] != probes["probe1"]
    # A small pool that never evicted checked nothing: no hole was refilled, no block loaded.
    small_counters = small["counters"] or {}
    report["evicted_tokens"] = ((small_counters.get("evicted_tokens") or 0)
                                + (small_counters.get("tier_demoted_tokens") or 0))
    comparison = report["comparison"]
    report["passed"] = (comparison["identical_tokens"] and comparison["logprobs_within_atol"]
                        and comparison["unfinished"] == 0 and comparison["requests"] > 0
                        and report["evicted_tokens"] > 0
                        and (report["probe_outputs_differ"] or not spec.traffic.probe))
    return report


def _c_lin(model: str) -> float | None:
    """The model's linear cost per token in attention-pair units (None if its config is unreadable)."""
    from penelope.costmodel.recompute import CostModel
    from penelope.costmodel.shapes import get_model

    try:
        return CostModel(get_model(Path(model) / "config.json")).c_lin
    except (UsageError, OSError):
        return None


def tiny_model(folder: str | Path, seed: int = 0, max_positions: int = 16384) -> Path:
    """A tiny Qwen3 (hidden 64, 2 layers, 4 query and 2 KV heads of 16, vocab 1000) with real
    random weights (std 0.5, as transformers' initializer_range), saved as an HF checkpoint;
    `max_positions` is its context length."""
    from penelope.engine.decoder_config import EngineModelConfig
    from penelope.engine.weights import random_weights, save_checkpoint

    config = EngineModelConfig(vocab_size=1000, hidden_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2,
                               head_dim=16, intermediate_size=128, max_position_embeddings=max_positions,
                               name="penelope-tiny-qwen3")
    return save_checkpoint(folder, config, random_weights(config, seed=seed, init_std=0.5))
