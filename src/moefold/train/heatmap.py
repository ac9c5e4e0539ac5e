"""Expert-load heatmap: one panel per MoE layer, experts × log windows, coloured by each expert's
load relative to an even share.

L MoE layers, E experts, W logged windows. The history is what the trainer keeps at each log step:
[(step, tokens_per_expert_per_layer)], `tokens_per_expert_per_layer` as `moe.stats.summarize`
returns it. matplotlib (the `viz` extra) is optional and imported only when a figure is written.
"""

import math
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import numpy as np

from moefold.errors import writing
from moefold.files import write_atomically

History = list[tuple[int, list[list[int]]]]

# Colour range of load ÷ even share, on a log scale so that 2× and ½× look equally strong;
# beyond 8× (or below ⅛) the colour saturates, which is already a badly balanced layer.
_RATIO_RANGE = 8.0
_MAX_COLUMNS = 8  # 64 layers → an 8 × 8 grid
_DPI = 100


def append_window(history: History, step: int, tokens_per_expert_per_layer: list[list[int]],
                  max_windows: int = 256) -> None:
    """Append one log window; past `max_windows`, merge neighbours pairwise (counts summed, the later
    step kept), so a long run's history stays a bounded size (a panel has only so many pixels)."""
    history.append((step, tokens_per_expert_per_layer))
    if len(history) <= max_windows:
        return
    merged = [(late_step, [[a + b for a, b in zip(early_E, late_E)] for early_E, late_E in zip(early, late)])
              for (_, early), (late_step, late) in zip(history[0::2], history[1::2])]
    if len(history) % 2:
        merged.append(history[-1])
    history[:] = merged


def write_load_heatmap(history: History, path: Path, layer_ids: list[int] | None = None) -> Path | None:
    """Write the PNG to `path` and return it: atomically (a viewer never sees half a file) and
    durably (`files.write_atomically`: on disk before and after its rename, as a checkpoint is);
    a failed write raises an OutputError naming `path`.

    `layer_ids` titles the panels (default 0..L-1, the MoE layers' order). Returns None when
    matplotlib is not installed or the history is empty.
    """
    if not history:
        return None
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    steps_W = [step for step, _ in history]
    load_L_EW = relative_load(history)
    layer_ids = list(range(len(load_L_EW))) if layer_ids is None else layer_ids
    # Figure + Agg canvas instead of pyplot: no global backend switch, no figure registry to leak.
    fig = Figure(figsize=_layout(len(load_L_EW))[0])
    FigureCanvasAgg(fig)
    _draw(fig, load_L_EW, steps_W, layer_ids)
    path = Path(path)
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, partial(fig.savefig, format="png", dpi=_DPI))
    return path


def relative_load(history: History) -> list[np.ndarray]:
    """Per layer, [E, W] tokens ÷ (the layer's tokens / E): 1 is an even share, 0 no tokens
    (also when the whole layer saw none in that window)."""
    num_layers = len(history[0][1])
    load_L_EW = []
    for layer in range(num_layers):
        counts_EW = np.array([window[layer] for _, window in history], dtype=np.float64).T
        total_W = counts_EW.sum(axis=0)
        share_EW = np.divide(counts_EW, total_W, out=np.zeros_like(counts_EW), where=total_W > 0)
        load_L_EW.append(share_EW * counts_EW.shape[0])
    return load_L_EW


def _grid(num_layers: int) -> tuple[int, int]:
    columns = num_layers if num_layers <= 4 else min(_MAX_COLUMNS, math.ceil(math.sqrt(num_layers)))
    return math.ceil(num_layers / columns), columns


