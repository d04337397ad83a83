"""`penelope ab` without SGLang: configuration names -> server options, bad input, the rotated
order, pairing and intervals, the never-evicting prefill floor, and the runner against the
load-generator tests' stand-in server (`tests/loadgen_stub.py`), Ctrl-C included."""
import contextlib
import dataclasses
import json

import pytest
from loadgen_stub import StubServer

from penelope.cli import Terminated, main
from penelope.errors import UsageError
from penelope.loadgen.ab_configs import ServerSetup, TLRUParams, check_applied, make_config, parse_configs
from penelope.loadgen.ab_report import change, estimate, report_payload, report_text
from penelope.loadgen.ab_runner import RESIDENT, ABResult, ABRun, ABRunner, run_order, run_outputs
from penelope.loadgen.prefill_floor import never_evicting_prefill, rebuilt_prompts
from penelope.loadgen.runner import LoadConfig, RunResult, run_load
from penelope.loadgen.summary import summarize
from penelope.loadgen.target import probe_server
from penelope.loadgen.tokens import TokenSpace
from penelope.sim.stats import Estimate, paired_changes
from penelope.sim.workloads.synthetic import SyntheticConfig, generate
from penelope.sim.workloads.types import ThinkTime

SETUP = ServerSetup(model="/m", pool=4096, tlru=TLRUParams(1100, 76))
SMALL = SyntheticConfig(sessions=3, requests_per_session=4, requests_spread=0.0, prefix_tokens=640, max_context=8192,
                        first_prompt_median=300, tool_result_median=80, human_prompt_median=50, output_median=12,
                        summary_median=1000)


def small_workload():
    return ThinkTime(cap=0.0).apply(generate(SMALL))


def option(args, flag):
    return args[args.index(flag) + 1]


def test_configuration_names_give_each_cache_its_options():
    penelope = make_config("penelope", SETUP)
    assert option(penelope.args, "--radix-cache-backend") == "penelope"
    assert json.loads(option(penelope.args, "--radix-eviction-policy-config")) == {"policy": "penelope"}
    ablation = make_config("penelope:leaf-tail-node", SETUP)
    assert json.loads(option(ablation.args, "--radix-eviction-policy-config")) == {"policy": "leaf-tail-node"}
    assert ablation.penelope_policy == "leaf-tail-node" and ablation.slug == "penelope_leaf-tail-node"
    tier = make_config("penelope-tier", SETUP)
    assert json.loads(option(tier.args, "--radix-eviction-policy-config"))["cpu_cache"] == 2 * SETUP.pool
    for policy in ("lru", "lfu", "slru"):
        config = make_config(f"sglang-{policy}", SETUP)
        assert config.args == ("--radix-eviction-policy", policy) and config.penelope_policy is None
    slru = make_config("sglang-slru", dataclasses.replace(SETUP, slru_protected=3))
    assert json.loads(option(slru.args, "--radix-eviction-policy-config")) == {"protected_threshold": 3}
    tlru = make_config("sglang-tlru", SETUP)
    assert json.loads(option(tlru.args, "--radix-eviction-policy-config")) == {"threshold": 1100,
                                                                               "next_prompt_estimate": 76}
    assert tlru.expect["radix_eviction_policy"] == "tlru"
    assert make_config("sglang-session", SETUP).args == ("--enable-session-radix-cache",)
    gpu = dataclasses.replace(SETUP, device="cuda", attention=None)
    assert make_config("sglang-hicache", gpu).args == ("--enable-hierarchical-cache", "--hicache-ratio", "2")
    common = SETUP.common_args()
    assert option(common, "--attention-backend") == "torch_native_prefix"
    assert common.count("--attention-backend") == 1 and option(common, "--device") == "cpu"
    assert option(common, "--max-total-tokens") == "4096" and option(common, "--random-seed") == "0"
    assert "--device" not in gpu.common_args() and "--attention-backend" not in gpu.common_args()


