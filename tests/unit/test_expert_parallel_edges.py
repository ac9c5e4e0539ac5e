"""Edges of expert parallelism (parallel/expert.py) and expert tensor parallelism: what each rank's
experts are built as, and the EP/ETP layer against the single-process one on gloo ranks."""

import pytest
import torch

from moefold.config import load_config
from moefold.errors import ConfigError
from moefold.models.transformer import build_model
from moefold.moe.experts import GroupedMMExperts, LoopExperts, grouped_mm_supported

needs_grouped_mm = pytest.mark.skipif(not grouped_mm_supported("cpu", torch.float32),
                                      reason="this torch build has no CPU torch._grouped_mm")


def _tiny(**overrides: str):
    return load_config("tiny-qwen3", {"model.dim": "16", "moe.expert_hidden": "12", **overrides})


@needs_grouped_mm
def test_auto_backend_takes_the_etp_slice_s_alignment():
    """expert_hidden 12 is 16-byte aligned in fp32 but its etp=2 slice (6) is not: auto picked
    grouped_mm for the whole experts and every rank's forward then failed inside
    torch._grouped_mm ('strides should be multiple of 16 bytes')."""
    def experts_of(cfg):
        return {type(m) for m in build_model(cfg, 64).modules() if isinstance(m, (GroupedMMExperts, LoopExperts))}
    assert experts_of(_tiny()) == {GroupedMMExperts}
    assert experts_of(_tiny(**{"parallel.etp": "2", "parallel.ep": "2"})) == {LoopExperts}
    assert experts_of(_tiny(**{"parallel.etp": "2", "moe.expert_hidden": "16"})) == {GroupedMMExperts}


def test_explicit_grouped_mm_refuses_an_unaligned_etp_slice_in_one_line():
    cfg = _tiny(**{"parallel.etp": "2", "moe.experts_backend": "grouped_mm"})
    with pytest.raises(ConfigError, match=r"moe.expert_hidden / parallel.etp \(12 / 2 = 6\) to be multiples "
                                          r"of 4 in float32"):
        build_model(cfg, 64)
