"""`penelope calibrate` against a stand-in server whose prefill and decode take known times: the
fits recover them (a KV read that grows with the context, a slow first batch of each size, slow
repeats included), the simulator reads the file, a saved points file is refitted without a server,
bad input and poor fits are one line."""
import asyncio
import json

import pytest
from aiohttp import web
from loadgen_stub import StubServer

from penelope.cli import main
from penelope.costmodel.recompute import CostModel
from penelope.costmodel.shapes import get_model
from penelope.sim.calibration import decode_prediction, fastest_repeats, fit_decode, fit_quality, repeat_spread
from penelope.sim.timemodel import TimeModel

# The stand-in's times: a prefill of n new tokens after p cached ones takes
# OVERHEAD + PER_TOKEN * n + PER_PAIR * (n * p + n * (n - 1) / 2); a decode step while requests
# holding c_i KV tokens each are running takes STEP + PER_KV * sum(c_i * (1 + growth * c_i)).
OVERHEAD, PER_TOKEN, PER_PAIR = 0.080, 8e-4, 8e-7
STEP, PER_KV = 0.030, 1.5e-5
PLAN = ["--prefixes", "0,256,1024", "--new-tokens", "16,64,128", "--batches", "1,2,4", "--contexts", "64,256,1024",
        "--decode-tokens", "8", "--repeat", "1"]


def prefill_seconds(n: int, p: int) -> float:
    return OVERHEAD + PER_TOKEN * n + PER_PAIR * (n * p + n * (n - 1) / 2)


class TimedStub(StubServer):
    """The load generator's stand-in server, taking the times above (`flat`: every request the
    same time, whatever its work; `first_slowdown`: the first prefill of each number of new tokens
    takes that many times its time, as a server's first batch of a new shape)."""

    def __init__(self, flat: bool = False, growth: float = 0.0, first_slowdown: float = 1.0, **kwargs):
        super().__init__(**kwargs)
        self.flat, self.growth, self.first_slowdown = flat, growth, first_slowdown
        self.running: dict[int, int] = {}
        self.sizes_seen: set[int] = set()

    async def _stream(self, request, mode, prompt, max_new, chunk, usage=None):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        reply = self.reply(prompt, max_new)
        p = self.cached(prompt)
        self.served.append(prompt + reply)
        n = len(prompt) - p
        slowdown = 1.0 if n in self.sizes_seen else self.first_slowdown
        self.sizes_seen.add(n)
        await asyncio.sleep(0.06 if self.flat else prefill_seconds(n, p) * slowdown)
        self.running[id(request)] = len(prompt)
        try:
            for sent in range(1, max_new + 1):
                if sent > 1:
                    kv_read = sum(c * (1 + self.growth * c) for c in self.running.values())
                    await asyncio.sleep(0.06 if self.flat else STEP + PER_KV * kv_read)
                data = chunk(reply, reply[sent - 1:sent], sent, p, mode)
                await response.write(b"data: " + json.dumps(data).encode() + b"\n\n")
        finally:
            self.running.pop(id(request), None)
        await response.write(b"data: [DONE]\n\n")
        return response


def calibrate(stub, tmp_path, *extra):
    out, points = tmp_path / "cal.json", tmp_path / "points.json"
    code = main(["calibrate", "--url", stub.url, "--model", "qwen3-8b", "--vocab", "1000", "--out", str(out),
                 "--points", str(points), *PLAN, *extra])
    return code, out, points


def fitted_prefill(code: int, out, capsys) -> dict:
    """The calibration a run wrote, its prefill overhead and per-token time within 30% of the
    stand-in's."""
    assert code == 0, capsys.readouterr().err
    fit = json.loads(out.read_text())
    c_lin = CostModel(get_model("qwen3-8b")).c_lin
    assert fit["batch_overhead"] == pytest.approx(OVERHEAD, rel=0.3)
    assert fit["sec_per_linear_unit"] * c_lin == pytest.approx(PER_TOKEN, rel=0.3)
    return fit


