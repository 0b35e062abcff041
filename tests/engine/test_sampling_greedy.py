"""The all-greedy decode program samples by argmax alone (`greedy_tokens`): it must give the tokens `sample` gives
rows at temperature 0, penalties included, exact ties included (the lower id wins in both)."""

import jax
import jax.numpy as jnp
import numpy as np

from fnx.engine.sampling import SamplingArrays, SamplingParams, greedy_tokens, row_keys, sample


def test_greedy_tokens_equal_sample_at_temperature_zero():
    rng = np.random.default_rng(0)
    b, v = 6, 300
    logits = rng.standard_normal((b, v)).astype(np.float32)
    logits[2, [7, 250]] = 9.0                         # an exact tie: both paths must take id 7
    logits[3, [40, 41]] = 9.0                         # a tie that a penalty on 40 breaks towards 41
    seen = np.zeros((b, v), bool)
    counts = np.zeros((b, v), np.int32)
    seen[3, 40] = True
    counts[3, 40] = 2
    seen[1, rng.integers(0, v, 50)] = True
    counts[1, rng.integers(0, v, 30)] = 3
    params = [SamplingParams(temperature=0.0, top_k=5, top_p=0.9),
              SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5),
              SamplingParams(temperature=0.0, min_p=0.2),
              SamplingParams(temperature=0.0, presence_penalty=2.0)]
    sp = SamplingArrays.stack(params)
    keys = row_keys(jnp.arange(b, dtype=jnp.uint32), jnp.zeros((b,), jnp.uint32))
    want, _ = sample(jnp.asarray(logits), sp, keys, jnp.asarray(seen), jnp.asarray(counts))
    got = greedy_tokens(jnp.asarray(logits), sp, jnp.asarray(seen), jnp.asarray(counts))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert int(got[2]) == 7 and int(got[3]) == 41
    # without penalties the plain argmax
    np.testing.assert_array_equal(np.asarray(greedy_tokens(jnp.asarray(logits), sp)),
                                  np.asarray(jax.numpy.argmax(jnp.asarray(logits), -1)))
