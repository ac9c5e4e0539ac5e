"""`moefold.generate.sample` from Python refuses the options `moefold generate` refuses, with the
command line's one-line messages (one check, `check_sampling`, names the option as each caller
spells it), and a context below 1; before it touches the model."""

import pytest
import torch

from moefold.cli import main
from moefold.errors import UserError
from moefold.generate import sample

GOOD = {"max_new_tokens": 4, "temperature": 0.8, "top_k": 5, "context": 16}
BAD = [  # (option, value, what sample says; its flag, if the command line has one)
    ("max_new_tokens", -5, "sample: max_new_tokens -5 must be >= 0", "--max-new-tokens"),
    ("temperature", -1.0, "sample: temperature -1.0 must be >= 0 (0 is greedy)", "--temperature"),
    ("temperature", float("nan"), "sample: temperature nan must be >= 0 (0 is greedy)", "--temperature"),
    ("top_k", -1, "sample: top_k -1 must be >= 0 (0 samples among all tokens)", "--top-k"),
    ("context", 0, "sample: context 0 must be >= 1 (the tokens the model reads at once: "
                   "context_length(cfg))", None),
    ("context", -3, "sample: context -3 must be >= 1", None),
]


class NoModel:
    """Fails the test if `sample` reaches for the model before checking its options."""

    def __getattr__(self, name):
        raise AssertionError(f"sample used model.{name} before refusing its options")


@pytest.mark.parametrize("option, value, message, flag", BAD, ids=[f"{o}={v}" for o, v, *_ in BAD])
def test_sample_refuses_a_bad_option_with_the_command_line_s_message(option, value, message, flag,
                                                                     tmp_path, capsys):
    """Before, from Python, max_new_tokens -5 returned nothing, a negative temperature sampled
    greedily, a negative top_k among all tokens, a nan temperature failed in torch.multinomial and
    a context below 1 in the KV cache."""
    with pytest.raises(UserError) as refused:
        sample(NoModel(), [1, 2, 3], eos_id=-1, generator=torch.Generator(), **{**GOOD, option: value})
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)
    if flag is not None:  # the command line's line is the same, naming its flag; tmp_path is no run
        capsys.readouterr()
        assert main(["generate", "--run-dir", str(tmp_path), "--prompt", "x", flag, str(value)]) == 2
        line = capsys.readouterr().err.strip()
        assert line.endswith(str(refused.value).replace(f"sample: {option}", flag)), line