def test_the_fits_recover_a_servers_known_times(tmp_path, capsys):
    with TimedStub() as stub:
        code, out, points = calibrate(stub, tmp_path)
    fit = fitted_prefill(code, out, capsys)
    assert fit["sec_per_attention_pair"] == pytest.approx(PER_PAIR, rel=0.3)
    model = TimeModel.from_json(out, "qwen3-8b")
    pairs = 512 * 2048 + 512 * 511 / 2
    assert model.prefill_time(512, pairs) == pytest.approx(prefill_seconds(512, 2048), rel=0.25)
    # Decode: the simulator's step time for 4 requests holding 4,000 KV tokens.
    assert model.decode_step_time(4, 4000) == pytest.approx(STEP + PER_KV * 4000, rel=0.3)
    # A KV read that does not grow with the context is fitted as none (or as one too slight to
    # matter within the contexts measured).
    assert model.decode_step_time(1, 1024) == pytest.approx(STEP + PER_KV * 1024, rel=0.2)
    report = json.loads(points.read_text())
    assert report["quality"]["prefill"]["r2"] > 0.9 and report["quality"]["decode"]["r2"] > 0.9
    assert len(report["prefill"]) == 9 and len(report["decode"]) == 9
    # The stand-in reports no prefill counters: the work is the plan's.
    assert all(not counted for *_, counted in report["prefill"])
    assert sorted({tokens for tokens, *_ in report["prefill"]}) == [16, 64, 128]
    text = capsys.readouterr().out
    assert "prefill: R^2" in text and f"wrote {out}" in text


def test_a_server_whose_times_do_not_follow_the_model_is_refused(tmp_path, capsys):
    with TimedStub(flat=True) as stub:
        code, out, points = calibrate(stub, tmp_path)
    err = capsys.readouterr().err.strip()
    assert code == 2 and "fit is poor" in err and len(err.splitlines()) == 1
    assert not out.exists() and points.exists()