def _layout(num_layers: int) -> tuple[tuple[float, float], dict[str, float], list[float]]:
    """Figure size (inches), the panels' grid spacing and the colour bar's box, laid out by hand:
    constrained layout takes seconds for a 64-panel grid."""
    rows, columns = _grid(num_layers)
    scale = 1.4 if num_layers <= 4 else 1.0 if num_layers <= 16 else 0.85  # few panels: more room each
    panel_w, panel_h, gap_w, gap_h = 2.9 * scale, 2.2 * scale, 0.35, 0.45
    left, right, top, bottom = 0.75, 1.35, 0.65, 0.6  # right: the colour bar and its label
    width = left + columns * panel_w + (columns - 1) * gap_w + right
    height = top + rows * panel_h + (rows - 1) * gap_h + bottom
    grid = {"left": left / width, "right": 1 - right / width, "top": 1 - top / height,
            "bottom": bottom / height, "wspace": gap_w / panel_w, "hspace": gap_h / panel_h}
    panels_h = height - top - bottom
    bar_h = min(panels_h, 6.0)  # a 64-panel grid's full height would be a 20-inch bar
    bar_box = [1 - (right - 0.25) / width, (bottom + (panels_h - bar_h) / 2) / height, 0.15 / width,
               bar_h / height]
    return (width, height), grid, bar_box


def _draw(fig, load_L_EW: list[np.ndarray], steps_W: list[int], layer_ids: list[int]) -> None:
    from matplotlib import colormaps
    from matplotlib.colors import LogNorm
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    rows, columns = _grid(len(load_L_EW))
    (_, height), grid, bar_box = _layout(len(load_L_EW))
    # No sharex/sharey: linking 64 axes makes every limit update quadratic (seconds).
    axes = fig.subplots(rows, columns, squeeze=False, gridspec_kw=grid).ravel()
    # Zero (an expert that got no tokens) is off a log scale: matplotlib masks it, drawn black.
    cmap = colormaps["RdBu_r"].with_extremes(bad="black")
    norm = LogNorm(vmin=1 / _RATIO_RANGE, vmax=_RATIO_RANGE)
    step_label = FuncFormatter(lambda x, _: _step_at(steps_W, x))
    same_experts = len({load_EW.shape[0] for load_EW in load_L_EW}) == 1
    for i, (ax, load_EW) in enumerate(zip(axes, load_L_EW)):
        image = ax.imshow(np.ma.masked_less_equal(load_EW, 0), cmap=cmap, norm=norm, aspect="auto",
                          interpolation="nearest", origin="lower")
        ax.set_title(f"layer {layer_ids[i]}", fontsize=9, pad=3)
        ax.xaxis.set_major_locator(MaxNLocator(nbins=4, integer=True))
        ax.xaxis.set_major_formatter(step_label)
        ax.yaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))
        # Experts are rows 0..E-1: a one-expert panel's locator puts ticks at fractions too.
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _, rows=range(load_EW.shape[0]): _step_at(rows, y)))
        bottom_row, left_column = i >= len(load_L_EW) - columns, i % columns == 0
        ax.tick_params(labelsize=7, labelbottom=bottom_row, labelleft=left_column or not same_experts)
        if left_column:
            ax.set_ylabel("expert", fontsize=8)
        if bottom_row:
            ax.set_xlabel("step", fontsize=8)
    for ax in axes[len(load_L_EW):]:
        ax.set_axis_off()
    _colour_bar(fig, image, bar_box)
    fig.suptitle("expert load per layer", y=1 - 0.15 / height, va="top")


def _step_at(steps_W: Sequence[int], x: float) -> str:
    """The step of window column `x` (or the expert of row `x`, given range(E)); nothing between
    columns (a one-window panel's locator puts ticks at fractions, which would all read as the one
    window's step)."""
    w = round(x)
    return str(steps_W[w]) if abs(x - w) < 1e-6 and 0 <= w < len(steps_W) else ""


def _colour_bar(fig, image, box: list[float]) -> None:
    ticks = [2.0 ** k for k in range(-3, 4)]
    bar = fig.colorbar(image, cax=fig.add_axes(box), extend="both")
    bar.minorticks_off()  # a log colour bar labels its minor ticks 2×10⁻¹ ...; the powers of 2 suffice
    bar.set_ticks(ticks, labels=[f"1/{round(1 / t)}" if t < 1 else f"{t:g}" for t in ticks])
    bar.ax.tick_params(labelsize=8)
    bar.set_label("tokens ÷ even share (1 = 1/E); black: none", fontsize=8)
