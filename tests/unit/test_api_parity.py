"""The Python API and the Hugging Face families against independent references (transformers,
naive recomputation), in the cases tests/unit/test_hf_interop.py and test_kv_cache.py leave out."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moefold.checkpoint.hf import save_pretrained  # noqa: E402
from moefold.config import load_config  # noqa: E402
from moefold.models.transformer import build_model  # noqa: E402
from test_hf_interop import randomize_ours as randomize  # noqa: E402

VOCAB = 96
transformers.logging.set_verbosity_error()


def test_group_score_top_k_0_that_means_2_exports_to_deepseek_v3(tmp_path):
    """moe.group_score_top_k = 0 is top_k // group_top_k (here 4 // 2 = 2, DeepSeek-V3's top-2
    group score): the export refused it as if it were not 2."""
    cfg = load_config("tiny-deepseek", {"model.vocab_size": str(VOCAB), "moe.top_k": "4",
                                        "moe.group_score_top_k": "0"})
    ours = build_model(cfg, VOCAB)
    randomize(ours, seed=0)
    save_pretrained(ours.eval(), tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)


def test_sampling_from_a_model_in_training_mode_leaves_its_training_state_alone():
    """`build_model` gives a model in training mode; `sample` from it mid-training added the
    generated tokens to the step's expert counts (moving the expert bias at the next
    `on_optimizer_step`) and ran the router jitter, unlike a full forward in eval mode."""
    from moefold.generate import sample

    cfg = load_config("tiny-deepseek", {"model.n_layers": "2", "moe.input_jitter": "0.9"})
    model = build_model(cfg, VOCAB)
    model.init_weights(0)
    got = sample(model, [1, 2, 3], 12, 0.0, 0, 8, -1, torch.Generator())
    assert model.training  # restored
    assert all(int(layer.step_tokens_per_expert_E.sum()) == 0 for layer in model.moe_layers())
    ids = [1, 2, 3]
    with torch.no_grad():
        for _ in range(12):  # naive: a full eval-mode forward of the latest 8 tokens per token
            ids.append(int(model.eval()(torch.tensor([ids[-8:]]))[0, -1].argmax()))
    assert got == ids[3:]