@pytest.mark.parametrize("names, baseline, setup, message", [
    (["penelope", "sglang-fifo"], None, SETUP, "unknown configuration 'sglang-fifo'"),
    (["penelope", "lru"], None, SETUP, "unknown configuration 'lru'"),
    (["penelope:nope", "sglang-lru"], None, SETUP, "unknown eviction policy 'nope'"),
    (["penelope:oracle", "sglang-lru"], None, SETUP, "needs the future"),
    (["penelope:", "sglang-lru"], None, SETUP, "give a policy after the colon"),
    (["sglang-lru:x", "penelope"], None, SETUP, "only penelope and penelope-tier take a :POLICY"),
    (["penelope", "penelope"], None, SETUP, "named twice"),
    (["penelope"], None, SETUP, "at least two configurations"),
    (["penelope", "sglang-lru"], "sglang-lfu", SETUP, "`baseline` 'sglang-lfu' is not one of"),
    (["penelope", "sglang-hicache"], None, SETUP, "sglang-hicache needs a GPU"),
])
def test_bad_configurations_are_one_line(names, baseline, setup, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace("[", r"\[")) as err:
        parse_configs(names, setup, baseline)
    assert "\n" not in str(err.value)


def test_bad_server_setups_are_one_line():
    with pytest.raises(UsageError, match="runs on CPU only"):
        ServerSetup(model="/m", pool=4096, device="cuda")
    with pytest.raises(UsageError, match="must exceed `next_prompt_estimate`"):
        TLRUParams(100, 100)
    with pytest.raises(UsageError, match="set by the A/B runner"):
        ServerSetup(model="/m", pool=4096, extra=("--radix-eviction-policy=lfu",))
    with pytest.raises(UsageError, match="fewer than two pages"):
        ServerSetup(model="/m", pool=16, page=16)


@pytest.mark.parametrize("changes, message", [
    (dict(server_seed=-1), "`server_seed` must be in [0, 2**31), got -1"),
    (dict(page=0), "`page` must be an integer of at least 1, got 0"),
    (dict(host_tokens=True), "`host_tokens` must be an integer of at least 1, got True"),
    (dict(pool=16, page=16), "`pool` 16 holds fewer than two pages of 16 tokens"),
    (dict(device="tpu"), "`device` tpu: choose from cpu, cuda"),
    (dict(device="cuda"), "`attention` torch_native_prefix runs on CPU only (`device` cuda)"),
    (dict(extra=("--random-seed=3",)), "`extra` --random-seed: set by the A/B runner"),
])
def test_the_library_names_the_fields_of_a_server_setup(changes, message):
    """Called as a library, the errors name `ServerSetup`'s fields (the command shows its flags)."""
    with pytest.raises(UsageError) as err:
        ServerSetup(**{"model": "/m", "pool": 4096, **changes})
    assert str(err.value).startswith(message)


def test_the_library_names_the_fields_of_configurations_and_runs():
    gpu = ServerSetup(model="/m", pool=4096, device="cuda", attention=None, host_tokens=100)
    with pytest.raises(UsageError, match=r"sglang-hicache: `host_tokens` \(100\) must exceed the pool \(4096\)"):
        make_config("sglang-hicache", gpu)
    with pytest.raises(UsageError, match="sglang-hicache needs a GPU .*; this run is on `device` cpu"):
        make_config("sglang-hicache", SETUP)
    with pytest.raises(UsageError, match="`repeats` must be at least 1, got 0"):
        run_order(2, 0)
    with pytest.raises(UsageError, match="`warmup` must be a non-negative integer, got -1"):
        ABRunner([], "", small_workload(), LoadConfig(), scale=1.0, seed=0, page=16, out=None, start_server=None,
                 warmup=-1)


