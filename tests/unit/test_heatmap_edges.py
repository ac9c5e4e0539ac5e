"""The expert-load heatmap at its edges: one expert, one window."""

import pytest

from moefold.train.heatmap import _draw, relative_load


def _tick_labels(history) -> tuple[list[str], list[str]]:
    """The drawn panel's (expert, step) tick labels."""
    pytest.importorskip("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure()
    FigureCanvasAgg(fig)
    _draw(fig, relative_load(history), [step for step, _ in history], [0])
    fig.canvas.draw()
    ax = fig.axes[0]
    return [t.get_text() for t in ax.get_yticklabels()], [t.get_text() for t in ax.get_xticklabels()]


def test_a_one_expert_layer_labels_only_expert_zero():
    """The locator of a one-row panel ticks -0.4 ... 0.4, which read as experts "−0.4", "0.2"."""
    experts, _ = _tick_labels([(5, [[7]]), (10, [[9]])])
    assert [label for label in experts if label] == ["0"]

