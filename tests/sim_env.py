"""Requests for the simulator's scheduler tests."""
import numpy as np

from penelope.sim.workloads.types import HUMAN, Request


def sim_request(keys, input_tokens: int, output_tokens: int = 1, *, tail_key: int, source: str,
                output_blocks=None) -> Request:
    """A human turn whose prompt is blocks `keys` then unique tail tokens (`tail_key`) up to
    `input_tokens`, and `output_blocks` naming its reply's blocks, if given."""
    return Request(keys=np.asarray(keys, dtype=np.int64), input_tokens=input_tokens, output_tokens=output_tokens,
                   think_time=0.0, arrival=None, kind=HUMAN, tail_key=tail_key, source=source,
                   output_blocks=None if output_blocks is None else np.asarray(output_blocks, dtype=np.int64))
