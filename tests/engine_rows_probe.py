"""Run by tests/sglang/test_engine.py in its own process: SGLang's real Engine on CPU with two
request rows, where a request with one hole (one phantom) and a fresh request arrive together.
Prints a JSON line: finish reasons, cached tokens and the phantoms run."""
import json
import sys

from engine_probe import blocking, cpu_engine, drawer


def main(model: str) -> None:
    engine = cpu_engine(model, max_total_tokens=1024, page_size=16, chunked_prefill_size=-1, max_running_requests=2)
    draw, run = drawer(), blocking(engine)
    params = {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}
    try:
        system = draw(128)
        first = system + draw(400)
        out = run(engine.async_generate(input_ids=first, sampling_params=params))
        # Two other histories push the front of the first one's private history out.
        run(engine.async_generate(input_ids=system + draw(400), sampling_params=params))
        run(engine.async_generate(input_ids=system + draw(200), sampling_params=params))
        both = run(engine.async_generate(input_ids=[first + out["output_ids"] + draw(30), draw(40)],
                                         sampling_params=params))
        counters = engine.get_server_info()["internal_states"][0]["penelope"]
    finally:
        engine.shutdown()
    print(json.dumps({"finished": [r["meta_info"]["finish_reason"]["type"] for r in both],
                      "cached": [r["meta_info"]["cached_tokens"] for r in both], "phantoms": counters["phantoms"]}))


if __name__ == "__main__":
    main(sys.argv[1])
