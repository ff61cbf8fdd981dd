"""TensorBoard's first screen as a browser shows it: over runs of five models, one of them with
histograms, the Time Series tab (TensorBoard's landing page) opens on the loss and eval curves of
every run. A real `tensorboard` server, read by Debian's headless Chromium (`.ci/run` installs
it; without it the test fails and says how to install it)."""

from __future__ import annotations

import pytest
from helpers import read_events

import zoo
from benchmarks.tensorboard_screens import (
    find_chromium,
    tensorboard,
    time_series_cards,
    wait_for_tags,
)

RUNS = {"mlp": ("logging.histogram_every=1",), "gpt": (), "xor": (), "cnn": (), "vae": ()}
"""mlp with histograms; vae with images of its own."""
QUICK = ("trainer.steps=2", "trainer.log_every=1", "trainer.batch_size=16")


@pytest.fixture(scope="module")
def browser() -> str:
    """Debian's chromium; without it the test fails (before training), saying how to install
    it."""
    try:
        return find_chromium()
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    """A tiny run of each model (the sizes its registration declares for tests), side by side."""
    logdir = tmp_path_factory.mktemp("runs")
    for name, extra in RUNS.items():
        zoo.fit(name, *zoo.get_model(name).tiny, *QUICK, *extra, f"workdir={logdir / name}")
    return logdir


def test_the_first_screen_shows_the_loss_curves_of_every_run_before_any_histogram(browser, logdir):
    tags = {name: read_events(logdir / name).Tags() for name in RUNS}
    assert tags["mlp"]["histograms"]
    with tensorboard(logdir) as base:
        for plugin in ("scalars", "histograms"):
            wait_for_tags(base, plugin, {name: tags[name][plugin] for name in RUNS})
        groups, cards = time_series_cards(browser, base)
    assert groups[:2] == ["train", "val"], groups  # the two groups TensorBoard opens
    assert "weights" in groups, groups  # the histograms, after them
    assert {card.group for card in cards} == {"train", "val"}  # the only two open
    titles = [card.title for card in cards]
    assert "train/loss" in titles, titles  # drawn: it starts on the first screen
    loss = titles.index("train/loss")
    assert all(card.group == "train" for card in cards[:loss])
    assert set(RUNS) <= set(cards[loss].text.split()), cards[loss].text  # a curve of every run