@pytest.mark.parametrize("configs, argv, message", [
    ([], ["--server-seed", "-1"], "--server-seed must be in [0, 2**31), got -1"),
    # The workload's seed (`TokenSpace.seed`) is another flag than the servers' (`server_seed`).
    ([], ["--seed", "-1"], "--seed must be an integer in [0, 2**63), got -1"),
    ([], ["--page-size", "0"], "--page-size must be an integer of at least 1, got 0"),
    ([], ["--chunk", "0"], "--chunk must be an integer of at least 1, got 0"),
    ([], ["--slru-protected", "0"], "--slru-protected must be an integer of at least 1, got 0"),
    ([], ["--pool", "16"], "--pool 16 holds fewer than two pages of 16 tokens"),
    ([], ["--device", "cuda", "--attention-backend", "torch_native_prefix"],
     "--attention-backend torch_native_prefix runs on CPU only (--device cuda)"),
    ([], ["--server-arg=--random-seed=3"],
     "--server-arg --random-seed: set by the A/B runner (an option of its own, or a configuration's)"),
    ([], ["--baseline", "sglang-lfu"],
     "--baseline 'sglang-lfu' is not one of the configurations (penelope, sglang-lru)"),
    (["sglang-hicache"], [], "sglang-hicache needs a GPU (SGLang's HiCache moves KV between device and host memory); "
     "this run is on --device cpu"),
    (["sglang-hicache"], ["--device", "cuda", "--host-tokens", "100"],
     "sglang-hicache: --host-tokens (100) must exceed the pool (4096)"),
    ([], ["--model", "scale:0.5"], "--model scale:0.5: the scale must be in [1, 256]"),
    ([], ["--model", "scale:x"], "--model scale:x: expected scale:S with S a number"),
    ([], ["--vocab", str(2**31 + 1)], "--vocab must be an integer in [2, 2**31], got 2147483649"),
    ([], ["--scale", "0.5"], "--scale must be a number of at least 1 (it divides token counts), got 0.5"),
    ([], ["--sessions", "0"], "--sessions must be at least 1, got 0"),
    ([], ["--max-requests", "0"], "--max-requests must be at least 1, got 0"),
    ([], ["--read-timeout", "0"], "--read-timeout must be a positive number of seconds, got 0.0"),
    (["sglang-tlru"], ["--tlru-threshold", "10", "--tlru-next-prompt", "20"],
     "sglang-tlru: --tlru-threshold (10) must exceed --tlru-next-prompt (20)"),
    (["sglang-tlru"], ["--tlru-threshold", "-1", "--tlru-next-prompt", "20"],
     "sglang-tlru: --tlru-threshold must be a non-negative integer, got -1"),
])
def test_the_command_names_the_flags_it_was_given(tmp_path, capsys, configs, argv, message):
    """The library's errors name fields; `penelope ab` shows each as the flag typed (its own name
    or a renamed one: `page` is --page-size, `attention` --attention-backend, `extra` --server-arg)."""
    out = tmp_path / "out"
    assert main(["ab", "penelope", *(configs or ["sglang-lru"]), "--model", "tiny", "--pool", "4096",
                 "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"penelope: error: {message}") and err.count("\n") == 1, err
    assert "`" not in err and not out.exists()


def test_the_command_refuses_bad_input_before_any_server(tmp_path, capsys):
    out = str(tmp_path / "out")
    assert main(["ab", "penelope", "sglang-nope", "--model", "tiny", "--pool", "4096", "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("penelope: error: unknown configuration 'sglang-nope'")
    assert main(["ab", "penelope", "sglang-hicache", "--model", "tiny", "--pool", "4096", "--out", out]) == 2
    assert "needs a GPU" in capsys.readouterr().err
    assert main(["ab", "penelope", "sglang-lru", "--model", "scale:0.5", "--pool", "4096", "--out", out]) == 2
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bad, message", [(["--trace", "/no/such/trace"], "/no/such/trace: no such trace"),
                                          (["--think-time", "sometimes"], "--think-time: cannot read 'sometimes'"),
                                          (["--limit-sessions", "0"], "--limit-sessions must be at least 1"),
                                          (["--warmup", "-1"], "--warmup must be a non-negative integer, got -1"),
                                          (["--format", "mooncake"], "--format mooncake needs a --trace")])
def test_workload_options_are_refused_before_a_model_is_written(tmp_path, capsys, bad, message):
    out = tmp_path / "out"
    assert main(["ab", "penelope", "sglang-lru", "--model", "scale:7", "--pool", "4096", "--out", str(out), *bad]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (out / "model").exists()


def test_no_output_of_the_run_overwrites_an_input_or_lands_in_the_trace_folder(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    trace = out / "records-penelope.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 100, "output_length": 10, "hash_ids": [1]}\n')
    before = trace.read_bytes()
    command = ["ab", "penelope", "sglang-lru", "--model", "scale:7", "--pool", "4096", "--out", str(out)]
    assert main([*command, "--trace", str(trace)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"is the input --trace {trace}; it would be overwritten" in err, err
    assert trace.read_bytes() == before and not (out / "model").exists()
    # A WEKA folder given as both the trace and the output: ab.json would be read as a trace.
    weka = tmp_path / "weka"
    weka.mkdir()
    (weka / "trace_0001.json").write_text("{}")
    assert main(["ab", "penelope", "sglang-lru", "--model", "scale:7", "--pool", "4096", "--out", str(weka),
                 "--trace", str(weka)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ab.json" in err and "is inside the trace folder" in err, err
    assert sorted(p.name for p in weka.iterdir()) == ["trace_0001.json"]


def test_run_outputs_name_every_file_a_run_writes(tmp_path):
    configs = [make_config("penelope", SETUP), make_config("sglang-lru", SETUP)]
    fresh = {p.name for p in run_outputs(tmp_path, configs, 2)}
    assert fresh == {"records-penelope.jsonl", "records-sglang-lru.jsonl", "server-penelope-round0.log",
                     "server-penelope-round1.log", "server-sglang-lru-round0.log", "server-sglang-lru-round1.log"}
    assert {p.name for p in run_outputs(tmp_path, configs, 3, RESIDENT)} == {
        "records-penelope.jsonl", "records-sglang-lru.jsonl", "server-penelope.log", "server-sglang-lru.log"}


def test_check_applied_reads_back_what_the_server_resolved():
    lru = make_config("sglang-lru", SETUP)
    assert check_applied(lru, {"radix_eviction_policy": "lru", "enable_session_radix_cache": False}) == {
        "radix_eviction_policy": "lru", "enable_session_radix_cache": False}
    with pytest.raises(UsageError, match="reports radix_eviction_policy = 'lru', not 'lfu'"):
        check_applied(make_config("sglang-lfu", SETUP), {"radix_eviction_policy": "lru"})
    penelope = make_config("penelope:leaf-head-block", SETUP)
    info = {"radix_cache_backend": "penelope", "internal_states": [{"penelope": {"policy": "leaf-tail-node"}}]}
    with pytest.raises(UsageError, match="reports policy 'leaf-tail-node', not 'leaf-head-block'"):
        check_applied(penelope, info)
    with pytest.raises(UsageError, match="runs Penelope's cache"):
        check_applied(lru, {"radix_eviction_policy": "lru", **info})
    tier = make_config("penelope-tier", SETUP)
    counters = {"policy": "private-head-block", "host_tokens": 8192}
    assert check_applied(tier, {"radix_cache_backend": "penelope", "internal_states": [{"penelope": counters}]}) == {
        "radix_cache_backend": "penelope", "policy": "private-head-block", "host_tokens": 8192}
    counters["host_tokens"] = 0
    with pytest.raises(UsageError, match="a CPU tier of 0 tokens, not 8192"):
        check_applied(tier, {"radix_cache_backend": "penelope", "internal_states": [{"penelope": counters}]})


def test_rounds_rotate_the_order():
    order = run_order(3, 4)
    assert order[:9] == [(0, 0), (0, 1), (0, 2), (1, 1), (1, 2), (1, 0), (2, 2), (2, 0), (2, 1)]
    for r in range(4):
        assert sorted(c for round_, c in order if round_ == r) == [0, 1, 2]
    # Over as many rounds as configurations, each configuration runs once at every place of a round.
    for c in range(3):
        places = [[c2 for r2, c2 in order if r2 == r].index(c) for r in range(3)]
        assert sorted(places) == [0, 1, 2]
    assert run_order(2, 3, servers="kept") == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    with pytest.raises(UsageError):
        run_order(2, 0)


def fake_run(config, round_, ttft, recomputed=None):
    empty = summarize(RunResult(round_, [], 1.0, "done", [], 0))
    summary = dataclasses.replace(empty, ttft_mean=ttft, errors=0)
    computed = None if recomputed is None else recomputed + 1000
    return ABRun(config, round_, 0, summary, computed, 1000 if recomputed is not None else None, 1.0, "log", None)


def test_changes_are_paired_round_by_round():
    configs, _ = parse_configs(["sglang-lru", "penelope"], SETUP, None)
    result = ABResult(configs, "sglang-lru", repeats=4, servers_mode="fresh")
    base = [1.0, 2.0, 4.0, 8.0]
    mine = [0.9, 1.7, 3.7, None]
    for r in range(4):
        result.runs.append(fake_run("sglang-lru", r, base[r], recomputed=100 * (r + 1)))
        if mine[r] is not None:
            result.runs.append(fake_run("penelope", r, mine[r], recomputed=50 * (r + 1)))
    assert result.paired_rounds("penelope") == [0, 1, 2]
    got = change(result, "penelope", "ttft_mean")
    assert got == Estimate.of(paired_changes([0.9, 1.7, 3.7], [1.0, 2.0, 4.0]))
    # Unpaired, the same values' spread would hide the change; paired, every run is 7.5-15% faster.
    assert got.verdict() == "win" and got.high < 0
    assert change(result, "penelope", "recomputed").mean == pytest.approx(-0.5)
    assert estimate(result, "sglang-lru", "ttft_mean").n == 4
    text = report_text(result)
    assert "3 runs" not in text and "7 of 8 runs finished" in text and "changes against sglang-lru" in text
    payload = report_payload(result)
    assert payload["pairs"] == {"penelope": [0, 1, 2]}
    assert payload["changes"]["penelope"]["ttft_mean"]["verdict"] == "win"


def test_the_floor_is_what_a_never_evicting_cache_computes():
    """The prompts rebuilt from the records are the ones the server got; the floor equals a
    brute-force count over them: each prompt less its longest whole-page prefix shared with an
    earlier request's prompt and reply (less the reply's last token), never its last token."""
    workload = small_workload()
    space = TokenSpace(vocab=1000, seed=5, scale=1.0)
    with StubServer() as stub:
        target = probe_server(stub.url, "generate", vocab=1000)
        [result] = run_load(target, workload, space, LoadConfig(sessions=1))
        sent = {b["rid"]: b["input_ids"] for b in stub.requests if b.get("session_id")}
    prompts = rebuilt_prompts(result.records, workload, space)
    by_rid = {r.rid: r for r in result.records}
    assert len(prompts) == len(sent) == workload.num_requests
    for rid, ids in sent.items():
        record = by_rid[rid]
        assert prompts[(record.session_index, record.turn)] == ids
    for page in (1, 16):
        histories, expected = [], 0
        for record in sorted(result.records, key=lambda r: r.sent_at):
            ids = prompts[(record.session_index, record.turn)]
            best = 0
            for seen in histories:
                n = 0
                while n < min(len(seen), len(ids)) and seen[n] == ids[n]:
                    n += 1
                best = max(best, n)
            expected += len(ids) - min(best // page * page, (len(ids) - 1) // page * page)
            histories.append(ids + record.output_ids[:-1])
        assert never_evicting_prefill(result.records, workload, space, page) == expected
    # Page 1, one session at a time: turn t > 0 reuses the previous turn's prompt and reply less one.
    assert never_evicting_prefill(result.records, workload, space, 1) < sum(r.prompt_tokens for r in result.records)


class CountingStub(StubServer):
    """The stand-in, reporting a prefill counter (prompt tokens it did not report as cached) and
    the settings a configuration expects in `/server_info`."""

    def __init__(self, settings, **kwargs):
        super().__init__(**kwargs)
        self.settings = settings
        self.policy = {}
        self.computed = 0

    def cached(self, prompt):
        hit = super().cached(prompt)
        self.computed += len(prompt) - hit
        return hit

    async def server_info(self, request):
        from aiohttp import web

        base = json.loads((await super().server_info(request)).body)
        return web.json_response({**base, **self.settings,
                                  "internal_states": [{"penelope": {"prefill_tokens": self.computed,
                                                                    **self.policy}}]})


def stub_factory(started, interrupt_at=None, stop=KeyboardInterrupt):
    @contextlib.contextmanager
    def start(config, log):
        started.append(config.name)
        if interrupt_at is not None and len(started) == interrupt_at:
            raise stop
        stub = CountingStub(dict(config.expect))
        stub.policy = {"policy": config.penelope_policy} if config.penelope_policy else {}
        with stub:
            yield stub

    return start


def test_runner_interleaves_rounds_and_counts_each_servers_prefill(tmp_path):
    configs, baseline = parse_configs(["sglang-lru", "penelope", "sglang-tlru"], SETUP, None)
    started = []
    runner = ABRunner(configs, baseline, small_workload(), LoadConfig(sessions=2), scale=1.0, seed=5, page=16,
                      out=tmp_path, start_server=stub_factory(started), repeats=2, warmup=1, vocab=1000,
                      say=lambda line: None)
    result = runner.run()
    assert started == ["sglang-lru", "penelope", "sglang-tlru", "penelope", "sglang-tlru", "sglang-lru"]
    assert [(r.config, r.round) for r in result.runs] == [(c, r) for r, c in zip([0, 0, 0, 1, 1, 1], started,
                                                                                  strict=True)]
    assert not result.interrupted
    for run in result.runs:
        assert run.summary.finished == 12 and run.computed > 0
        # The stand-in caches without eviction at token granularity: it computes less than the
        # page-granular floor, never more.
        assert run.recomputed <= 0
    assert result.servers["penelope"]["applied"] == {"radix_cache_backend": "penelope", "policy": "private-head-block"}
    records = (tmp_path / "records-penelope.jsonl").read_text().splitlines()
    assert len(records) == 24
    assert {json.loads(line)["session"].split("#")[1] for line in records} == {"0", "1"}


def test_resident_servers_start_once_stay_up_together_and_keep_the_rounds_interleaved(tmp_path):
    configs, baseline = parse_configs(["sglang-lru", "penelope", "sglang-tlru"], SETUP, None)
    started, up, stubs = [], set(), {}

    @contextlib.contextmanager
    def start(config, log):
        started.append(config.name)
        stub = CountingStub(dict(config.expect))
        stub.policy = {"policy": config.penelope_policy} if config.penelope_policy else {}
        with stub:
            up.add(config.name)
            stubs[config.name] = stub
            try:
                yield stub
            finally:
                up.discard(config.name)

    seen_up = []
    runner = ABRunner(configs, baseline, small_workload(), LoadConfig(sessions=2), scale=1.0, seed=5, page=16,
                      out=tmp_path, start_server=start, repeats=2, servers="resident", warmup=1, warmup_requests=3,
                      vocab=1000, say=lambda line: None, on_record=lambda name, record: seen_up.append(len(up)))
    result = runner.run()
    assert started == ["sglang-lru", "penelope", "sglang-tlru"] and not up
    # Every measured request was served while all three servers were up.
    assert seen_up and set(seen_up) == {3}
    assert [(r.config, r.round) for r in result.runs] == [
        ("sglang-lru", 0), ("penelope", 0), ("sglang-tlru", 0), ("penelope", 1), ("sglang-tlru", 1), ("sglang-lru", 1)]
    assert [r.start_s is not None for r in result.runs] == [True, True, True, False, False, False]
    for name, stub in stubs.items():
        generated = [body for body in stub.requests if body.get("session_id")]
        # One warm-up run of at most 3 requests, then two measured runs of 12, each on a flushed cache.
        assert len(generated) == 3 + 2 * 12, name
        assert stub.flushes >= 3
    assert result.servers_mode == "resident" and report_payload(result)["servers_mode"] == "resident"
    assert all(run.log.endswith(f"server-{run.config}.log") for run in result.runs)


def test_a_server_failing_after_some_runs_keeps_them(tmp_path):
    from penelope.loadgen.server import ServerStartError

    configs, baseline = parse_configs(["sglang-lru", "penelope"], SETUP, None)
    started = []
    runner = ABRunner(configs, baseline, small_workload(), LoadConfig(sessions=2), scale=1.0, seed=5, page=16,
                      out=tmp_path, start_server=stub_factory(started, interrupt_at=3, stop=ServerStartError("gone")),
                      repeats=2, vocab=1000, say=lambda line: None)
    result = runner.run()
    assert len(result.runs) == 2 and str(result.error) == "gone" and not result.interrupted
    assert "stopped by an error, gone" in report_text(result) and report_payload(result)["error"] == "gone"
    # A failure before any run finished is the error itself.
    runner = ABRunner(configs, baseline, small_workload(), LoadConfig(sessions=2), scale=1.0, seed=5, page=16,
                      out=tmp_path, start_server=stub_factory([], interrupt_at=1, stop=ServerStartError("at once")),
                      repeats=2, vocab=1000, say=lambda line: None)
    with pytest.raises(ServerStartError, match="at once"):
        runner.run()


def test_ctrl_c_keeps_the_finished_runs(tmp_path):
    configs, baseline = parse_configs(["sglang-lru", "penelope"], SETUP, None)
    started = []
    runner = ABRunner(configs, baseline, small_workload(), LoadConfig(sessions=2), scale=1.0, seed=5, page=16,
                      out=tmp_path, start_server=stub_factory(started, interrupt_at=3), repeats=2, vocab=1000,
                      say=lambda line: None)
    result = runner.run()
    assert result.interrupted and len(result.runs) == 2
    assert result.paired_rounds("penelope") == [0]
    text = report_text(result)
    assert "2 of 4 runs finished (interrupted" in text and "changes against sglang-lru" in text


@pytest.mark.parametrize("stop, code", [(KeyboardInterrupt, 130), (Terminated, 143)])
def test_the_command_prints_and_writes_what_finished_when_stopped(tmp_path, monkeypatch, capsys, stop, code):
    """`penelope ab` with the stand-in for SGLang: stopped while the third server starts (round 2),
    it prints the table of the round that finished, writes it to ab.json, and exits 130 (Ctrl-C)
    or 143 (SIGTERM)."""
    import penelope.loadgen.ab_runner as ab_runner

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 1000, "max_position_embeddings": 65536}))
    started = []

    def factory(setup, env, timeout):
        return stub_factory(started, interrupt_at=3, stop=stop)

    monkeypatch.setattr(ab_runner, "sglang_server_factory", factory)
    out = tmp_path / "out"
    assert main(["ab", "sglang-lru", "penelope", "--model", str(model), "--pool", "65536", "--limit-sessions", "2",
                 "--turns", "3", "--scale", "16", "--think-time", "cap:0", "--repeat", "2", "--no-plot",
                 "--out", str(out)]) == code
    printed = capsys.readouterr()
    assert "2 of 4 runs finished (interrupted" in printed.out and "changes against sglang-lru" in printed.out
    assert printed.err.strip().endswith(f"{'interrupted' if code == 130 else 'terminated'} after 2 runs; kept in "
                                        f"{out}")
    payload = json.loads((out / "ab.json").read_text())
    assert payload["interrupted"] and [r["config"] for r in payload["runs"]] == ["sglang-lru", "penelope"]
    assert payload["pairs"] == {"penelope": [0]}
    assert payload["setup"]["model_spec"] == str(model)
    assert len((out / "records-penelope.jsonl").read_text().splitlines()) == 6


def test_tlru_defaults_come_from_the_workload():
    from penelope.commands.ab import appended_tokens
    from penelope.loadgen.ab_configs import default_tlru

    assert default_tlru(SETUP, [10, 50, 30]) == TLRUParams(threshold=30 + SETUP.chunk, next_prompt_estimate=30)
    workload = small_workload()
    space = TokenSpace(vocab=1000, scale=2.0)
    added = appended_tokens(workload, space)
    # Three sessions of four turns: three appended counts each, every one a scaled token count.
    assert len(added) == 9 and all(0 <= n < 1000 for n in added)


def test_the_tree_core_is_read_from_the_servers_log(tmp_path):
    from penelope.loadgen.ab_runner import tree_core

    log = tmp_path / "server.log"
    log.write_text("[t] Load weight end.\n[t] Init Unified Radix Cache. Components: (<ComponentType.FULL: 0>,). "
                   "Tree Core: RustUnifiedTreeCore\n")
    assert tree_core(log) == "RustUnifiedTreeCore"
    log.write_text("[t] penelope: cost model ...\n")
    assert tree_core(log) is None and tree_core(tmp_path / "missing.log") is None


def test_the_floor_of_an_open_loop_run_skips_failed_requests(tmp_path):
    """Mooncake JSONL (open loop, every prompt from its own blocks): a failed request leaves the
    floor, the others' prompts are still rebuilt exactly, and a prompt reuses the blocks an
    earlier-sent prompt shares with it."""
    from penelope.sim.workloads.mooncake import load_mooncake

    rows = [{"timestamp": 0, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2]},
            {"timestamp": 100, "input_length": 1024, "output_length": 8, "hash_ids": [1, 3]},
            {"timestamp": 200, "input_length": 1536, "output_length": 8, "hash_ids": [1, 2, 4]}]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    workload = load_mooncake(path)
    space = TokenSpace(vocab=1000, seed=5, scale=4.0)
    with StubServer() as stub:
        target = probe_server(stub.url, "generate", vocab=1000)
        # One session per request in Mooncake JSONL.
        failing = f"{workload.sessions[1].id}#0/0"
        stub.modes[failing] = "http500"
        [result] = run_load(target, workload, space, LoadConfig())
        sent = {b["rid"]: b["input_ids"] for b in stub.requests if b.get("session_id")}
    ok = [r for r in result.records if r.ok]
    assert len(ok) == 2 and all(not r.ok for r in result.records if r.rid == failing)
    prompts = rebuilt_prompts(result.records, workload, space)
    assert {r.rid: prompts[(r.session_index, r.turn)] for r in ok} == {r.rid: sent[r.rid] for r in ok}
    # 128 ids a block at scale 4: 256 computed, then 384 less the first two blocks' 256.
    assert never_evicting_prefill(result.records, workload, space, 16) == 256 + 128


def _checkpoint(tmp_path, vocab=1000, context=65536):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"vocab_size": vocab, "max_position_embeddings": context}))
    return str(model)


def _mooncake(tmp_path, text=None):
    path = tmp_path / "trace.jsonl"
    path.write_text(text if text is not None else "".join(
        json.dumps({"timestamp": 1000 * i, "input_length": 600, "output_length": 8, "hash_ids": [1, 2]}) + "\n"
        for i in range(4)))
    return str(path)


@pytest.mark.parametrize("configs, argv, message", [
    # Options of configurations that are not compared.
    ([], ["--tlru-threshold", "3000"], "--tlru-threshold applies to sglang-tlru only; the configurations are "
     "penelope, sglang-lru"),
    ([], ["--tlru-next-prompt", "30"], "--tlru-next-prompt applies to sglang-tlru only"),
    ([], ["--slru-protected", "3"], "--slru-protected applies to sglang-slru only"),
    ([], ["--host-tokens", "9000"], "--host-tokens applies to penelope-tier or sglang-hicache only"),
    # One T-LRU value alone: the other comes from the workload, but this one is already wrong.
    # (scale:7: the model written, as before these checks, would be the sign of a late check.)
    (["sglang-tlru"], ["--model", "scale:7", "--tlru-threshold", "0"],
     "sglang-tlru: --tlru-threshold (0) must exceed --tlru-next-prompt"),
    (["sglang-tlru"], ["--model", "scale:7", "--tlru-threshold", "-3"],
     "sglang-tlru: --tlru-threshold must be a non-negative integer"),
    (["sglang-tlru"], ["--model", "scale:7", "--tlru-next-prompt", "-1"],
     "sglang-tlru: --tlru-next-prompt must be a non-negative integer"),
    ([], ["--warmup", "0", "--warmup-requests", "3"], "--warmup-requests applies to warm-up runs"),
    ([], ["--startup-timeout", "nan"], "--startup-timeout must be a positive number of seconds, got nan"),
    ([], ["--startup-timeout", "inf"], "--startup-timeout must be a positive number of seconds, got inf"),
    # The model: a path that is no checkpoint, a vocabulary that is not known or too large.
    ([], ["--model", "/no/such/checkpoint"], "--model /no/such/checkpoint: no such checkpoint folder"),
    ([], ["--model", "EMPTY"], "no config.json in this folder (not a checkpoint)"),
    ([], ["--model", "TRACE"], "a file, not a checkpoint folder"),
    ([], ["--model", "Org/Model"], "--model Org/Model: its vocabulary size is not readable here"),
    ([], ["--vocab", "5000"], "--vocab 5000 is larger than the vocabulary of --model"),
    # The workload: a trace that does not parse, options that do not apply to it, an absurd scale,
    # requests the pool cannot hold.
    ([], ["--model", "scale:7", "--trace", "BAD"], "trace.jsonl:1: not valid JSON"),
    ([], ["--trace", "TRACE", "--sessions", "2"], "--sessions applies to closed-loop workloads"),
    ([], ["--trace", "TRACE", "--think-time", "tool"], "--think-time applies to closed-loop workloads"),
    ([], ["--overflow", "drop"], "--overflow applies to WEKA traces only, not to the synthetic workload"),
    ([], ["--model", "scale:7", "--trace", "TRACE", "--prime"], "--prime needs a closed-loop workload"),
    ([], ["--trace", "TRACE", "--scale", "1000"], "--scale 1000 makes every prompt of the workload 1 token"),
    ([], ["--scale", "1e9"], "--scale 1e+09 makes every prompt of the workload 1 token"),
    ([], ["--pool", "256", "--page-size", "16"], "--pool 256: synthetic session 0 request 0: a prompt of"),
])
def test_every_option_is_checked_before_any_server_starts(tmp_path, monkeypatch, capsys, configs, argv, message):
    """Bad values that used to stop the run only once a server had started (or were ignored) are one
    line, exit 2, and no server starts; a trace is read before a model is written."""
    import penelope.loadgen.ab_runner as ab_runner

    started = []

    def no_server(config, log):
        started.append(config.name)
        raise AssertionError(f"a server started for {config.name}")

    monkeypatch.setattr(ab_runner, "sglang_server_factory", lambda setup, env, timeout: no_server)
    (tmp_path / "empty").mkdir()
    places = {"EMPTY": str(tmp_path / "empty"), "TRACE": _mooncake(tmp_path),
              "BAD": _mooncake(tmp_path / "empty", "not json\n")}
    argv = [places.get(a, a) for a in argv]
    if "--model" not in argv:
        argv = ["--model", _checkpoint(tmp_path), *argv]
    out = tmp_path / "out"
    assert main(["ab", "penelope", *(configs or ["sglang-lru"]), "--pool", "65536", "--out", str(out),
                 "--no-progress", "--no-plot", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("penelope: error: ") and message in err and err.count("\n") == 1, err
    assert started == [] and not (out / "model").exists()


def test_a_trace_is_read_before_a_model_is_written(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["ab", "penelope", "sglang-lru", "--model", "scale:7", "--pool", "4096", "--out", str(out),
                 "--trace", _mooncake(tmp_path, '{"timestamp": 0}\n')]) == 2
    assert "trace.jsonl:1:" in capsys.readouterr().err
    assert not (out / "model").exists()
