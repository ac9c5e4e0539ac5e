"""Audit 14 of generation's KV cache where the other cache tests do not reach: every shipped tiny
preset as shipped (`tiny` included, whose logits no cache test compared), read one token at a
time from a one-token prompt past tiny-deepseek's YaRN pre-training length and tiny-mixtral's
sliding window (both 64 positions), against the reference a cache must reproduce by definition:
the no-cache forward over each position's prefix alone (not the causal forward over the whole
sequence, whose own mask the cache's shares its code with). And `sample` where the cache fills
with the prompt itself (prompt as long as the context, 1 included).

B batch, S sequence, V vocabulary.
"""

import pytest
import torch

from moefold.generate import sample
from test_kv_cache import _model, _sample_by_full_forwards

VOCAB = 97
SEQ = 70  # past 64: tiny-deepseek's rope_original_max_len, tiny-mixtral's sliding_window
PREFIXES = [1, 2, 3, 63, 64, 65, 66, SEQ]  # around both 64s, where YaRN's and the window's effects start
SHIPPED = ["tiny", "tiny-deepseek", "tiny-mixtral", "tiny-qwen3"]


def _shipped_model(preset: str):
    """The preset as shipped, in fp64, its 1-d weights (norms, expert bias) off their defaults."""
    return _model(preset, {})


@pytest.mark.parametrize("preset", SHIPPED)
def test_each_token_decoded_alone_has_the_logits_of_the_forward_over_its_prefix(preset):
    model = _shipped_model(preset)
    ids_BS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache(SEQ)
    with torch.no_grad():
        decoded_BSV = torch.cat([model.decode(ids_BS[:, i:i + 1], cache) for i in range(SEQ)], dim=1)
        for length in PREFIXES:
            prefix_last_BV = model(ids_BS[:, :length])[:, -1]
            torch.testing.assert_close(decoded_BSV[:, length - 1], prefix_last_BV, rtol=1e-9, atol=1e-10,
                                       msg=lambda m, length=length: f"{preset}, position {length - 1}: {m}")


@pytest.mark.parametrize("prompt_len", [1, 6])
def test_a_prompt_that_fills_the_context_samples_as_full_forwards(prompt_len):
    """The cache is full right after the prompt: the first new token's window moves at once."""
    model = _shipped_model("tiny-deepseek")
    prompt = [(5 * i + 2) % VOCAB for i in range(prompt_len)]
    for temperature, top_k in [(0.0, 0), (1.0, 10)]:
        got = sample(model, prompt, 12, temperature, top_k, prompt_len, -1, torch.Generator().manual_seed(3))
        want = _sample_by_full_forwards(model, prompt, 12, temperature, top_k, prompt_len, -1,
                                        torch.Generator().manual_seed(3))
        assert got == want and len(got) == 12, (prompt_len, temperature)
