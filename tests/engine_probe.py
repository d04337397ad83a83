"""What the Engine probe scripts share (run in their own processes by tests/sglang/test_engine.py):
a CPU Engine with Penelope's cache, seeded token draws and a blocking call with a timeout."""
import asyncio
import random

import sglang


def cpu_engine(model: str, **args) -> sglang.Engine:
    """SGLang's Engine on CPU in fp32 with Penelope's radix cache; `args` add or override."""
    return sglang.Engine(**{**dict(model_path=model, skip_tokenizer_init=True, dtype="float32", device="cpu",
                                   attention_backend="torch_native", disable_cuda_graph=True, random_seed=0,
                                   radix_cache_backend="penelope", log_level="warning", mem_fraction_static=0.5),
                            **args})


def drawer(seed: int = 0):
    """draw(n): n token ids in [3, 1000) from a generator seeded with `seed`."""
    rng = random.Random(seed)
    return lambda n: [rng.randrange(3, 1000) for _ in range(n)]


def blocking(engine: sglang.Engine):
    """run(coroutine): its result, on the Engine's loop, within 300 s."""
    return lambda coro: engine.loop.run_until_complete(asyncio.wait_for(coro, 300))
