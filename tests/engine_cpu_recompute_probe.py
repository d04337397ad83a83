"""Run by tests/sglang/test_engine.py in its own process: SGLang's real Engine on CPU with a CPU
tier and chunks of 128 tokens. A history is pushed to the CPU tier by two others, then sent again
asking for log-probabilities from its first token: SGLang matches none of it, so its chunks
compute and insert blocks the CPU tier holds (this stopped the scheduler before). Prints a JSON
line: finish reasons, the largest difference of the recomputed input log-probabilities from the
first run's, and the tier counters."""
import json
import sys

from engine_probe import blocking, cpu_engine, drawer


def main(model: str) -> None:
    engine = cpu_engine(model, max_total_tokens=2048, page_size=64, chunked_prefill_size=128, max_running_requests=4,
                        radix_eviction_policy_config={"policy": "penelope", "cpu_cache": 2048})
    draw, run = drawer(), blocking(engine)
    params = {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}
    history = draw(700)
    try:
        first = run(engine.async_generate(input_ids=history, sampling_params=params, return_logprob=True,
                                          logprob_start_len=0))
        others = [run(engine.async_generate(input_ids=draw(900), sampling_params=params)) for _ in range(2)]
        before = engine.get_server_info()["internal_states"][0]["penelope"]
        again = run(engine.async_generate(input_ids=history[:400], sampling_params=params, return_logprob=True,
                                          logprob_start_len=0))
        counters = engine.get_server_info()["internal_states"][0]["penelope"]
    finally:
        engine.shutdown()
    want = [x[0] for x in first["meta_info"]["input_token_logprobs"]][:400]
    got = [x[0] for x in again["meta_info"]["input_token_logprobs"]]
    diff = max(abs((a if a is not None else 0.0) - (b if b is not None else 0.0))
               for a, b in zip(got, want, strict=True))
    print(json.dumps({"finished": [r["meta_info"]["finish_reason"]["type"] for r in (first, *others, again)],
                      "max_logprob_diff": diff, "demoted_before": before["tier_demoted_tokens"],
                      "replaced_host_tokens": counters["tier_replaced_host_tokens"]}))


if __name__ == "__main__":
    main(sys.argv[1])
