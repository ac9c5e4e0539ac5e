"""Every config option at its edge values (-1, 0, odd, huge, nan, ±inf, empty, bogus): the config
either validates or is refused with one ConfigError, and a config that validates builds on the
meta device (no memory) or is refused the same way — never another exception, never a hang.
The single-process training sweep this came from found a dense model that could not be built,
unaligned grouped GEMMs, overflowing capacities and a validation that enumerated 10^8 ranks."""

import pytest
import torch

from moefold.config import field_types, load_config
from moefold.errors import ConfigError
from moefold.models.transformer import build_model

EDGES = {int: ["-1", "0", "3", "100000000"], float: ["-1", "0", "1e30", "nan", "inf", "-inf"],
         str: ["", "bogus"], bool: ["false", "true"]}
# 10^8 layers are 10^8 modules even on the meta device; such a config validates and is not built.
NOT_BUILT = {("model.n_layers", "100000000"), ("model.mtp_layers", "100000000")}


def _cases(preset: str):
    for key, tp in field_types().items():
        for value in EDGES.get(tp, ["bogus", "[]"]):
            yield pytest.param(preset, key, value, id=f"{preset}-{key}={value}")


@pytest.mark.parametrize("preset, key, value", [*_cases("tiny"), *_cases("tiny-deepseek")])
def test_an_edge_value_validates_and_builds_or_is_refused(preset, key, value):
    try:
        cfg = load_config(preset, {key: value})
    except ConfigError as error:
        assert "\n" not in str(error)
        return
    if (key, value) in NOT_BUILT:
        return
    try:
        with torch.device("meta"):
            build_model(cfg, vocab_size=cfg.model.vocab_size or 257, device_type="cpu",
                        compute_dtype=torch.float32)
    except ConfigError as error:
        assert "\n" not in str(error)


def test_no_float_option_validates_at_nan_or_inf():
    floats = [key for key, tp in field_types().items() if tp is float]
    assert len(floats) > 20
    for key in floats:
        for value in ("nan", "inf", "-inf"):
            with pytest.raises(ConfigError, match=f"^{key}={value} must be a finite number$"):
                load_config("tiny", {key: value})
