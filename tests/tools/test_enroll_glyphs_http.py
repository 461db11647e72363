"""tools/experiments/enroll_glyphs_http.py: the enrolled columns' figures from the server's matches,
against counts by hand."""
from __future__ import annotations

from tools.experiments.enroll_glyphs_http import tally


def test_the_enrolled_columns_are_counted_from_every_match():
    D = 5  # trained ids 0..4; enrolled 5 and 6, two test renderings each
    own = [5, 5, 6, 6]
    on_test = [[5, 2],   # right, and a trained class claims it
               [],       # missed
               [6, 5],   # right, and the other enrolled class says yes: a false match of 5's
               [3]]      # missed, claimed by a trained class
    on_neg = [[6], [1], [], [5, 6, 0]]  # trained classes' held-out renderings: 3 false matches of the enrolled
    r = tally([5, 6], own, on_test, on_neg, D)
    assert (r["true_matches"], r["false_on_new"], r["false_on_trained"]) == (2, 1, 3)
    assert r["recall"] == 2 / 4 and r["pooled_precision"] == 2 / 6
    assert r["trained_claims_on_new"] == 2 and (r["test_images"], r["held_out_images"]) == (4, 4)


def test_no_match_at_all_is_precision_one_and_recall_zero():
    r = tally([5], [5, 5], [[], []], [[0]], 5)
    assert r["recall"] == 0.0 and r["pooled_precision"] == 1.0 and r["false_on_trained"] == 0


def test_numpy_ids_give_plain_numbers_for_json():
    import json

    import numpy as np

    r = tally(np.array([5, 6]), np.repeat(np.array([5, 6]), 2), [[5], [6], [6], []], [[5]], 5)
    assert json.loads(json.dumps(r))["false_on_new"] == 1