@pytest.mark.parametrize("argv, message", [
    (["--url", "http://127.0.0.1:9"], "127.0.0.1:9"),
    (["--prefixes", "a"], "--prefixes: cannot read 'a'"),
    (["--new-tokens", ""], "--new-tokens"),
    (["--model", "no-such-model"], "--model 'no-such-model' is not a built-in model"),
    (["--contexts", "200000"], "--contexts + --decode-tokens: a decode point of 200,032 tokens does not fit the "
     "server's context"),
    (["--prefixes", "200000"], "--prefixes + --new-tokens: a prefill point of 201,024 tokens does not fit the "
     "server's context"),
])
def test_bad_input_is_one_line(tmp_path, capsys, argv, message):
    with TimedStub(max_input=100_000) as stub:
        args = {"--url": stub.url, "--model": "qwen3-8b", "--out": str(tmp_path / "c.json")}
        for flag, value in zip(argv[::2], argv[1::2], strict=True):
            args[flag] = value
        code = main(["calibrate", *[x for kv in args.items() for x in kv], "--vocab", "1000"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and "Traceback" not in err and len(err.splitlines()) == 1
    assert not (tmp_path / "c.json").exists()


def test_decode_fit_reads_the_bandwidth_from_the_kv_slope():
    kv_bytes = 1000.0
    steps = [(b, kv, STEP + PER_KV * kv) for b in (1, 2, 4) for kv in (1000, 4000, 16000)]
    fit = fit_decode(steps, kv_bytes)
    assert fit["hbm_bandwidth"] == pytest.approx(kv_bytes / PER_KV) and fit["decode_overhead"] == pytest.approx(STEP)
    predicted = decode_prediction(fit, [s[0] for s in steps], [s[1] for s in steps])
    assert fit_quality(predicted, [s[2] for s in steps])["max_relative_error"] < 1e-9
    # Steps that do not grow with the KV give no bandwidth.
    assert fit_decode([(b, kv, 0.01) for b, kv, _ in steps], kv_bytes) == {}


def test_the_models_config_is_never_written_over(tmp_path, capsys):
    folder = tmp_path / "model"
    folder.mkdir()
    config = {"hidden_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
              "head_dim": 128, "intermediate_size": 1536, "vocab_size": 1000, "model_type": "qwen3"}
    (folder / "config.json").write_text(json.dumps(config))
    for flag in ("--out", "--points"):
        with TimedStub() as stub:
            argv = ["calibrate", "--url", stub.url, "--model", str(folder), "--vocab", "1000", *PLAN,
                    "--out", str(tmp_path / "c.json"), flag, str(folder / "config.json")]
            assert main(argv) == 2
        err = capsys.readouterr().err
        assert "config.json" in err and len(err.strip().splitlines()) == 1
        assert json.loads((folder / "config.json").read_text()) == config


def test_a_server_whose_tokens_arrive_together_is_one_line(tmp_path, capsys):
    """The plain stand-in answers at once: decode steps take no measurable time and prefill times
    do not follow the work; no traceback, nothing written."""
    with StubServer() as stub:
        code, out, _ = calibrate(stub, tmp_path)
    captured = capsys.readouterr()
    assert code == 2 and "Traceback" not in captured.err and len(captured.err.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("argv, message", [
    (["--prefixes", "0", "--new-tokens", "16,64", "--repeat", "1"],
     "--prefixes x --new-tokens x --repeat gives fewer than 3 prefill points: the fit of 3 constants needs at least 3"),
    (["--contexts", "64", "--batches", "1", "--repeat", "2"],
     "--contexts x --batches x --repeat gives fewer than 3 decode points: the fit of 3 constants needs at least 3"),
    (["--decode-tokens", "1"], "--decode-tokens must be at least 2 (a step is the time between two tokens), got 1"),
    (["--repeat", "0"], "--repeat must be at least 1, got 0"),
    (["--seed", "-1"], "--seed must be an integer in [0, 2**63), got -1"),
    (["--vocab", "99999999999"], "--vocab must be in [3, 2**31], got 99999999999"),
    (["--vocab", "2"], "--vocab must be in [3, 2**31], got 2"),
])
def test_a_plan_too_small_to_fit_is_refused_before_the_server_is_asked(tmp_path, capsys, argv, message):
    # An unreachable server: the plan is refused first.
    code = main(["calibrate", "--url", "http://127.0.0.1:9", "--model", "qwen3-8b", "--out", str(tmp_path / "c.json"),
                 *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and "127.0.0.1:9" not in err


def test_the_plan_names_its_fields_and_the_command_its_flags(tmp_path, capsys):
    """Called as a library, `CalibrationPlan` and the probe name their fields; `penelope calibrate`
    shows each as the flag typed."""
    from penelope.errors import UsageError
    from penelope.loadgen.calibrate import CalibrationPlan
    from penelope.loadgen.target import Target

    for plan, message in ((dict(prefixes=(0,), new_tokens=(16, 64), repeat=1),
                           "`prefixes` x `new_tokens` x `repeat` gives fewer than 3 prefill points"),
                          (dict(decode_tokens=1), "`decode_tokens` must be at least 2"),
                          (dict(batches=(0, 1)), "`batches`: give positive token counts, got [0, 1]")):
        with pytest.raises(UsageError) as err:
            CalibrationPlan(**plan)
        assert str(err.value).startswith(message)
    target = Target(url="http://127.0.0.1:9", api="generate", vocab=1000, max_total=16_400)
    with pytest.raises(UsageError, match="^`prefixes` \\+ `new_tokens`: a prefill point of 17,408 tokens"):
        CalibrationPlan().check(target)
    with pytest.raises(UsageError, match="^`contexts` \\+ `decode_tokens`: a decode point of 16,416 tokens"):
        CalibrationPlan(prefixes=(0, 1024)).check(target)
    out = str(tmp_path / "c.json")
    assert main(["calibrate", "--url", "ftp://127.0.0.1:9", "--model", "qwen3-8b", "--out", out]) == 2
    assert capsys.readouterr().err == "penelope: error: --url ftp://127.0.0.1:9: expected http://HOST:PORT\n"
    with TimedStub() as stub:
        assert main(["calibrate", "--url", stub.url, "--model", "qwen3-8b", "--out", out, *PLAN]) == 2
    err = capsys.readouterr().err
    assert "does not say its vocabulary size" in err and "; give --vocab N (ids at or above it crash" in err, err


def test_a_server_failing_mid_run_is_a_fault_and_keeps_the_points(tmp_path, capsys):
    with TimedStub() as stub:
        stub.modes = {"calibrate-5": "http500"}
        code, out, points = calibrate(stub, tmp_path)
    err = capsys.readouterr().err.strip()
    assert code == 1 and "failed a calibration request" in err and len(err.splitlines()) == 1
    assert not out.exists()
    kept = json.loads(points.read_text())
    assert len(kept["prefill"]) == 4 and kept["decode"] == [] and "HTTP 500" in kept["stopped"]


def known_points(flat: bool = False) -> dict:
    """A points file as `--points` writes it, of a server taking the stand-in's times exactly
    (`flat`: every request the same time, whatever its work: a fit that explains nothing)."""
    c_lin = CostModel(get_model("qwen3-8b")).c_lin
    prefill = [[n, n * p + n * (n - 1) // 2, 0.05 + 0.01 * (i % 2) if flat else
                OVERHEAD + PER_TOKEN * n + PER_PAIR * (n * p + n * (n - 1) / 2), True]
               for i, (p, n) in enumerate((p, n) for p in (0, 256, 1024) for n in (16, 64, 128))]
    decode = [[b, kv, 0.05 + 0.01 * (b % 2) if flat else STEP + PER_KV * kv] for b in (1, 2, 4)
              for kv in (100, 400, 1600)]
    return {"server": {"url": "http://127.0.0.1:1"}, "model": "qwen3-8b", "c_lin": c_lin, "prefill": prefill,
            "decode": decode}


def test_a_points_file_is_fitted_without_a_server(tmp_path, capsys):
    points = tmp_path / "points.json"
    points.write_text(json.dumps(known_points()))
    out = tmp_path / "cal.json"
    assert main(["calibrate", "--from-points", str(points), "--model", "qwen3-8b", "--out", str(out)]) == 0
    fit = json.loads(out.read_text())
    c_lin = CostModel(get_model("qwen3-8b")).c_lin
    assert fit["batch_overhead"] == pytest.approx(OVERHEAD, rel=1e-6)
    assert fit["sec_per_linear_unit"] * c_lin == pytest.approx(PER_TOKEN, rel=1e-6)
    assert fit["sec_per_attention_pair"] == pytest.approx(PER_PAIR, rel=1e-6)
    assert TimeModel.from_json(out, "qwen3-8b").decode_step_time(4, 4000) == pytest.approx(STEP + PER_KV * 4000)
    assert "poor fit" not in fit["source"] and str(points) in fit["source"]
    assert "prefill: R^2 1.000" in capsys.readouterr().out


def test_a_poor_fit_from_points_is_refused_or_written_labelled(tmp_path, capsys):
    points = tmp_path / "points.json"
    points.write_text(json.dumps(known_points(flat=True)))
    out = tmp_path / "cal.json"
    argv = ["calibrate", "--from-points", str(points), "--model", "qwen3-8b", "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "fit is poor" in err and len(err.splitlines()) == 1 and not out.exists()
    assert main([*argv, "--accept-poor-fit"]) == 0
    source = json.loads(out.read_text())["source"]
    assert "poor fit: prefill R^2" in source and "--accept-poor-fit" in source
    TimeModel.from_json(out, "qwen3-8b")
def test_a_kv_read_that_grows_with_the_context_is_fitted_and_refitted_from_the_points(tmp_path, capsys):
    growth = 1 / 256
    with TimedStub(growth=growth) as stub:
        code, out, points = calibrate(stub, tmp_path)
    assert code == 0, capsys.readouterr().err
    fit = json.loads(out.read_text())
    assert fit["kv_read_growth"] == pytest.approx(growth, rel=0.35)
    model = TimeModel.from_json(out, "qwen3-8b")
    # One request of 1,024 tokens reads its KV at 5 times a short request's cost; four of 512 at 3.
    assert model.decode_step_time(1, 1024) == pytest.approx(STEP + PER_KV * 1024 * 5, rel=0.2)
    assert model.decode_step_time(4, 2048) == pytest.approx(STEP + PER_KV * 2048 * 3, rel=0.2)
    assert json.loads(points.read_text())["quality"]["decode"]["r2"] > 0.95
    # The same points refitted without the server give the same calibration.
    again = tmp_path / "again.json"
    assert main(["calibrate", "--from-points", str(points), "--model", "qwen3-8b", "--out", str(again)]) == 0
    refit = json.loads(again.read_text())
    assert refit.pop("source") == f"penelope calibrate --from-points {points}"
    assert refit == {key: value for key, value in fit.items() if key != "source"}


def test_the_first_batch_of_each_size_is_warmed_up_before_the_points(tmp_path, capsys):
    """The stand-in's first prefill of each size takes 4 times its time: with one repeat per
    point, only the warm-up keeps those first batches out of the points."""
    with TimedStub(first_slowdown=4.0) as stub:
        code, out, points = calibrate(stub, tmp_path)
    fitted_prefill(code, out, capsys)
    measured = {(tokens, pairs): seconds for tokens, pairs, seconds, _ in json.loads(points.read_text())["prefill"]}
    # The first point of each size (no prefix) took its own time, not 4 times it.
    for n in (16, 64, 128):
        assert measured[(n, n * (n - 1) // 2)] == pytest.approx(prefill_seconds(n, 0), rel=0.5)
    assert "warm-up" in capsys.readouterr().out


def test_decode_fit_recovers_a_known_kv_read_growth():
    kv_bytes, per_request = 1000.0, 2e-3
    # 1 / 4,000 lies on the fit's grid of growths for these contexts, the others between its points.
    for growth, tolerance in ((1 / 4000, 1e-6), (1 / 5000, 1e-4), (1 / 300, 1e-4)):
        steps = [(b, b * c, STEP + per_request * b + PER_KV * b * c * (1 + growth * c))
                 for b in (1, 2, 4) for c in (1000, 4000, 16000)]
        fit = fit_decode(steps, kv_bytes)
        assert fit["kv_read_growth"] == pytest.approx(growth, rel=tolerance)
        assert fit["hbm_bandwidth"] == pytest.approx(kv_bytes / PER_KV, rel=tolerance)
        assert fit["decode_overhead"] == pytest.approx(STEP, rel=tolerance)
        assert fit["embedding_row_bytes"] / fit["hbm_bandwidth"] == pytest.approx(per_request, rel=tolerance)
        predicted = decode_prediction(fit, [s[0] for s in steps], [s[1] for s in steps])
        assert fit_quality(predicted, [s[2] for s in steps])["max_relative_error"] < tolerance
        # The simulator's step time is the fit's.
        model = TimeModel.estimate("qwen3-8b")
        model = type(model)(**{**model.as_dict(), **{k: v for k, v in fit.items() if k != "weight_bytes"},
                               "weight_bytes": 0.0})
        assert model.decode_step_time(2, 8000) == pytest.approx(decode_prediction(fit, [2], [8000])[0], rel=1e-12)


def test_the_fits_take_the_fastest_repeat_of_each_point():
    points = [(1, 10, 0.5), (1, 10, 0.2), (2, 10, 0.3), (1, 10, 0.25), (3, 10, 0.0)]
    assert fastest_repeats(points) == [(1, 10, 0.2), (2, 10, 0.3)]
    assert repeat_spread(points) == pytest.approx((1.5, 1.5))
    assert repeat_spread([(1, 10, 0.5), (2, 10, 0.3)]) is None


def synthetic_points(path, c_lin, growth=1 / 4000, slow=3.0):
    """A points file of exact times (the stand-in's, with a KV read growth), every point measured
    twice, the first repeat `slow` times slower."""
    prefill, decode = [], []
    for p in (0, 1024, 4096):
        for n in (64, 256, 1024):
            seconds = prefill_seconds(n, p)
            prefill += [[n, n * p + n * (n - 1) // 2, seconds * slow, False],
                        [n, n * p + n * (n - 1) // 2, seconds, False]]
    for b in (1, 2, 4):
        for c in (1000, 4000, 16000):
            seconds = STEP + PER_KV * b * c * (1 + growth * c)
            decode += [[b, b * c, seconds * slow], [b, b * c, seconds]]
    path.write_text(json.dumps({"model": "qwen3-8b", "c_lin": c_lin, "prefill": prefill, "decode": decode}))


def test_a_refit_into_dev_null_shows_the_fit_and_writes_nothing(tmp_path, capsys):
    # A dry run: the fit is printed, the device takes the JSON, nothing is read back from it.
    synthetic_points(tmp_path / "points.json", CostModel(get_model("qwen3-8b")).c_lin)
    assert main(["calibrate", "--from-points", str(tmp_path / "points.json"), "--model", "qwen3-8b",
                 "--out", "/dev/null"]) == 0
    captured = capsys.readouterr()
    assert "prefill: R^2 1.000" in captured.out and "wrote /dev/null" in captured.out and not captured.err


def test_a_saved_points_file_is_refitted_without_a_server(tmp_path, capsys):
    c_lin = CostModel(get_model("qwen3-8b")).c_lin
    synthetic_points(tmp_path / "points.json", c_lin)
    out = tmp_path / "cal.json"
    assert main(["calibrate", "--from-points", str(tmp_path / "points.json"), "--model", "qwen3-8b",
                 "--out", str(out)]) == 0
    fit = json.loads(out.read_text())
    assert fit["batch_overhead"] == pytest.approx(OVERHEAD, rel=1e-6)
    assert fit["sec_per_linear_unit"] * c_lin == pytest.approx(PER_TOKEN, rel=1e-6)
    assert fit["sec_per_attention_pair"] == pytest.approx(PER_PAIR, rel=1e-6)
    assert fit["decode_overhead"] == pytest.approx(STEP, rel=1e-6)
    assert fit["kv_read_growth"] == pytest.approx(1 / 4000, rel=1e-6)
    text = capsys.readouterr().out
    assert "prefill: R^2 1.000" in text and "decode: R^2 1.000" in text
    assert "differ by 200% in the median" in text


@pytest.mark.parametrize("content, argv, message", [
    (None, [], "points file not found"),
    ("{", [], "points file"),
    ("[]", [], "expected a JSON object with lists 'prefill' and 'decode' (the points file penelope calibrate writes)"),
    ('{"c_lin": C, "prefill": [[1, 2]], "decode": []}', [], "prefill[0] is [1, 2], expected"),
    ('{"c_lin": C, "prefill": [], "decode": [[0, 10, 0.1]]}', [], "decode[0] is [0, 10, 0.1], expected"),
    ('{"c_lin": C, "prefill": [], "decode": [[1, 0, 0.1], [2, 10, 0.2], [4, 20, 0.3]]}', [],
     "decode[0] is [1, 0, 0.1], expected"),
    ('{"c_lin": C, "prefill": [], "decode": []}', ["--accept-poor-fit", ""], "0 prefill points"),
    ('{"c_lin": C, "prefill": [[0, 0, 0.1, true], [0, 0, 0.2, true], [0, 0, 0.3, true]], "decode": []}', [],
     "0 prefill points"),
    ('{"c_lin": C, "prefill": [[64, 2016, 0.1, true], [64, 2016, 0.2, true], [256, 32640, 0.0, true]], '
     '"decode": []}', ["--accept-poor-fit", ""], "1 prefill points"),
    ('{"c_lin": 1.5, "prefill": [], "decode": []}', [], "measured for a model of 1.5 linear units per token"),
    ('{"c_lin": C, "prefill": [], "decode": []}', ["--out", "POINTS"], "--out"),
    ('{"c_lin": C, "prefill": [], "decode": []}', ["--url", "http://127.0.0.1:9"], "not allowed with argument"),
])
def test_a_bad_points_file_is_one_line(tmp_path, capsys, content, argv, message):
    points = tmp_path / "points.json"
    if content is not None:
        points.write_text(content.replace("C", str(CostModel(get_model("qwen3-8b")).c_lin)))
    args = {"--from-points": str(points), "--model": "qwen3-8b", "--out": str(tmp_path / "c.json")}
    for flag, value in zip(argv[::2], argv[1::2], strict=True):
        args[flag] = str(points) if value == "POINTS" else value
    # A flag without a value is given with "".
    code = main(["calibrate", *[x for kv in args.items() for x in kv if x != ""]])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "c.json").exists()
    if content is not None:
        assert points.read_text() == content.replace("C", str(CostModel(get_model("qwen3-8b")).c_lin))


def test_calibrate_needs_a_server_or_a_points_file(tmp_path, capsys):
    assert main(["calibrate", "--model", "qwen3-8b", "--out", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "one of the arguments --url --from-points is required" in err and len(err.splitlines()) == 1


def test_a_constant_the_points_leave_at_zero_keeps_its_estimate_and_the_fit_is_scored_with_it(tmp_path, capsys):
    """Prefill times that do not grow with attention pairs fit sec_per_attention_pair = 0, which a
    time model cannot take: it is not written, the simulator keeps its estimate, and the R^2
    printed is that of the times the simulator will predict."""
    data = known_points()
    for point in data["prefill"]:
        point[2] = OVERHEAD + PER_TOKEN * point[0]
    points = tmp_path / "points.json"
    points.write_text(json.dumps(data))
    out = tmp_path / "cal.json"
    assert main(["calibrate", "--from-points", str(points), "--model", "qwen3-8b", "--out", str(out),
                 "--accept-poor-fit"]) == 0
    text = capsys.readouterr().out
    assert "sec_per_attention_pair" not in json.loads(out.read_text())
    model = TimeModel.from_json(out, "qwen3-8b")
    assert "sec_per_attention_pair: the points leave it at zero; the simulator keeps its estimate " \
           f"{model.sec_per_attention_pair:.4g}" in text
    predicted = [model.prefill_time(n, pairs) for n, pairs, _, _ in data["prefill"]]
    expected = fit_quality(predicted, [p[2] for p in data["prefill"]])
    assert f"prefill: R^2 {expected['r2']:.3f}, largest relative error {expected['max_relative_error']:.1%}" in text


@pytest.mark.parametrize("change", [
    lambda p: p["prefill"][0].__setitem__(0, 10**400),
    lambda p: [point.__setitem__(2, point[2] * 1e-300) for point in p["prefill"]],
])
def test_points_out_of_any_plausible_range_are_one_line(tmp_path, capsys, change):
    data = known_points()
    change(data)
    points = tmp_path / "points.json"
    points.write_text(json.dumps(data))
    code = main(["calibrate", "--from-points", str(points), "--model", "qwen3-8b", "--out", str(tmp_path / "c.json")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
