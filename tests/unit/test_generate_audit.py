"""Greedy generation with the KV cache against independent references: transformers' own
`generate` on each shipped preset exported to it (a sliding window shorter than the prompt and
the generation included), and decode's rows against each row decoded alone (a token's routing
and attention must not depend on the other sequences of the batch). Default experts backend, fp32."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from moefold.checkpoint.hf import save_pretrained  # noqa: E402
from moefold.config import load_config  # noqa: E402
from moefold.generate import sample  # noqa: E402
from moefold.models.transformer import build_model  # noqa: E402
from test_hf_interop import VOCAB, hf_load, randomize_ours  # noqa: E402

PRESETS = {"tiny": {}, "tiny-qwen3": {}, "tiny-deepseek": {}, "tiny-mixtral": {"model.sliding_window": "5"}}


def _ours(preset: str):
    cfg = load_config(preset, {"model.vocab_size": str(VOCAB), **PRESETS[preset]})
    model = build_model(cfg, VOCAB)
    randomize_ours(model, seed=5)
    return model.eval()


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_greedy_generation_matches_transformers_generate(preset, tmp_path):
    ours = _ours(preset)
    save_pretrained(ours, tmp_path)
    hf, _ = hf_load(tmp_path)
    for prompt_len, new in [(1, 8), (9, 16)]:  # 9 + 16 crosses tiny-mixtral's window of 5 often
        prompt = [(7 * i + 3) % VOCAB for i in range(prompt_len)]
        got = sample(ours, prompt, new, 0.0, 0, 64, -1, torch.Generator())
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert got == out[0, prompt_len:].tolist(), (preset, prompt_len)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_each_row_of_a_batch_decodes_as_it_does_alone(preset):
    model = _ours(preset)
    ids_BS = torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache(10)
    batch_BSV = torch.cat([model.decode(ids_BS[:, :8], cache), model.decode(ids_BS[:, 8:], cache)], dim=1)
    for row in range(3):
        alone = model.new_cache(10)
        row_SV = torch.cat([model.decode(ids_BS[row:row + 1, :8], alone),
                            model.decode(ids_BS[row:row + 1, 8:], alone)], dim=1)[0]
        torch.testing.assert_close(batch_BSV[row], row_SV, rtol=1e-5, atol=1e-5, msg=f"{preset} row {row}")
