"""tools/experiments/small_folder_aims.py: the figures from detect's answers, against counts by hand."""
from __future__ import annotations

import numpy as np

from tools.experiments.small_folder_aims import figures


def test_false_matches_on_other_classes_images_count_against_precision():
    classes = ["A", "B", "K"]
    labels = ["A", "A", "B", "B", "K"]
    match = np.array([[1, 0, 0],   # A: right
                      [0, 0, 1],   # A: missed, and K says yes to it
                      [0, 1, 0],   # B: right
                      [1, 1, 0],   # B: right, and A says yes to it
                      [0, 0, 0]],  # K: missed
                     dtype=bool)
    r = figures(match, labels, classes)
    assert r["images"] == 5 and r["matches"] == 5 and r["true_matches"] == 3
    assert r["recall"] == 3 / 5 and r["precision"] == 3 / 5
    assert r["mean_recall"] == (1 / 2 + 2 / 2 + 0 / 1) / 3
    assert r["per_class"]["A"] == {"images": 2, "recall": 0.5, "matches": 2, "false_matches": 1}
    assert r["per_class"]["K"] == {"images": 1, "recall": 0.0, "matches": 1, "false_matches": 1}
    assert sorted(r["false_matches"]) == ["A image matched K", "B image matched A"]


def test_a_class_without_images_has_no_recall_and_no_match_means_precision_one():
    r = figures(np.zeros((2, 2), dtype=bool), ["A", "A"], ["A", "K"])
    assert r["per_class"]["K"]["recall"] is None and r["recall"] == 0.0 and r["precision"] == 1.0
